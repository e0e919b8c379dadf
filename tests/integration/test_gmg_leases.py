"""Lease and staging commits: all-or-nothing, pinned weights, idempotent close, expiry."""
from __future__ import annotations

import pytest

from shared.config import parse_cluster, parse_tenants
from shared.gmg import Committed, GMGStore, Refused, Reservation, Room
from shared.gmg.follower import read_mirror
from shared.gmg.lease_store import Lease, LeaseStore
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.1},
                         "devices": [{"id": "g0", "backend": "emulated", "memory_bytes": 10_000},
                                     {"id": "h0", "backend": "emulated", "memory_bytes": 10_000}]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["h0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["g0"]}]})


async def _setup(redis, prefix) -> tuple[GMGStore, LeaseStore]:
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    return store, LeaseStore(store)


def _lease(lid: str, nbytes: int, segs=("mlp[0]",), end: float = 200.0) -> Lease:
    return Lease(lid, "a", "g0", tuple(segs), 100.0, end, nbytes, home="h0")


async def _state(redis, store):
    mirror, epoch, _ = await read_mirror(redis, store.keys)
    return mirror, epoch


async def test_lease_needs_resident_weights_and_memory(redis, prefix):
    store, leases = await _setup(redis, prefix)
    before = await _state(redis, store)
    r = await leases.commit(_lease("L1", 100))
    assert isinstance(r, Refused) and r.reason == "not_resident" and r.detail == "a|mlp[0]"
    assert await _state(redis, store) == before  # nothing changed, not even the epoch
    assert isinstance(await leases.stage("g0", "a", {"mlp[0]": 4000, "mlp[1]": 3000}), int)
    assert (await store.device("g0"))["reserved"] == "7000"
    before = await _state(redis, store)
    r = await leases.commit(_lease("L1", 2001, segs=("mlp[0]", "mlp[1]")))  # 7000 + 2001 > 9000
    assert isinstance(r, Refused) and r.reason == "insufficient_memory" and r.device == "g0"
    assert await _state(redis, store) == before
    epoch = await leases.commit(_lease("L1", 2000, segs=("mlp[0]", "mlp[1]")))
    assert isinstance(epoch, int) and epoch == before[1] + 1
    snap_m, _ = await _state(redis, store)
    k = store.keys
    assert snap_m[k.lease("L1")]["state"] == "active" and snap_m[k.leases("g0")] == {"L1": 200.0}
    assert snap_m[k.pins("g0")] == {"a|mlp[0]": "1", "a|mlp[1]": "1"}
    assert (await store.reservations("g0"))["lease:L1"].nbytes == 2000
    r = await leases.commit(_lease("L1", 1))
    assert isinstance(r, Refused) and r.reason == "lease_exists"


async def test_pinned_weights_cannot_be_evicted_and_close_is_idempotent(redis, prefix):
    store, leases = await _setup(redis, prefix)
    await leases.stage("g0", "a", {"mlp[0]": 1000})
    assert isinstance(await leases.commit(_lease("L1", 500)), int)
    before = await _state(redis, store)
    r = await leases.evict("g0", "a", ["mlp[0]"])
    assert isinstance(r, Refused) and r.reason == "pinned"
    assert await _state(redis, store) == before
    r = await leases.evict("h0", "a", ["mlp[0]"])  # home weights are not staged weights
    assert isinstance(r, Refused) and r.reason == "not_staged"
    closed = await leases.close("L1", "revoked", "home_needs_device")
    assert closed is not None and closed.nbytes == 500
    assert await leases.close("L1", "revoked") is None  # second close changes nothing
    assert (await store.device("g0"))["reserved"] == "1000"
    assert await leases.evict("g0", "a", ["mlp[0]"]) == 1000
    mirror, _ = await _state(redis, store)
    dev = mirror[store.keys.device("g0")]
    assert dev["reserved"] == "0" and store.keys.lease("L1") not in mirror
    assert ("a|mlp[0]" not in mirror.get(store.keys.resident("g0"), {}))
    assert mirror[store.keys.resident("g0")]["b|mlp[0]"]  # g0's own tenant's weights stay resident


async def test_expire_closes_only_ended_leases(redis, prefix):
    store, leases = await _setup(redis, prefix)
    await leases.stage("g0", "a", {"mlp[0]": 1000})
    for lid, end in (("E1", 150.0), ("E2", 250.0)):
        assert isinstance(await leases.commit(_lease(lid, 100, end=end)), int)
    assert await leases.expire(now=200.0) == ["E1"]
    assert [x.lease_id for x in await leases.active("g0")] == ["E2"]
    assert int((await store.device("g0"))["reserved"]) == 1100
    assert (await redis.hget(store.keys.pins("g0"), "a|mlp[0]")) == b"1"


async def test_resize_grows_within_limit_only(redis, prefix):
    store, _ = await _setup(redis, prefix)
    assert isinstance(await store.reserve([Reservation("h0", "kv:r1", "kv", "a", 1000)]), int)
    assert isinstance(await store.resize("h0", "kv:r1", 9000), int)
    r = await store.resize("h0", "kv:r1", 9001)
    assert isinstance(r, Refused) and r.reason == "insufficient_memory"
    assert isinstance(await store.resize("h0", "kv:r1", 10), int)
    assert (await store.reservations("h0"))["kv:r1"] == Reservation("h0", "kv:r1", "kv", "a", 10)
    assert (await store.device("h0"))["reserved"] == "10"
    r = await store.resize("h0", "kv:nope", 5)
    assert isinstance(r, Refused) and r.reason == "unknown_owner"


async def test_stage_and_lease_in_one_commit_all_or_nothing(redis, prefix):
    store, leases = await _setup(redis, prefix)
    before = await _state(redis, store)
    # 4000 + 3000 of weights + 2001 for the lease > 9000: nothing staged, nothing leased
    r = await leases.commit(_lease("L1", 2001, segs=("mlp[0]", "mlp[1]")), stage={"mlp[0]": 4000, "mlp[1]": 3000})
    assert isinstance(r, Refused) and r.reason == "insufficient_memory"
    assert await _state(redis, store) == before
    epoch = await leases.commit(_lease("L1", 2000, segs=("mlp[0]", "mlp[1]")), stage={"mlp[0]": 4000})
    assert isinstance(r, Refused) and isinstance(epoch, Refused) and epoch.reason == "not_resident"  # mlp[1] is not
    epoch = await leases.commit(_lease("L1", 2000, segs=("mlp[0]", "mlp[1]")), stage={"mlp[0]": 4000, "mlp[1]": 3000})
    assert isinstance(epoch, int) and epoch == before[1] + 1  # one commit, one epoch
    assert (await store.device("g0"))["reserved"] == "9000"
    m, _ = await _state(redis, store)
    assert m[store.keys.resident("g0")]["a|mlp[0]"] == "4000" and m[store.keys.pins("g0")]["a|mlp[1]"] == "1"
    # staging a segment that is resident already is refused as such, and changes nothing
    before = await _state(redis, store)
    r = await leases.commit(_lease("L2", 1, segs=("mlp[0]",)), stage={"mlp[0]": 4000})
    assert isinstance(r, Refused) and r.reason == "already_resident" and r.detail == "a|mlp[0]"
    assert await _state(redis, store) == before


# ---------------------------------------------------------------- a commit that makes room (one script)
CLUSTER3 = parse_cluster({"cluster": {"headroom_fraction": 0.1},
                          "devices": [{"id": d, "backend": "emulated", "memory_bytes": 10_000}
                                      for d in ("g0", "h0", "h1")]})
TENANTS3 = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["h0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["g0"]},
    {"name": "c", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["h1"]}]})


