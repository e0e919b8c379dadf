"""The common shape of a fault row: open-loop load, a fault injected at a seeded random time, a prober that
measures when new requests succeed again, then the figures (see :func:`reliability.results.summarize`). Also
writing straight to the mesh's streams as a stand-in gateway: requests with a fake gateway id (their results land on
``tokens:{fake}``, which the tap follows), duplicates and replays, and poison entries of every kind the matrix names
(truncated MessagePack, wrong schema, a 50 MB blob, deep nesting)."""
from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
import zlib
from typing import Awaitable, Callable

import msgspec
import redis as syncredis

from reliability.load import Driver, Prober
from reliability.results import RowResult, record, summarize
from reliability.rig import Rig
from reliability.tap import Tap, with_tap
from shared.codec import encode
from shared.messages import InferenceRequest, requests_stream
from shared.streams import FIELD_MSG, FIELD_TYPE

SCALE = float(os.environ.get("SLICESCHED_REL_SCALE", "1"))
SEEDS = [int(x) for x in os.environ.get("SLICESCHED_REL_SEEDS", "1").split(",") if x.strip()]
RATE_RPS = float(os.environ.get("SLICESCHED_REL_RATE", "20"))  # below this machine's ~40 req/s capacity


def n_requests(base: int) -> int:
    """``base`` scaled by ``SLICESCHED_REL_SCALE`` (the matrix asks for >= 1000 per row)."""
    return max(20, int(base * SCALE))


def seed_base(row: str, seed: int) -> int:
    """Distinct client seeds per row and seed, so the tap can map seeds to request ids unambiguously."""
    digits = int("".join(ch for ch in row if ch.isdigit()) or 0)
    return (seed % 1000) * 10**9 + digits * 10**7 + (zlib.crc32(row.encode()) % 97) * 10**5


async def run_fault_row(rig: Rig, result: RowResult, *, n: int, fault: Callable[[], Awaitable[dict | None]],
                        probe_tenant: str, rate_rps: float = RATE_RPS, fault_window: tuple[float, float] = (.3, .5),
                        max_tokens: int = 6, probe_timeout_s: float = 120.0) -> tuple[RowResult, list, Tap]:
    """Drive ``n`` requests; call ``fault()`` at a seeded time inside ``fault_window`` (fractions of the load's
    duration); measure recovery."""
    rng = random.Random(result.seed * 7919 + zlib.crc32((result.row + result.variant).encode()) % 1000)
    driver = Driver(rig.mesh.gateway, seed_base=seed_base(result.row + result.variant, result.seed),
                    max_tokens=max_tokens)
    tap = Tap(rig.redis_url, rig.prefix)
    t_start = time.monotonic()

    async def scenario():
        load = asyncio.create_task(driver.open_loop(n, rate_rps, rng))
        await asyncio.sleep(rng.uniform(*fault_window) * n / rate_rps)
        t_fault = time.monotonic()
        info = await fault() or {}
        prober = Prober(driver, probe_tenant, timeout_s=probe_timeout_s)
        recovered = await prober.run()
        calls = await load
        return calls, t_fault, recovered, info

    calls, t_fault, recovered, info = await with_tap(tap, scenario())
    summarize(result, calls, tap, fault_mono=t_fault, recovered_mono=recovered)
    result.extra.update(info)
    result.extra["fault_at_s"] = round(t_fault - t_start, 2)
    result.extra["tap_missed"] = await tap.missed()
    result.duration_s = round(time.monotonic() - t_start, 1)
    if recovered is None:
        result.note("no recovery within the probe window")
    return result, calls, tap


def settle(rig: Rig, result: RowResult | None = None, timeout_s: float = 120) -> None:
    """Wait until the mesh is ready and idle again (the next row starts clean); notes it when it is not."""
    t0 = time.monotonic()
    try:
        rig.wait_ready(timeout_s)
        rig.wait_idle(timeout_s)
    except TimeoutError as e:
        if result is not None:
            result.note(f"did not settle: {e}")
        raise
    finally:
        if result is not None:
            result.extra["settle_s"] = round(time.monotonic() - t0, 1)


def finish(rig: Rig, result: RowResult, *, allow_lost: bool = False, must_settle: bool = True) -> None:
    """Settle, record the row and check its targets (record first: a failing row is still published)."""
    try:
        settle(rig, result)
    except TimeoutError:
        if must_settle:
            record(result)
            raise
    record(result)
    result.check(allow_lost=allow_lost)


# ---------------------------------------------------------------- writing straight to the streams
BOS = 256


def fake_request(tenant: str, gateway: str, *, max_tokens: int = 4, deadline_ts: float = 0.0,
                 prompt: str = "direct") -> InferenceRequest:
    rid = f"inj-{uuid.uuid4().hex}"
    return InferenceRequest(msg_id=rid, request_id=rid, tenant=tenant, gateway=gateway,
                            prompt_ids=[BOS, *prompt.encode()], max_tokens=max_tokens, arrival_ts=time.time(),
                            deadline_ts=deadline_ts, ignore_eos=True)


def xadd_requests(r: syncredis.Redis, prefix: str, reqs: list[InferenceRequest], *, copies: int = 1) -> None:
    """XADD each request ``copies`` times back to back (the same message: a duplicated delivery)."""
    stream = requests_stream(prefix)
    for i in range(0, len(reqs), 500):
        pipe = r.pipeline(transaction=False)
        for q in reqs[i:i + 500]:
            for _ in range(copies):
                pipe.xadd(stream, {FIELD_TYPE: type(q).__name__, FIELD_MSG: encode(q)})
        pipe.execute()


def poison_payloads(gateway: str, *, each: int = 5, big_mb: int = 50) -> dict[str, list[bytes]]:
    """Payloads by kind; wrong-schema ones carry a request id and gateway so the requester can be told."""
    ok = encode(fake_request("tiny-a", gateway))
    out = {"truncated": [ok[: len(ok) // 2 - i] for i in range(each)],
           "wrong_schema": [msgspec.msgpack.encode({"type": "InferenceRequest", "gateway": gateway, "tenant": "tiny-a",
                                                    "request_id": f"poison-{uuid.uuid4().hex}", "prompt_ids": "oops"})
                            for _ in range(each)],
           "deeply_nested": [b"\x91" * 100_000 + b"\xc0" for _ in range(each)],
           "blob_50mb": [b"\xc6" + (big_mb * 2**20).to_bytes(4, "big") + b"x" * (big_mb * 2**20)]}
    return out


def xadd_poison(r: syncredis.Redis, stream: str, payloads: dict[str, list[bytes]]) -> list[str]:
    ids = []
    for kind, items in payloads.items():
        for raw in items:
            ids.append(r.xadd(stream, {FIELD_TYPE: kind, FIELD_MSG: raw}).decode())
    return ids

