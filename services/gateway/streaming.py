"""Answering one enqueued request: collect its chunks into a JSON body, or relay them as server-sent events.

Waits for each next event with an idle timeout (→ 504 and a CancelRequest). An error before the first token is an
ordinary JSON error with the mesh's status; after streaming began it is an SSE ``error`` event, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import structlog
from aiohttp import web

from services.gateway.core import ApiError, ParsedRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.responses import StreamShaper, completion_body, error_from_mesh, logprobs_object
from services.gateway.tokens import PendingRequest
from shared.config import TenantConfig
from shared.messages import RequestError, TokenChunk

log = structlog.get_logger()

REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
OUTCOME_RECORDED = web.RequestKey("outcome_recorded", bool)  # metrics already counted this request's outcome
SendCancel = Callable[[str, str, str], None]  # request_id, tenant, reason


@dataclass
class RequestContext:
    """What the responder needs to know about an enqueued request."""

    request_id: str
    tenant: TenantConfig
    parsed: ParsedRequest
    prompt_tokens: int
    arrival_mono: float
    created: int
    idle_timeout_s: float
    tokenizer: Any = None  # for the token texts of logprobs


class _Progress:
    """Counts tokens and timestamps of the chunks received so far."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.counted = 0
        self.reported = 0
        self.first_token_mono: float | None = None
        self.finish: str | None = None

    def add(self, chunk: TokenChunk) -> None:
        if chunk.token_ids and self.first_token_mono is None:
            self.first_token_mono = time.monotonic()
        self.counted += len(chunk.token_ids)
        self.reported = max(self.reported, chunk.completion_tokens)
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason

    @property
    def completion_tokens(self) -> int:
        # the worker's own count wins when it gives one (it knows about stop-string trimming)
        return self.reported or self.counted

    def record(self, metrics: GatewayMetrics, request: web.Request) -> None:
        e2e = time.monotonic() - self.ctx.arrival_mono
        ttft = self.first_token_mono - self.ctx.arrival_mono if self.first_token_mono is not None else None
        metrics.completed(self.ctx.tenant, ttft_s=ttft, e2e_s=e2e, completion_tokens=self.completion_tokens)
        request[OUTCOME_RECORDED] = True
        log.info("request_completed", prompt_tokens=self.ctx.prompt_tokens,
                 completion_tokens=self.completion_tokens, finish_reason=self.finish,
                 ttft_ms=round(ttft * 1000, 2) if ttft is not None else None, e2e_ms=round(e2e * 1000, 2))


async def _next_event(ctx: RequestContext, pending: PendingRequest,
                      send_cancel: SendCancel) -> TokenChunk | RequestError:
    if not pending.queue.empty():  # already routed: no timeout task to set up (the usual case under load)
        return pending.queue.get_nowait()
    try:
        return await asyncio.wait_for(pending.queue.get(), timeout=ctx.idle_timeout_s)
    except asyncio.TimeoutError:
        send_cancel(ctx.request_id, ctx.tenant.name, "idle_timeout")
        raise ApiError(504, f"no progress from the cluster for {ctx.idle_timeout_s:g} s", type="timeout_error",
                       code="request_timeout", outcome="error") from None


async def respond(request: web.Request, ctx: RequestContext, pending: PendingRequest, metrics: GatewayMetrics,
                  send_cancel: SendCancel) -> web.StreamResponse:
    """Wait for the request's tokens and answer; a cancelled handler (client gone) sends a CancelRequest."""
    try:
        if ctx.parsed.stream:
            return await _stream(request, ctx, pending, metrics, send_cancel)
        return await _collect(request, ctx, pending, metrics, send_cancel)
    except asyncio.CancelledError:
        send_cancel(ctx.request_id, ctx.tenant.name, "client_disconnected")
        raise