async def _setup3(redis, prefix) -> tuple[GMGStore, LeaseStore]:
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER3, TENANTS3)
    # g0 is b's home: its worker holds b's weights (as services/worker does), 1000 bytes of the 9000 limit
    assert isinstance(await store.reserve([Reservation("g0", "weights:b:home", "weights", "b", 1000)]), int)
    return store, LeaseStore(store)


async def _replayed(redis, store, before_mirror) -> tuple[str, dict]:
    """(op, the mirror ``before_mirror`` with the change stream's last entry replayed): what a follower computes."""
    import copy

    from shared.gmg.mutations import apply_mutation, decode_change

    mirror = copy.deepcopy(before_mirror)
    (_, fields), = await redis.xrevrange(store.keys.changes, "+", "-", count=1)
    _, op, muts = decode_change(fields)
    for cmd, key, args in muts:
        apply_mutation(mirror, cmd, key, args)
    return op, mirror


async def test_commit_evicts_least_recently_leased_cached_weights_to_fit(redis, prefix):
    store, leases = await _setup3(redis, prefix)
    k = store.keys
    assert isinstance(await leases.stage("g0", "c", {"mlp[0]": 2000, "mlp[1]": 2000, "mlp[2]": 2000}), int)
    # reserved 7000 of 9000; a's lease stages 3500 and holds 1000: 2500 short. mlp[1] is not in the recency
    # (never leased by this scheduler: oldest), then mlp[0] (2.0) before mlp[2] (3.0)
    before_m, before_e = await _state(redis, store)
    res = await leases.commit_making_room(_lease("L1", 1000), {"c|mlp[0]": 2.0, "c|mlp[2]": 3.0},
                                          stage={"mlp[0]": 3500})
    assert isinstance(res, Committed) and res.epoch == before_e + 1  # one script, one epoch
    assert res.evicted == (("g0", "c", "mlp[1]", 2000), ("g0", "c", "mlp[0]", 2000))
    assert (await store.device("g0"))["reserved"] == str(7000 - 4000 + 3500 + 1000)
    owners = set(await store.reservations("g0"))
    assert owners == {"weights:b:home", "weights:c:mlp[2]", "weights:a:mlp[0]", "lease:L1"}
    m, _ = await _state(redis, store)
    assert not {"c|mlp[0]", "c|mlp[1]"} & set(m[k.resident("g0")]) and "c|mlp[2]" in m[k.resident("g0")]
    assert m[k.pins("g0")] == {"a|mlp[0]": "1"}
    # a follower replaying the one change entry gets the same GMG (evictions included)
    op, replayed = await _replayed(redis, store, before_m)
    assert op == "lease_commit" and replayed == m
    # a commit that fits evicts nothing
    assert (await leases.commit_making_room(_lease("L2", 100), {})).evicted == ()


