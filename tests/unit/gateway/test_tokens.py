"""Routing of token-stream entries to pending requests (no Redis server): order, duplicates, foreign tenants,
errors, and failing waiting requests when the stream cannot be read."""
from __future__ import annotations

import asyncio
import time

from services.gateway.tokens import TokenRouter
from shared.codec import encode
from shared.messages import RequestError, TokenChunk
from shared.procutil import free_port
from shared.redis_util import blocking_client
from shared.streams import FIELD_MSG, FIELD_TYPE


def chunk(seq, rid="r1", tenant="ta", finish=None):
    return TokenChunk(msg_id=f"{rid}-{seq}", request_id=rid, tenant=tenant, seq=seq, token_ids=[seq], text=str(seq),
                      finish_reason=finish)


def drain(p) -> list:
    out = []
    while not p.queue.empty():
        out.append(p.queue.get_nowait())
    return out


def router() -> TokenRouter:
    return TokenRouter(cmd=None, blocking=None, stream="s")


def test_in_order_delivery_drops_duplicates_and_reorders():
    r = router()
    p = r.register("r1", "ta")
    for s in (1, 0, 0, 3, 2, 1, 4):
        r.dispatch(chunk(s))
    assert [c.seq for c in drain(p)] == [0, 1, 2, 3, 4] and r.duplicates == 2


def test_unknown_and_foreign_entries_are_ignored():
    r = router()
    p = r.register("r1", "ta")
    r.dispatch(chunk(0, rid="other"))
    r.dispatch(chunk(0, tenant="tb"))  # a request id belongs to its tenant
    r.dispatch(RequestError(msg_id="e", request_id="r1", tenant="tb", status=500, code="x", message="m"))
    assert drain(p) == [] and r.unknown == 1 and r.foreign == 2


def test_errors_are_delivered_at_once_and_unregister_stops_delivery():
    r = router()
    p = r.register("r1", "ta")
    r.dispatch(chunk(1))  # held: seq 0 missing
    err = RequestError(msg_id="e", request_id="r1", tenant="ta", status=503, code="worker_failed", message="m")
    r.dispatch(err)
    assert drain(p) == [err]
    r.unregister("r1")
    r.dispatch(chunk(0))
    assert drain(p) == [] and r.pending_count() == 0


def test_fail_all_reaches_every_pending_request():
    r = router()
    ps = [r.register(f"r{i}", "ta") for i in range(3)]
    r.fail_all(503, "redis_unavailable", "down")
    for p in ps:
        (e,) = drain(p)
        assert isinstance(e, RequestError) and e.status == 503 and e.request_id == p.request_id


def test_handle_entry_decodes_and_survives_garbage():
    r = router()
    p = r.register("r1", "ta")
    r.handle_entry("1-0", {FIELD_TYPE: b"TokenChunk", FIELD_MSG: encode(chunk(0))})
    r.handle_entry("2-0", {FIELD_TYPE: b"x", FIELD_MSG: b"\xc1garbage"})
    r.handle_entry("3-0", {b"other": b"field"})
    assert [c.seq for c in drain(p)] == [0] and r.undecodable == 2 and r.last_id == "3-0"


async def test_unreadable_stream_fails_pending_requests():
    blk = blocking_client(f"redis://127.0.0.1:{free_port()}/0", block_ms=100)  # nothing listens there
    r = TokenRouter(cmd=None, blocking=blk, stream="s", block_ms=100, fail_pending_after_s=0.2)
    p = r.register("r1", "ta")
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop))
    try:
        e = await asyncio.wait_for(p.queue.get(), timeout=5)
        assert isinstance(e, RequestError) and (e.status, e.code) == (503, "redis_unavailable")
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await blk.aclose()


def test_pace_delay_spaces_reads_by_the_interval():
    from services.gateway.tokens import READ_COUNT, pace_delay

    some = [("s", [("1-0", {})] * 3)]
    assert abs(pace_delay(0.010, started=100.0, now=100.004, resp=some) - 0.006) < 1e-9
    assert pace_delay(0.010, started=100.0, now=100.5, resp=some) == 0.0  # the read blocked past the interval
    assert pace_delay(0.0, started=100.0, now=100.0, resp=some) == 0.0  # pacing off
    assert pace_delay(0.010, started=100.0, now=100.0, resp=[("s", [("1-0", {})])]) == 0.0  # one entry: not busy
    full = [("s", [("1-0", {})] * READ_COUNT)]
    assert pace_delay(0.010, started=100.0, now=100.0, resp=full) == 0.0  # a backlog is read at once


def test_a_final_chunk_ahead_of_a_lost_one_ends_the_request_after_the_grace():
    from services.gateway.tokens import GAP_GRACE_S

    r = TokenRouter(cmd=None, blocking=None, stream="s")
    p = r.register("r1", "t")
    r.dispatch(_gap_chunk(0))
    r.dispatch(_gap_chunk(2, final=True))  # seq 1 never comes (lost with a failed Redis master)
    assert r.fail_gaps(time.monotonic()) == 0  # within the grace: it may still arrive
    assert r.fail_gaps(time.monotonic() + GAP_GRACE_S + 0.1) == 1
    got = [p.queue.get_nowait() for _ in range(p.queue.qsize())]
    assert [type(m).__name__ for m in got] == ["TokenChunk", "RequestError"]
    assert (got[1].status, got[1].code, got[1].retryable) == (502, "stream_gap", True)
    q = r.register("r2", "t")  # out of order but complete: no error
    r.dispatch(_gap_chunk(1, final=True, rid="r2"))
    r.dispatch(_gap_chunk(0, rid="r2"))
    assert r.fail_gaps(time.monotonic() + 10) == 0 and q.queue.qsize() == 2


def _gap_chunk(seq: int, final: bool = False, rid: str = "r1") -> TokenChunk:
    return TokenChunk(msg_id=f"{rid}-{seq}", request_id=rid, tenant="t", seq=seq, token_ids=[seq], text="x",
                      finish_reason="length" if final else None, prompt_tokens=1, completion_tokens=seq + 1)
