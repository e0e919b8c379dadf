"""Property test of GMG memory safety: random sequences of admissions, KV growth and shrink, releases, weight
staging and eviction, lease commits (also ones that evict cached weights to fit) and closes, checked against a
model after every step. No device ever exceeds
capacity - headroom, the store refuses exactly when the model says it must, and every refusal is clean: the
store (every reservation, pin, residency entry and the epoch) is unchanged after it."""
from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Refused, Reservation
from shared.gmg.lease_store import Lease, LeaseStore
from shared.redis_util import command_client

pytestmark = pytest.mark.integration

DEVS = ("d0", "d1", "d2")
LIMIT = 9000  # 10_000 bytes, 10% headroom
CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.1},
                         "devices": [{"id": d, "backend": "emulated", "memory_bytes": 10_000} for d in DEVS]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d1"]}]})
SEGS = ("mlp[0]", "mlp[1]", "mlp[2]")
HOME = {(d, t, s) for d, t in (("d0", "a"), ("d1", "b")) for s in SEGS}  # homes hold all their weights
sizes = st.integers(min_value=0, max_value=4000)


class GMGMachine(RuleBasedStateMachine):
    """The model: reservations per device, staged segments, pins, active leases."""

    loop: asyncio.AbstractEventLoop
    redis_url: str
    base: str

    @initialize()
    def setup(self):
        self.redis = command_client(self.redis_url)
        self.store = GMGStore(self.redis, f"{self.base}{uuid.uuid4().hex[:8]}:")
        self.leases = LeaseStore(self.store)
        self.run(self.store.register_cluster(CLUSTER, TENANTS))
        self.res: dict[str, dict[str, int]] = {d: {} for d in DEVS}  # device -> owner -> bytes
        self.staged: set[tuple[str, str, str]] = set()  # (device, tenant, segment)
        self.pins: dict[tuple[str, str, str], int] = {}
        self.active: dict[str, Lease] = {}
        self.n = 0
        self.recency: dict[tuple[str, str, str], int] = {}  # staged entry -> when last staged or leased (unique)
        self.clock = 0

    def teardown(self):
        if hasattr(self, "redis"):
            self.run(self.redis.aclose())

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def used(self, d: str) -> int:
        return sum(self.res[d].values())

    def touch(self, entries) -> None:
        for e in entries:
            self.clock += 1
            self.recency[e] = self.clock

    def state(self):
        k, pipe = self.store.keys, self.redis.pipeline(transaction=False)
        pipe.get(k.epoch)
        for d in DEVS:
            pipe.hgetall(k.reservations(d))
            pipe.hget(k.device(d), "reserved")
            pipe.hgetall(k.resident(d))
            pipe.hgetall(k.pins(d))
            pipe.zrange(k.leases(d), 0, -1)
        return self.run(pipe.execute())

    def expect(self, result, refused_reason: str | None, before):
        """The store agrees with the model; a refusal leaves everything as it was."""
        if refused_reason is None:
            assert not isinstance(result, Refused), result
        else:
            assert isinstance(result, Refused) and result.reason == refused_reason, (result, refused_reason)
            assert self.state() == before

    # ------------------------------------------------------------ rules
    @rule(devs=st.lists(st.sampled_from(DEVS), min_size=1, max_size=3), size=sizes)
    def admit(self, devs, size):
        self.n += 1
        need = {d: devs.count(d) * size for d in devs}
        fits = all(self.used(d) + need[d] <= LIMIT for d in need) or size == 0
        items = [Reservation(d, f"kv:{self.n}:{i}", "kv", "a", size) for i, d in enumerate(devs)]
        before = self.last
        self.expect(self.run(self.store.reserve(items)), None if fits else "insufficient_memory", before)
        if fits:
            for it in items:
                self.res[it.device][it.owner] = size

    @rule(data=st.data(), size=sizes)
    def resize_kv(self, data, size):
        kv = [(d, o) for d in DEVS for o in self.res[d] if o.startswith("kv:")]
        if not kv:
            return
        d, o = data.draw(st.sampled_from(kv))
        fits = self.used(d) - self.res[d][o] + size <= LIMIT or size <= self.res[d][o]
        before = self.last
        self.expect(self.run(self.store.resize(d, o, size)), None if fits else "insufficient_memory", before)
        if fits:
            self.res[d][o] = size

    @rule(data=st.data())
    def release_kv(self, data):
        kv = [(d, o) for d in DEVS for o in self.res[d] if o.startswith("kv:")]
        if kv:
            d, o = data.draw(st.sampled_from(kv))
            assert self.run(self.store.release(d, o)) == self.res[d].pop(o)

    @rule(dev=st.sampled_from(DEVS), tenant=st.sampled_from("ab"), segs=st.sets(st.sampled_from(SEGS), min_size=1),
          size=st.integers(min_value=1, max_value=3000))
    def stage(self, dev, tenant, segs, size):
        segs = sorted(segs)
        dup = any((dev, tenant, s) in self.staged | HOME for s in segs)
        fits = self.used(dev) + size * len(segs) <= LIMIT
        before = self.last
        res = self.run(self.leases.stage(dev, tenant, {s: size for s in segs}))
        self.expect(res, "already_resident" if dup else None if fits else "insufficient_memory", before)
        if not isinstance(res, Refused):
            for s in segs:
                self.staged.add((dev, tenant, s))
                self.res[dev][f"weights:{tenant}:{s}"] = size
            self.touch((dev, tenant, s) for s in segs)

    @rule(dev=st.sampled_from(DEVS), tenant=st.sampled_from("ab"), seg=st.sampled_from(SEGS))
    def evict(self, dev, tenant, seg):
        key = (dev, tenant, seg)
        reason = "not_staged" if key not in self.staged else "pinned" if self.pins.get(key, 0) else None
        before = self.last
        res = self.run(self.leases.evict(dev, tenant, [seg]))
        self.expect(res, reason, before)
        if reason is None:
            self.staged.discard(key)
            assert res == self.res[dev].pop(f"weights:{tenant}:{seg}")

    @rule(guest=st.sampled_from(DEVS), tenant=st.sampled_from("ab"),
          segs=st.sets(st.sampled_from(SEGS), min_size=1, max_size=2), size=sizes)
    def commit_lease(self, guest, tenant, segs, size):
        self.n += 1
        lease = Lease(f"L{self.n}", tenant, guest, tuple(sorted(segs)), 1.0, 2.0, size)
        missing = [s for s in lease.segments if (guest, tenant, s) not in self.staged | HOME]
        fits = self.used(guest) + size <= LIMIT
        reason = "not_resident" if missing else None if fits else "insufficient_memory"
        before = self.last
        self.expect(self.run(self.leases.commit(lease)), reason, before)
        if reason is None:
            self.active[lease.lease_id] = lease
            self.res[guest][f"lease:{lease.lease_id}"] = size
            for s in lease.segments:
                self.pins[(guest, tenant, s)] = self.pins.get((guest, tenant, s), 0) + 1

    @rule(data=st.data(), tenant=st.sampled_from("ab"), segs=st.sets(st.sampled_from(SEGS), min_size=1, max_size=2),
          ssize=st.integers(min_value=1, max_value=3000), listed=st.booleans())
    def commit_lease_making_room(self, data, tenant, segs, ssize, listed):
        """A lease commit staging its missing segments, which may evict the guest's cached weights (staged, not
        the lease's tenant's, unpinned), least recently staged or leased first, to fit; refused unchanged if
        even all of them would not make it fit. The guest is mostly one holding another tenant's staged weights
        and the lease's size around what fits without evicting. ``listed``: pass the recency (else every entry
        ties; then only the bytes freed are predictable, not which entries go)."""
        self.n += 1
        others = sorted({d for d, t, _ in self.staged if t != tenant})
        guest = data.draw(st.sampled_from(others) if others else st.sampled_from(DEVS))
        lease_segs = tuple(sorted(segs))
        stage = {s: ssize for s in lease_segs if (guest, tenant, s) not in self.staged | HOME}
        cands = sorted((e for e in self.staged if e[0] == guest and e[1] != tenant and not self.pins.get(e, 0)),
                       key=self.recency.__getitem__)
        nbytes = {e: self.res[guest][f"weights:{e[1]}:{e[2]}"] for e in cands}
        room = LIMIT - self.used(guest) - ssize * len(stage)
        size = max(0, room + data.draw(st.integers(min_value=-500, max_value=sum(nbytes.values()) + 500)))
        lease = Lease(f"L{self.n}", tenant, guest, lease_segs, 1.0, 2.0, size)
        short = size - room
        fits = short <= 0 or sum(nbytes.values()) >= short
        recency = {f"{t}|{s}": float(self.recency[(d, t, s)]) for d, t, s in self.staged if d == guest} \
            if listed else {}
        before = self.last
        res = self.run(self.leases.commit_making_room(lease, recency, stage=stage))
        self.expect(res, None if fits else "insufficient_memory", before)
        if not fits:
            return
        evicted = {(d, t, s) for d, t, s, _ in res.evicted}
        assert all(n == nbytes[(d, t, s)] for d, t, s, n in res.evicted)
        freed = sum(nbytes[e] for e in evicted)
        assert evicted <= set(cands) and freed >= max(short, 0)
        if short <= 0:
            assert not evicted
        elif listed:  # the least recent ones, just enough
            want, got = [], 0
            for e in cands:
                if got >= short:
                    break
                want.append(e)
                got += nbytes[e]
            assert evicted == set(want)
        else:  # in some order, none beyond the one that made it fit
            assert any(freed - nbytes[e] < short for e in evicted)
        for d, t, s in evicted:
            self.staged.discard((d, t, s))
            self.res[d].pop(f"weights:{t}:{s}")
        for s, n in stage.items():
            self.staged.add((guest, tenant, s))
            self.res[guest][f"weights:{tenant}:{s}"] = n
        self.active[lease.lease_id] = lease
        self.res[guest][f"lease:{lease.lease_id}"] = size
        for s in lease.segments:
            self.pins[(guest, tenant, s)] = self.pins.get((guest, tenant, s), 0) + 1
        self.touch((guest, tenant, s) for s in lease.segments if (guest, tenant, s) in self.staged)

    @rule(data=st.data(), state=st.sampled_from(["revoked", "expired", "released"]))
    def close_lease(self, data, state):
        if not self.active:
            return
        lid = data.draw(st.sampled_from(sorted(self.active)))
        lease = self.active.pop(lid)
        assert self.run(self.leases.close(lid, state)) == lease
        assert self.run(self.leases.close(lid, state)) is None  # closing twice changes nothing
        self.res[lease.guest].pop(f"lease:{lid}")
        for s in lease.segments:
            self.pins[(lease.guest, lease.tenant, s)] -= 1
        self.touch((lease.guest, lease.tenant, s) for s in lease.segments
                   if (lease.guest, lease.tenant, s) in self.staged)

    # ------------------------------------------------------------ invariants
    @invariant()
    def never_over_limit_and_accounting_matches(self):
        if not hasattr(self, "store"):
            return
        st_ = self.last = self.state()  # also the "before" of the next step
        for i, d in enumerate(DEVS):
            rows, reserved = st_[1 + 5 * i], int(st_[2 + 5 * i])
            total = sum(int(v.decode().split("|")[2]) for v in rows.values())
            assert reserved == total == self.used(d) <= LIMIT
            assert {k.decode() for k in rows} == set(self.res[d])
            resident, pins = st_[3 + 5 * i], st_[4 + 5 * i]
            home = {"d0": "a", "d1": "b"}.get(d)  # a home holds every segment of its tenant, SEGS among them
            assert {k.decode() for k in resident if not k.decode().startswith(f"{home}|")} == {
                f"{t}|{s}" for dd, t, s in self.staged if dd == d}
            assert {k.decode(): int(v) for k, v in pins.items() if int(v)} == {
                f"{t}|{s}": n for (dd, t, s), n in self.pins.items() if dd == d and n}


@pytest.mark.parametrize("examples", [
    int(os.environ.get("GMG_PROPERTY_EXAMPLES", "250")),
    pytest.param(3000, marks=[pytest.mark.slow, pytest.mark.timeout(1800)]),  # thousands: `pytest -m slow`
])
def test_gmg_memory_safety_property(redis_url, prefix, examples):
    loop = asyncio.new_event_loop()
    GMGMachine.loop, GMGMachine.redis_url, GMGMachine.base = loop, redis_url, prefix
    try:
        # the machine's invariants assert after every step (never over capacity - headroom, clean refusals)
        assert GMGMachine.redis_url == redis_url
        run_state_machine_as_test(GMGMachine, settings=settings(
            max_examples=examples, stateful_step_count=12, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
    finally:
        async def cleanup():
            r = command_client(redis_url)
            keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=5000)]
            for i in range(0, len(keys), 1000):
                await r.delete(*keys[i:i + 1000])
            await r.aclose()
        loop.run_until_complete(cleanup())
        loop.close()
