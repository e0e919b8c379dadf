"""Guest execution between two real worker processes on a real redis-server (DESIGN §4 safety rules):
tokens identical with the MLP segments leased to a guest over shm and tcp, revocation, a guest killed (SIGKILL)
mid-lease, and the guest's own tenant bursting while it serves a lease."""
from __future__ import annotations

import random
import time

import pytest

from support.guest_pair import DRIVER, GUEST, GuestPair
from shared.transport import reap_orphan_segments

pytestmark = pytest.mark.integration

MLPS = [f"mlp[{i}]" for i in range(4)]  # the tiny preset has 4 layers
INLINE_MAX = str(64 * 1024)  # decode micro-batches ride inline; prefill chunks of 64+ rows use the transport
# a generous floor: on a loaded 2-core VM a round trip can stall past 25 ms; that step then runs at home, which
# is correct but would hide whether the guest path works
STEADY = {"SLICESCHED_SEGMENT_INLINE_MAX": INLINE_MAX, "SLICESCHED_SEGMENT_TIMEOUT_FLOOR_MS": "500"}


def prompts(n: int, seed: int, length=(3, 24)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(*length))] for _ in range(n)]


def tokens(outs) -> dict[int, list[int]]:
    return {i: o.tokens for i, o in outs.items()}


@pytest.fixture
async def pair_factory(tmp_path, redis_url, prefix):
    made: list[GuestPair] = []

    async def make(link: str = "shm", **kw) -> GuestPair:
        p = GuestPair(tmp_path, redis_url, prefix, link=link, **kw)
        made.append(p)
        await p.start()
        return p

    yield make
    for p in made:
        await p.stop()
    reap_orphan_segments()


async def _lease_ready(pair: GuestPair, lid: str) -> None:
    await pair.wait_health(DRIVER, lambda h: f"{lid}:ready" in h.get("leases_driver", ""), 30)


def prefix(outs, n: int) -> dict[int, list[int]]:
    """The first ``n`` tokens: a run with ``max_tokens=n`` plans the same batches until then, so it computes the
    same values bit for bit (the batch composition decides the GEMM shapes and the attention padding)."""
    return {i: o.tokens[:n] for i, o in outs.items()}


async def _leased_run_matches(pair: GuestPair, ps, alone, max_tokens: int) -> tuple[dict, dict]:
    before = await pair.fresh_health(DRIVER)
    leased = await pair.run(DRIVER, "ta", ps, max_tokens=max_tokens)
    d, g = await pair.fresh_health(DRIVER), await pair.fresh_health(GUEST)
    assert tokens(leased) == prefix(alone, max_tokens)
    calls = int(d["remote_calls"]) - int(before.get("remote_calls") or 0)
    fallbacks = int(d["remote_fallbacks"]) - int(before.get("remote_fallbacks") or 0)
    assert calls > 0 and int(g["guest_served"]) > 0, (d, g)
    assert fallbacks <= calls // 10, d  # the guest did (nearly all of) the work
    return d, g


async def test_lease_over_shm_identical_tokens_revoke_and_guest_killed(pair_factory):
    """16 requests decode together (two micro-batches of 8) with every MLP on the guest; after a revoke the
    guest serves nothing; under a new lease the guest is SIGKILLed mid-request and the tokens stay the same."""
    pair = await pair_factory("shm", env=STEADY)
    ps = prompts(16, 1, length=(3, 90))
    alone = await pair.run(DRIVER, "ta", ps, max_tokens=100)
    lid = await pair.grant(MLPS)
    await _lease_ready(pair, lid)
    d, g = await _leased_run_matches(pair, ps, alone, 12)
    assert int(g["staged_segments"]) == len(MLPS)

    await pair.revoke(lid)
    await pair.wait_health(GUEST, lambda h: f"{lid}:ended" in h.get("leases_guest", ""), 10)
    await pair.wait_health(DRIVER, lambda h: f"{lid}:ended" in h.get("leases_driver", ""), 10)
    after = await pair.run(DRIVER, "ta", ps, max_tokens=6)
    assert tokens(after) == prefix(alone, 6)
    served = int((await pair.fresh_health(GUEST))["guest_served"])
    assert served == int(g["guest_served"]), "the guest served a revoked lease"

    lid2 = await pair.grant(MLPS)  # weights still cached on the guest: no staging this time
    await _lease_ready(pair, lid2)
    outs = await pair.submit(DRIVER, "ta", ps, 100, "gwkill")
    # kill as soon as every request has its first decode tokens (read straight off the tokens stream: the health
    # hash is refreshed once a second, by which time a fast machine has finished all 100 tokens)
    await pair.wait_tokens("gwkill", 3 * len(ps))
    pair.kill(GUEST)
    killed_ms = time.time() * 1e3
    outs = await pair.collect("gwkill", outs, timeout_s=60)
    assert {int(r.rsplit("-", 1)[1]): o.tokens for r, o in outs.items()} == tokens(alone)
    assert max(o.chunk_ms[-1] for o in outs.values()) > killed_ms, "the requests ended before the guest died"
    h = await pair.fresh_health(DRIVER)
    assert f"{lid2}:" in h["leases_driver"] and int(h["remote_fallbacks"]) >= 1, h


