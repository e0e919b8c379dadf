"""Open-loop replay of a workload against the gateway's streaming ``POST /v1/completions``.

Requests are sent at their scheduled arrival times whatever the server does (open loop); each is streamed
(SSE ``data: {...}`` lines ending with ``data: [DONE]``) so TTFT and inter-token latencies are measured at the
client. A stop request (Ctrl-C) ends sending, gives in-flight requests a grace period, cancels the rest and
still returns every record, marked partial.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Mapping

import aiohttp
import structlog

from loadgen.prompts import PromptSynthesizer
from loadgen.report import RequestRecord, tpot
from shared.workload import WorkloadRequest

log = structlog.get_logger(__name__)
REJECT_STATUSES = (429, 503)


@dataclass
class ReplayResult:
    """Records (in completion order) plus whether the run was stopped early."""

    records: list[RequestRecord]
    partial: bool
    started_ts: float
    ended_ts: float
    not_sent: int = 0


@dataclass
class ReplayOptions:
    url: str
    keys: Mapping[str, str]
    synthesizers: Mapping[str, PromptSynthesizer]
    timeout_s: float = 300.0
    grace_s: float = 5.0
    progress: bool = True
    extra_body: dict = field(default_factory=dict)


def request_body(req: WorkloadRequest, prompt: str) -> dict:
    """The OpenAI-style completion request: the tenant name is the model; exactly ``output_tokens`` tokens."""
    return {"model": req.tenant, "prompt": prompt, "max_tokens": req.output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}


async def send_one(session: aiohttp.ClientSession, opts: ReplayOptions, req: WorkloadRequest,
                   scheduled: float) -> RequestRecord:
    """Send one request and stream its answer; every outcome becomes a record, never an exception."""
    synth = opts.synthesizers[req.tenant]
    prompt = synth.prompt(req.input_tokens, salt=zlib.crc32(req.request_id.encode()))
    rec = RequestRecord(id=req.request_id, tenant=req.tenant, arrival_s=req.arrival_s, sent_ts=time.time(),
                        input_tokens=req.input_tokens, expected_output_tokens=req.output_tokens)
    t0 = time.perf_counter()
    rec.send_lag_s = max(0.0, t0 - scheduled)
    headers = {"Authorization": f"Bearer {opts.keys[req.tenant]}", "Accept": "text/event-stream"}
    body = request_body(req, prompt) | opts.extra_body
    token_times: list[float] = []
    first_any: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with session.post(f"{opts.url.rstrip('/')}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=opts.timeout_s)) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:300]
                rec.status = "rejected" if resp.status in REJECT_STATUSES else "failed"
                rec.error = _error_text(text) or f"HTTP {resp.status}"
                rec.e2e_s = time.perf_counter() - t0
                return rec
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    rec.status, rec.error = "failed", f"bad SSE data: {data[:100]}"
                    break
                if "error" in obj:
                    rec.status, rec.error = "failed", _error_text(json.dumps(obj)) or "error in stream"
                    break
                if isinstance(obj.get("usage"), dict) and obj["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(obj["usage"]["completion_tokens"])
                choices = obj.get("choices") or []
                if choices:
                    chunks += 1
                    first_any = first_any if first_any is not None else now
                    if isinstance(choices[0], dict) and choices[0].get("text"):
                        token_times.append(now)
            end = time.perf_counter()
            rec.e2e_s = end - t0
            if rec.status == "ok" and not done:
                rec.status, rec.error = "failed", "stream ended before [DONE]"
    except asyncio.TimeoutError:
        rec.status, rec.error = "timeout", f"no complete answer within {opts.timeout_s:g} s"
        rec.e2e_s = time.perf_counter() - t0
    except (aiohttp.ClientError, ValueError, OSError) as e:  # ValueError: an over-long SSE line
        rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"[:300]
        rec.e2e_s = time.perf_counter() - t0
    except asyncio.CancelledError:
        rec.status, rec.error = "cancelled", "replay stopped"
        rec.e2e_s = time.perf_counter() - t0
        _fill_tokens(rec, t0, token_times, first_any, chunks, usage_tokens)
        raise _Cancelled(rec) from None
    _fill_tokens(rec, t0, token_times, first_any, chunks, usage_tokens)
    return rec


class _Cancelled(Exception):
    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec


def _fill_tokens(rec: RequestRecord, t0: float, token_times: list[float], first_any: float | None, chunks: int,
                 usage_tokens: int | None) -> None:
    first = token_times[0] if token_times else first_any
    if first is not None:
        rec.ttft_s = first - t0
    rec.itl = [b - a for a, b in zip(token_times, token_times[1:])]
    rec.output_tokens = usage_tokens if usage_tokens is not None else (len(token_times) or chunks)
    if rec.status == "ok" and rec.ttft_s is not None and rec.e2e_s is not None:
        rec.tpot_s = tpot(rec.e2e_s, rec.ttft_s, rec.output_tokens)
    if rec.status == "ok" and rec.ttft_s is None:
        rec.status, rec.error = "failed", "no tokens in the stream"


def _error_text(text: str) -> str | None:
    try:
        obj = json.loads(text)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300] if msg else None
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:300] or None


async def replay(requests: list[WorkloadRequest], opts: ReplayOptions, stop: asyncio.Event | None = None,
                 session: aiohttp.ClientSession | None = None) -> ReplayResult:
    """Send ``requests`` at ``arrival_s`` from now until done or ``stop`` is set; collect every record."""
    from tqdm import tqdm

    stop = stop or asyncio.Event()
    records: list[RequestRecord] = []
    own = session is None
    if own:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # open loop: no client-side cap
    bar = tqdm(total=len(requests), unit="req", file=sys.stderr, disable=not opts.progress, dynamic_ncols=True)
    counts = {"ok": 0, "bad": 0}
    pending: set[asyncio.Task] = set()
    task_req: dict[asyncio.Task, WorkloadRequest] = {}

    def finished(task: asyncio.Task) -> None:
        pending.discard(task)
        req = task_req.pop(task)
        if task.cancelled():  # cancelled before it started sending
            rec = RequestRecord(id=req.request_id, tenant=req.tenant, arrival_s=req.arrival_s, sent_ts=time.time(),
                                status="cancelled", error="replay stopped", input_tokens=req.input_tokens,
                                expected_output_tokens=req.output_tokens)
        else:
            exc = task.exception()
            rec = exc.rec if isinstance(exc, _Cancelled) else task.result() if exc is None else None
        if rec is None:
            log.error("replay_task_crashed", error=repr(exc))
            return
        records.append(rec)
        counts["ok" if rec.status == "ok" else "bad"] += 1
        bar.update(1)
        bar.set_postfix(ok=counts["ok"], bad=counts["bad"], inflight=len(pending), refresh=False)

    started_ts, t0 = time.time(), time.perf_counter() + 0.05
    sent = 0
    try:
        for req in requests:
            scheduled = t0 + req.arrival_s
            delay = scheduled - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set():
                break
            task = asyncio.create_task(send_one(session, opts, req, scheduled))
            pending.add(task)
            task_req[task] = req
            task.add_done_callback(finished)
            sent += 1
        if pending:
            waiter = asyncio.ensure_future(asyncio.wait(set(pending)))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if stop.is_set() and pending:
                log.info("replay_stopping", in_flight=len(pending), grace_s=opts.grace_s)
                await asyncio.wait(set(pending), timeout=opts.grace_s)
            for t in list(pending):
                t.cancel()
            await asyncio.gather(waiter, *pending, return_exceptions=True)
            await asyncio.sleep(0)
    finally:
        bar.close()
        if own:
            await session.close()
    return ReplayResult(records=records, partial=stop.is_set(), started_ts=started_ts, ended_ts=time.time(),
                        not_sent=len(requests) - sent)