async def _collect(request: web.Request, ctx: RequestContext, pending: PendingRequest, metrics: GatewayMetrics,
                   send_cancel: SendCancel) -> web.Response:
    progress, parts, ids, lps = _Progress(ctx), [], [], []
    while True:
        ev = await _next_event(ctx, pending, send_cancel)
        if isinstance(ev, RequestError):
            raise error_from_mesh(ev.status, ev.code, ev.message, ev.retryable)
        progress.add(ev)
        parts.append(ev.text)
        if ev.logprobs:
            ids.extend(ev.token_ids[:len(ev.logprobs)])
            lps.extend(ev.logprobs)
        if ev.finish_reason is not None:
            break
    progress.record(metrics, request)
    lp = logprobs_object(ctx.tokenizer, ids, lps, chat=ctx.parsed.chat, as_ids=ctx.parsed.tokens_as_ids) \
        if ctx.parsed.logprobs is not None else None
    body = completion_body(request_id=ctx.request_id, chat=ctx.parsed.chat, created=ctx.created,
                           model=ctx.tenant.name, text="".join(parts), finish=progress.finish,
                           prompt_tokens=ctx.prompt_tokens, completion_tokens=progress.completion_tokens,
                           logprobs=lp)
    return web.json_response(body)


async def _stream(request: web.Request, ctx: RequestContext, pending: PendingRequest, metrics: GatewayMetrics,
                  send_cancel: SendCancel) -> web.StreamResponse:
    first = await _next_event(ctx, pending, send_cancel)
    if isinstance(first, RequestError):  # nothing sent yet: an ordinary JSON error with the mesh's status
        raise error_from_mesh(first.status, first.code, first.message, first.retryable)
    shaper = StreamShaper(request_id=ctx.request_id, chat=ctx.parsed.chat, created=ctx.created,
                          model=ctx.tenant.name, include_usage=ctx.parsed.include_usage)
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                   "X-Request-Id": ctx.request_id})
    progress = _Progress(ctx)
    offset = 0  # text_offset of the next token's logprobs (completions)
    try:
        await resp.prepare(request)
        # Events already routed to this request go out in one write (each token is still its own SSE event):
        # the start event with the first token, the finish/usage/[DONE] events with the last, and every token
        # that queued up since the last write (the router reads the tokens stream at most once per stream
        # interval, tokens.py). One write is one system call; the handler never holds a routed token back.
        out: list[bytes] = shaper.start()
        ev: TokenChunk | RequestError = first
        while True:
            if isinstance(ev, RequestError):
                if out:
                    await resp.write(b"".join(out))
                err = error_from_mesh(ev.status, ev.code, ev.message, ev.retryable)
                await _stream_error(request, resp, err, metrics, ctx)
                return resp
            progress.add(ev)
            if ev.text or ev.token_ids:  # one chunk per generated token (text may be empty: partial UTF-8)
                lp = None
                if ev.logprobs and ctx.parsed.logprobs is not None:
                    lp = logprobs_object(ctx.tokenizer, ev.token_ids, ev.logprobs, chat=ctx.parsed.chat,
                                         offset=offset, as_ids=ctx.parsed.tokens_as_ids)
                    offset += sum(len(t) for t in lp.get("tokens", ()))  # type: ignore[union-attr]
                out.append(shaper.delta(ev.text, lp))
            if ev.finish_reason is not None:
                break
            if pending.queue.empty() and out:
                await resp.write(b"".join(out))
                out = []
            try:
                ev = await _next_event(ctx, pending, send_cancel)
            except ApiError as err:
                if out:
                    await resp.write(b"".join(out))
                await _stream_error(request, resp, err, metrics, ctx)
                return resp
        out.extend(shaper.finish(progress.finish, ctx.prompt_tokens, progress.completion_tokens))
        await resp.write(b"".join(out))
        progress.record(metrics, request)
        await resp.write_eof()
    except ConnectionError:  # the client went away while we were writing
        send_cancel(ctx.request_id, ctx.tenant.name, "client_disconnected")
        if not request.get(OUTCOME_RECORDED):
            metrics.outcome(ctx.tenant.name, "cancelled")
            request[OUTCOME_RECORDED] = True
        log.info("request_cancelled", reason="client_disconnected_on_write")
    return resp


async def _stream_error(request: web.Request, resp: web.StreamResponse, err: ApiError, metrics: GatewayMetrics,
                        ctx: RequestContext) -> None:
    metrics.outcome(ctx.tenant.name, err.outcome)
    request[OUTCOME_RECORDED] = True
    log.warning("request_failed_mid_stream", status=err.status, code=err.code)
    await resp.write(b"".join(StreamShaper.error(err)))
    await resp.write_eof()