async def test_lease_over_tcp_identical_tokens(pair_factory):
    pair = await pair_factory("tcp", env=STEADY)
    ps = prompts(16, 2, length=(3, 90))
    alone = await pair.run(DRIVER, "ta", ps, max_tokens=12)
    lid = await pair.grant(MLPS)
    await _lease_ready(pair, lid)
    await _leased_run_matches(pair, ps, alone, 12)  # asserts identical tokens and that the guest served segments
    assert alone, "the alone run produced no outputs to compare"


async def test_guest_tenant_burst_keeps_its_sla_and_guest_work_yields(pair_factory):
    """The guest serves a lease (share 0.5) for a busy driver; its own tenant gets a burst of 8 requests.
    Home work waits for at most the guest segment that is running; tb's TTFT/TPOT stay inside its SLA."""
    sla = (2000.0, 100.0)
    # the long timeout floor keeps the driver sending work to the guest through the burst (with the default the
    # driver soon stops waiting for a busy guest and runs at home, so the guest would have little to yield)
    pair = await pair_factory("shm", sla=sla, env=STEADY)
    lid = await pair.grant(MLPS, share=0.5)
    await _lease_ready(pair, lid)
    await pair.submit(DRIVER, "ta", prompts(16, 3), 400, "gwload")  # keeps the guest busy for seconds
    g0 = await pair.wait_health(GUEST, lambda h: int(h.get("guest_served") or 0) > 20, 30)
    # whether a home step arrives while a guest segment runs is up to timing (on a VM whose two cores are busy with
    # something else, one burst can miss every segment): up to three bursts, each held to the SLA, until one does
    for attempt in range(3):
        burst = await pair.run(GUEST, "tb", prompts(8, 4 + attempt), max_tokens=24)
        g = await pair.fresh_health(GUEST)
        worst_ttft = max(o.ttft_ms for o in burst.values())
        worst_tpot = max(o.tpot_ms for o in burst.values())
        assert all(len(o.tokens) == 24 for o in burst.values())
        assert worst_ttft <= sla[0] and worst_tpot <= sla[1], (worst_ttft, worst_tpot)
        assert int(g["guest_served"]) > int(g0["guest_served"]), "the guest stopped serving the lease in the burst"
        if int(g["home_waits_on_guest"]) > 0:
            break
    assert int(g["home_waits_on_guest"]) > 0, g  # home steps did arrive while guest segments ran
    # waited for at most one guest segment: the home started as soon as the running segment ended (thread
    # wake-up on a loaded 2-core VM aside), never behind a second one
    assert float(g["yield_lag_max_ms"]) <= 20.0, g
    assert float(g["home_wait_on_guest_max_ms"]) <= float(g["guest_run_max_ms"]) + 20.0, g
    print(f"burst: ttft max {worst_ttft:.0f} ms, tpot max {worst_tpot:.1f} ms; guest segments during the burst "
          f"{int(g['guest_served']) - int(g0['guest_served'])}; home waited for a guest segment "
          f"{g['home_waits_on_guest']} times, at most {g['home_wait_on_guest_max_ms']} ms, started at most "
          f"{g['yield_lag_max_ms']} ms after the guest segment ended (longest guest segment {g['guest_run_max_ms']} ms)")