async def test_commit_never_evicts_pinned_home_or_own_weights_and_a_refusal_changes_nothing(redis, prefix):
    store, leases = await _setup3(redis, prefix)
    k = store.keys
    # c's mlp[0] is pinned by an active lease; a's own mlp[1] is cached; c's mlp[1] is cached (evictable);
    # a weights reservation of the home tenant named like a staged one is not evicted either
    assert isinstance(await leases.stage("g0", "c", {"mlp[0]": 2000, "mlp[1]": 1000}), int)
    assert isinstance(await leases.stage("g0", "a", {"mlp[1]": 1000}), int)
    assert isinstance(await leases.commit(Lease("P", "c", "g0", ("mlp[0]",), 100.0, 200.0, 500)), int)
    assert isinstance(await store.reserve([Reservation("g0", "weights:b:mlp[0]", "weights", "b", 2000)]), int)
    assert (await store.device("g0"))["reserved"] == "7500"
    before = await _state(redis, store)
    # needs 3000 (short 1500): only c|mlp[1] (1000) may go: refused, nothing evicted, not even the epoch bumped
    r = await leases.commit_making_room(_lease("L1", 1000), {}, stage={"mlp[0]": 2000})
    assert isinstance(r, Refused) and r.reason == "insufficient_memory" and r.detail == "1500"
    assert await _state(redis, store) == before
    # a refusal on a guard comes first: nothing evicted either
    r = await leases.commit_making_room(_lease("P", 1000), {}, stage={"mlp[0]": 2000})
    assert isinstance(r, Refused) and r.reason == "lease_exists" and await _state(redis, store) == before
    # needs 2500 (short 1000): c|mlp[1] goes, the pinned, home and own weights stay
    res = await leases.commit_making_room(_lease("L1", 500), {}, stage={"mlp[0]": 2000})
    assert isinstance(res, Committed) and res.evicted == (("g0", "c", "mlp[1]", 1000),)
    owners = set(await store.reservations("g0"))
    assert {"weights:c:mlp[0]", "weights:a:mlp[1]", "weights:b:mlp[0]", "weights:b:home", "lease:P"} <= owners
    resident = set((await _state(redis, store))[0][k.resident("g0")])
    assert {"c|mlp[0]", "a|mlp[1]", "b|mlp[0]"} <= resident and "c|mlp[1]" not in resident
    assert (await store.device("g0"))["reserved"] == "9000"


async def test_kv_reservation_makes_room_keeping_the_keep_tenants_weights(redis, prefix):
    store, leases = await _setup3(redis, prefix)
    assert isinstance(await leases.stage("g0", "a", {"mlp[0]": 3000}), int)
    assert isinstance(await leases.stage("g0", "c", {"mlp[0]": 3000}), int)
    kv = [Reservation("g0", "kv:r1", "kv", "a", 3000)]
    before = await _state(redis, store)
    # keep a and c: nothing may go
    r = await store.commit_making_room("reserve", kv, [Room("g0", ("a", "c"))])
    assert isinstance(r, Refused) and r.reason == "insufficient_memory" and await _state(redis, store) == before
    # without a room the commit is refused as before; with one keeping a, c's weights make way
    assert isinstance(await store.reserve(kv), Refused)
    res = await store.commit_making_room("reserve", kv, [Room("g0", ("a",), {"c|mlp[0]": 1.0})])
    assert isinstance(res, Committed) and res.evicted == (("g0", "c", "mlp[0]", 3000),)
    assert set(await store.reservations("g0")) == {"weights:b:home", "weights:a:mlp[0]", "kv:r1"}
