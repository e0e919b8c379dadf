"""The gateway process: the aiohttp app, its error middleware, and the Redis I/O of each request.

Flow of a generation request: authenticate → parse/validate → tokenize → context check → admission → XADD an
InferenceRequest → wait for TokenChunk / RequestError entries routed from this gateway's tokens stream → respond
(JSON, or SSE). A client disconnect (aiohttp cancels the handler) or an idle timeout sends a CancelRequest so the
scheduler and the worker free the request's KV.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.admission import Admission, overloaded, shared_refusal
from services.gateway.core import (ApiError, GatewayLimits, KeyIndex, ParsedRequest, bad_request, check_content_type,
                                   decode_json, parse_request)
from services.gateway.prompt import (check_context, check_token_ids, encode_prompt, render_prompt,
                                     with_model_defaults)
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_document
from services.gateway.quota_store import QuotaStore
from services.gateway.responses import http_error
from services.gateway.streaming import OUTCOME_RECORDED, REQUEST_ID, TENANT, RequestContext, respond
from services.gateway.tokens import TokenRouter
from shared.config import Settings, TenantConfig, TenantsConfig
from shared.messages import CancelRequest, InferenceRequest, requests_stream, tokens_stream
from shared.model.tokenizer import load_tokenizer
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client, disconnect_now
from shared.requests_state import tenant_stats_key
from shared.service import ServiceShell, instance_id
from shared.streams import StreamProducer

log = structlog.get_logger()

REDIS_RETRY_AFTER_S = 2
INLINE_TOKENIZE_CHARS = 32 * 1024
REDIS_FAST_FAIL_S = 1.0  # after a failed XADD, answer 503 at once for this long instead of waiting on Redis again
READY_STATS_MAX_AGE_S = 3.0  # the scheduler reports every 0.5 s; older means it is not running
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "invalid_request",
               415: "unsupported_media_type", 411: "length_required", 408: "request_timeout"}


class GatewayService:
    """One gateway instance: ``start()`` serves HTTP and reads its tokens stream; ``stop()`` drains."""

    def __init__(self, settings: Settings, tenants: TenantsConfig, limits: GatewayLimits | None = None) -> None:
        self.settings, self.tenants = settings, tenants
        self.limits = limits or GatewayLimits()
        self.gateway_id = instance_id("gateway")
        self.redis = command_client(settings.redis_url, socket_timeout_s=self.limits.redis_op_timeout_s,
                                    pool_timeout_s=self.limits.redis_op_timeout_s, max_connections=256,
                                    name=self.gateway_id)
        self.blocking = blocking_client(settings.redis_url, block_ms=1000, name=f"{self.gateway_id}-tokens")
        self.shell = ServiceShell("gateway", self.gateway_id, prefix=settings.prefix, redis=self.redis,
                                  drain_s=self.limits.drain_s)
        self.metrics = GatewayMetrics(self.shell.registry)
        self.keys = KeyIndex(tenants)
        self.admission = Admission(self.limits.max_inflight, sla_fraction=self.limits.admit_sla_fraction)
        self.quota = QuotaStore(self.redis, settings.prefix, self.gateway_id, max_inflight=self.limits.max_inflight,
                                timeout_s=self.limits.redis_op_timeout_s)
        self.producer = StreamProducer(self.redis)
        self.requests_stream = requests_stream(settings.prefix)
        self.router = TokenRouter(cmd=self.redis, blocking=self.blocking,
                                  stream=tokens_stream(settings.prefix, self.gateway_id),
                                  read_interval_s=self.limits.stream_interval_ms / 1000.0)
        self.tokenizers = {t.name: load_tokenizer(t.model.checkpoint, t.model.config) for t in tenants.tenants}
        self.draining = False
        self._loops_stop = asyncio.Event()  # the tokens loops outlive the signal flag: they serve the drain
        self.started_ts = int(time.time())
        self._redis_failed_at = -1e9
        self._openapi = openapi_document()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self._cancels: set[asyncio.Task] = set()
        self.host, self.port = settings.gateway_host, settings.gateway_port

    # ------------------------------------------------------------ lifecycle
    def build_app(self) -> web.Application:
        # The body limit is enforced by aiohttp (client_max_size) and checked up front from Content-Length.
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/completions", self._h_completions)
        app.router.add_post("/v1/chat/completions", self._h_chat)
        app.router.add_get("/v1/models", self._h_models)
        app.router.add_get("/health", self._h_health)
        app.router.add_get("/ready", self._h_ready)
        app.router.add_get("/metrics", self._h_metrics)
        app.router.add_get("/openapi.json", self._h_openapi)
        return app

    async def start(self) -> int:
        """Serve HTTP and start the background loops; returns the bound port."""
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True,
                                     shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.shell.port = self.port
        self._tasks = [asyncio.create_task(self.router.run(self._loops_stop), name="tokens_read"),
                       asyncio.create_task(self.router.housekeeping_loop(self._loops_stop), name="tokens_housekeeping"),
                       asyncio.create_task(self.shell.heartbeat_loop(self._health_extra), name="heartbeat"),
                       asyncio.create_task(self.quota.renew_loop(self._loops_stop), name="quota_renew")]
        self.shell.ready = True
        log.info("gateway_listening", host=self.host, port=self.port, gateway=self.gateway_id,
                 tenants=self.tenants.names(), stream_interval_ms=self.limits.stream_interval_ms)
        return self.port

    async def stop(self) -> None:
        """Refuse new requests, let in-flight ones finish (up to the drain time), then close everything."""
        self.draining = True
        deadline = time.monotonic() + self.limits.drain_s
        while self.admission.total_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.admission.total_inflight:
            log.warning("gateway_drain_timeout", inflight=self.admission.total_inflight)
        if self._runner is not None:
            await self._runner.cleanup()
        self._loops_stop.set()
        self.shell.stop.set()
        try:  # wake the tokens XREAD (it blocks up to a second) by closing its connection
            await asyncio.wait_for(disconnect_now(self.blocking), timeout=1.0)
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            pass
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._cancels:
            await asyncio.wait(list(self._cancels), timeout=self.limits.redis_op_timeout_s)
        await self.router.delete_stream()
        await self.quota.leave()
        await close_quietly(self.blocking, self.redis)
        log.info("gateway_stopped")

    async def run(self) -> None:
        """The process entry: serve until SIGTERM/SIGINT, then drain."""
        self.shell.install_signal_handlers()
        await self.start()
        await self.shell.stop.wait()
        await self.stop()

    def _health_extra(self) -> dict:
        return {"inflight": self.admission.total_inflight, "draining": int(self.draining)}

    # ------------------------------------------------------------ middleware
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        rid = uuid.uuid4().hex
        request[REQUEST_ID] = rid
        with structlog.contextvars.bound_contextvars(service="gateway", request_id=rid, tenant=None):
            try:
                resp = await handler(request)
            except ApiError as e:
                resp = self._error_response(request, e)
            except web.HTTPException as e:  # routing and body-size errors raised by aiohttp itself
                if e.status < 400:
                    raise
                err = http_error(e.status, f"{e.reason or 'error'}: {request.method} {request.path[:200]}",
                                 _HTTP_CODES.get(e.status, "http_error"))
                resp = self._error_response(request, err)
                if "Allow" in e.headers:
                    resp.headers["Allow"] = e.headers["Allow"]
            except asyncio.CancelledError:  # the client went away (handler cancellation)
                if request.path.startswith("/v1/") and not request.get(OUTCOME_RECORDED):
                    self.metrics.outcome(request.get(TENANT), "cancelled")
                log.info("request_cancelled", path=request.path)
                raise
            except Exception:
                log.exception("unhandled_exception", path=request.path)
                resp = self._error_response(request, ApiError(500, "internal error", type="server_error",
                                                              code="internal_error", outcome="error"))
            if not resp.prepared:
                resp.headers["X-Request-Id"] = rid
            return resp

    def _error_response(self, request: web.Request, err: ApiError) -> web.Response:
        if request.path.startswith("/v1/") and not request.get(OUTCOME_RECORDED):
            self.metrics.outcome(request.get(TENANT), err.outcome)
        level = log.warning if err.status >= 500 else log.info
        level("request_rejected", status=err.status, code=err.code, param=err.param, path=request.path)
        return web.json_response(err.body(), status=err.status, headers=err.headers())

    # ------------------------------------------------------------ simple endpoints
    async def _h_health(self, request: web.Request) -> web.Response:
        h = self.shell.health()
        if self.draining:
            h["status"] = "draining"
        return web.json_response(h, status=200 if h["status"] == "ok" else 503)

    async def _h_ready(self, request: web.Request) -> web.Response:
        body = await self.readiness()
        return web.json_response(body, status=200 if body["status"] == "ready" else 503)

    async def readiness(self) -> dict:
        """Whether this gateway can serve each of its tenants now: it runs and reaches Redis, and the scheduler
        reported within ``READY_STATS_MAX_AGE_S`` a live worker on one of the tenant's home devices. The body names
        the tenants that cannot be served, and why."""
        h = self.shell.health()
        names = self.tenants.names()
        own = "the gateway is draining" if self.draining else "" if h["status"] == "ok" else \
            "the gateway is starting" if not self.shell.ready else "the gateway cannot reach Redis"
        reasons = dict.fromkeys(names, own)
        if not own:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for t in names:
                    pipe.hmget(tenant_stats_key(self.settings.prefix, t), "ts", "homes_up")
                rows = await asyncio.wait_for(pipe.execute(), timeout=self.limits.redis_op_timeout_s)
                now = time.time()
                for t, (ts, up) in zip(names, rows):
                    reasons[t] = tenant_unready_reason(self.tenants.get(t), ts, up, now)
            except (asyncio.TimeoutError, *REDIS_ERRORS):
                reasons = dict.fromkeys(names, "the gateway cannot reach Redis")
        not_ready = [t for t in names if reasons[t]]
        return {"status": "not_ready" if not_ready else "ready", "gateway": self.gateway_id,
                "not_ready": not_ready, "tenants": {t: {"ready": not reasons[t], "reason": reasons[t]} for t in names}}

    async def _h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.shell.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _h_openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    async def _h_models(self, request: web.Request) -> web.Response:
        tenant = self._auth(request)
        model = {"id": tenant.name, "object": "model", "created": self.started_ts, "owned_by": tenant.name,
                 "max_model_len": tenant.model.config.max_position_embeddings}
        return web.json_response({"object": "list", "data": [model]})

    # ------------------------------------------------------------ generation
    async def _h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _auth(self, request: web.Request) -> TenantConfig:
        tenant = self.keys.authenticate(request.headers.get("Authorization"))
        request[TENANT] = tenant.name
        structlog.contextvars.bind_contextvars(tenant=tenant.name)
        return tenant

    async def _read_json(self, request: web.Request):
        check_content_type(request.headers.get("Content-Type"))
        if request.content_length is not None and request.content_length > self.limits.max_body_bytes:
            raise http_error(413, f"request body is larger than {self.limits.max_body_bytes} bytes",
                             "request_too_large")
        return decode_json(await request.read())

    async def _prompt_ids(self, tenant: TenantConfig, p: ParsedRequest) -> list[int]:
        """Token ids as transformers makes them (BOS only where the tokenizer or the chat template adds one);
        token-id prompts are taken as given."""
        tok = self.tokenizers[tenant.name]
        check_token_ids(p.stop_token_ids, tenant.model.config.vocab_size, "stop_token_ids")
        if p.prompt_ids is not None:
            check_token_ids(p.prompt_ids, tenant.model.config.vocab_size)
            ids = list(p.prompt_ids)
        else:
            text = render_prompt(tok, p)
            if len(text) > INLINE_TOKENIZE_CHARS:  # keep the event loop responsive for long prompts
                ids = await asyncio.get_running_loop().run_in_executor(None, encode_prompt, tok, p, text)
            else:
                ids = encode_prompt(tok, p, text)
        if not ids:
            raise bad_request("the prompt is empty (it encodes to no tokens)", "messages" if p.chat else "prompt")
        return ids

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival_mono, arrival_ts = time.monotonic(), time.time()
        rid = request[REQUEST_ID]
        tenant = self._auth(request)
        parsed = parse_request(await self._read_json(request), chat=chat)
        tenant = self.keys.resolve_model(tenant, parsed.model)
        parsed = with_model_defaults(parsed, tenant.model.generation)
        prompt_ids = await self._prompt_ids(tenant, parsed)
        check_context(len(prompt_ids), parsed.max_tokens, tenant.model.config.max_position_embeddings, chat=chat,
                      max_tokens_param=parsed.max_tokens_param)
        if self.draining:
            raise overloaded("the gateway is shutting down", "shutting_down", 1)
        if time.monotonic() - self._redis_failed_at < REDIS_FAST_FAIL_S:
            raise overloaded("the request queue (Redis) is unreachable", "redis_unavailable", REDIS_RETRY_AFTER_S)
        ticket = self.admission.admit(tenant, len(prompt_ids) + parsed.max_tokens)
        await self._admit_shared(tenant, rid, ticket)
        self.metrics.inflight.labels(tenant.name).set(self.admission.inflight(tenant.name))
        pending = self.router.register(rid, tenant.name, on_chunk=lambda c: self.admission.progress(
            ticket, tokens=len(c.token_ids), finished=c.finish_reason is not None,
            completion_tokens=c.completion_tokens))
        try:
            msg = InferenceRequest(
                msg_id=rid, request_id=rid, tenant=tenant.name, gateway=self.gateway_id, prompt_ids=prompt_ids,
                max_tokens=parsed.max_tokens, temperature=parsed.temperature, top_p=parsed.top_p, seed=parsed.seed,
                stop=list(parsed.stop), ignore_eos=parsed.ignore_eos, arrival_ts=arrival_ts,
                deadline_ts=arrival_ts + self.limits.request_idle_timeout_s, top_k=parsed.top_k,
                presence_penalty=parsed.presence_penalty, frequency_penalty=parsed.frequency_penalty,
                repetition_penalty=parsed.repetition_penalty, logprobs=parsed.logprobs,
                stop_token_ids=list(parsed.stop_token_ids))
            try:
                # durable: on a Redis Cluster the request is on a replica too before it counts as accepted
                await asyncio.wait_for(self.producer.add(self.requests_stream, msg, durable=True),
                                       timeout=self.limits.redis_op_timeout_s)
            except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
                self._redis_failed_at = time.monotonic()
                log.warning("request_enqueue_failed", error=repr(e))
                if isinstance(e, asyncio.TimeoutError):  # a stalled XADD may still land: best-effort withdrawal
                    self._send_cancel(rid, tenant.name, "enqueue_failed")
                self.admission.release(ticket, refund=True)
                self.quota.release(tenant.name, rid, refund=True)
                raise overloaded("the request queue (Redis) is unreachable", "redis_unavailable",
                                 REDIS_RETRY_AFTER_S) from None
            except asyncio.CancelledError:
                self._send_cancel(rid, tenant.name, "client_disconnected")  # the XADD may have landed
                raise
            self._redis_failed_at = -1e9
            log.info("request_enqueued", prompt_tokens=len(prompt_ids), max_tokens=parsed.max_tokens,
                     stream=parsed.stream)
            ctx = RequestContext(request_id=rid, tenant=tenant, parsed=parsed, prompt_tokens=len(prompt_ids),
                                 arrival_mono=arrival_mono, created=int(arrival_ts),
                                 idle_timeout_s=self.limits.request_idle_timeout_s,
                                 tokenizer=self.tokenizers[tenant.name])
            return await respond(request, ctx, pending, self.metrics, self._send_cancel)
        finally:
            self.router.unregister(rid)
            if not ticket.released:
                self.admission.release(ticket)
                self.quota.release(tenant.name, rid)
            self.metrics.inflight.labels(tenant.name).set(self.admission.inflight(tenant.name))

    async def _admit_shared(self, tenant: TenantConfig, rid: str, ticket) -> None:
        """Count the admitted request against the bounds shared by all gateway replicas (quota_store.py); on a
        refusal or Redis trouble this instance's count is returned and the request answered 429/503."""
        try:
            res = await self.quota.admit(tenant, rid, ticket.tokens)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
            self._redis_failed_at = time.monotonic()
            log.warning("quota_admit_failed", error=repr(e))
            self.admission.release(ticket, refund=True)
            self.quota.release(tenant.name, rid, refund=True)  # the script may have run, or may run later
            raise overloaded("the request queue (Redis) is unreachable", "redis_unavailable",
                             REDIS_RETRY_AFTER_S) from None
        except asyncio.CancelledError:  # the client went away mid-call
            self.admission.release(ticket, refund=True)
            self.quota.release(tenant.name, rid, refund=True)
            raise
        if res is not None:
            self.admission.release(ticket, refund=True)
            raise shared_refusal(tenant, res.reason, res.count, res.retry_after_s, self.limits.max_inflight)

    def _send_cancel(self, request_id: str, tenant: str, reason: str) -> None:
        """XADD a CancelRequest in the background (the handler may itself be cancelled)."""
        async def send() -> None:
            msg = CancelRequest(msg_id=f"cancel-{request_id}", request_id=request_id, tenant=tenant, reason=reason)
            try:
                await asyncio.wait_for(self.producer.add(self.requests_stream, msg),
                                       timeout=self.limits.redis_op_timeout_s)
                log.info("request_cancel_sent", request_id=request_id, tenant=tenant, reason=reason)
            except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
                log.warning("request_cancel_failed", request_id=request_id, tenant=tenant, error=repr(e))

        task = asyncio.get_running_loop().create_task(send())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)


def tenant_unready_reason(tenant: TenantConfig, ts, homes_up, now: float) -> str:
    """Why ``tenant`` cannot be served, from the scheduler's ``sched:tenant:{name}`` fields (raw HMGET values);
    empty when it can."""
    if ts is None:
        return "the scheduler has not reported on this tenant (not started yet, or not configured with it)"
    age = now - float(ts)
    if age > READY_STATS_MAX_AGE_S:
        return f"the scheduler's last report is {age:.1f} s old (is the scheduler running?)"
    if homes_up is not None and int(homes_up) < 1:
        return f"no live worker on its home devices ({', '.join(tenant.home_devices)})"
    return ""
