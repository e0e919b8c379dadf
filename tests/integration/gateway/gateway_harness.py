"""Gateway integration harness: the real gateway app on a real port against a real redis-server, plus a small
responder task standing in for the scheduler and workers (it reads the requests stream and writes TokenChunks).

Imported by the tests as ``gateway_harness`` (conftest puts this folder on ``sys.path``).
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field

from services.gateway.core import GatewayLimits
from services.gateway.service import GatewayService
from shared.config import Settings, parse_tenants
from shared.messages import (CancelRequest, InferenceRequest, RequestError, RequestsMsg, TokenChunk,
                             requests_stream, tokens_stream)
from shared.codec import decode
from shared.redis_util import REDIS_ERRORS, blocking_client, command_client
from shared.streams import StreamProducer, entry_payload

KEY_A, KEY_B, KEY_Q = "sk-test-tenant-a-0001", "sk-test-tenant-b-0001", "sk-test-tenant-q-0001"
CONTEXT = 128  # tenant ta's context, small so context-length cases need small bodies
BOS = 256

TENANTS = {"tenants": [
    {"name": "ta", "model": {"preset": "tiny", "overrides": {"max_position_embeddings": CONTEXT}},
     "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["cpu0"], "api_keys": [KEY_A]},
    {"name": "tb", "model": {"preset": "tiny"}, "sla": {"ttft_ms": 2000, "tpot_ms": 100},
     "home_devices": ["cpu1"], "api_keys": [KEY_B]},
    {"name": "tq", "model": {"preset": "tiny"}, "sla": {"ttft_ms": 2000, "tpot_ms": 100},
     "home_devices": ["cpu1"], "api_keys": [KEY_Q], "max_queue": 3,
     "quota": {"tokens_per_min": 400, "max_concurrency": 2}},
]}


def token_text(i: int) -> str:
    return chr(ord("a") + i % 26)


@dataclass
class Responder:
    """Test double for scheduler + worker, driven by markers in the prompt text:

    ``ERR503``/``ERR500`` → a RequestError before any token; ``MIDERR`` → two tokens then an error; ``SLOW`` →
    tokens every 50 ms; ``SILENT`` → never answer; ``DUPS`` → every chunk twice, pairs out of order; otherwise
    ``min(max_tokens, cap)`` tokens, one chunk each, ``finish_reason`` length when max_tokens is reached.
    """

    redis_url: str
    prefix: str
    cap: int = 32
    markers: bool = True  # False: ignore the prompt markers (fuzzing must not trigger mesh errors on purpose)
    requests: dict = field(default_factory=dict)
    cancels: list = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        cmd = command_client(self.redis_url)
        blk = blocking_client(self.redis_url, block_ms=50)
        prod = StreamProducer(cmd)
        last, tasks = "0-0", set()
        try:
            while not stop.is_set():
                try:
                    resp = await blk.xread({requests_stream(self.prefix): last}, count=64, block=50)
                except REDIS_ERRORS:
                    await asyncio.sleep(0.1)
                    continue
                for _s, entries in resp or []:
                    for eid, fields in entries:
                        last = eid
                        msg = decode(entry_payload(fields), RequestsMsg)
                        if isinstance(msg, CancelRequest):
                            self.cancels.append(msg)
                        else:
                            self.requests[msg.request_id] = msg
                            t = asyncio.create_task(self._answer(prod, msg))
                            tasks.add(t)
                            t.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()
            await blk.aclose()
            await cmd.aclose()

    async def _answer(self, prod: StreamProducer, req: InferenceRequest) -> None:
        prompt = bytes(i for i in req.prompt_ids if i < 256).decode("utf-8", "replace") if self.markers else ""

        out = tokens_stream(self.prefix, req.gateway)

        def chunk(seq: int, finish: str | None = None, n_done: int = 0) -> TokenChunk:
            return TokenChunk(msg_id=f"{req.request_id}-{seq}", request_id=req.request_id, tenant=req.tenant, seq=seq,
                              token_ids=[ord(token_text(seq))], text=token_text(seq), finish_reason=finish,
                              prompt_tokens=len(req.prompt_ids), completion_tokens=n_done)

        def error(status: int, code: str) -> RequestError:
            return RequestError(msg_id=f"e-{req.request_id}", request_id=req.request_id, tenant=req.tenant,
                                status=status, code=code, message=f"test {code}")

        if "SILENT" in prompt:
            return
        if "ERR503" in prompt:
            await prod.add(out, error(503, "worker_failed"))
            return
        if "ERR500" in prompt:
            await prod.add(out, error(500, "internal_error"))
            return
        if "MIDERR" in prompt:
            await prod.add_many([(out, chunk(0)), (out, chunk(1))])
            await asyncio.sleep(0.05)
            await prod.add(out, error(503, "worker_failed"))
            return
        n = min(req.max_tokens, self.cap)
        finish = "length" if n == req.max_tokens else "stop"
        chunks = [chunk(i, finish if i == n - 1 else None, i + 1) for i in range(n)]
        if "DUPS" in prompt:
            order = []
            for i in range(0, n, 2):
                pair = chunks[i:i + 2]
                order += list(reversed(pair)) + pair
            await prod.add_many([(out, c) for c in order])
        elif "SLOW" in prompt:
            for c in chunks:
                await prod.add(out, c)
                await asyncio.sleep(0.05)
        else:
            await prod.add_many([(out, c) for c in chunks])


def make_gateway(redis_url: str, prefix: str, **limits) -> GatewayService:
    settings = Settings(redis_url=redis_url, prefix=prefix, gateway_host="127.0.0.1", gateway_port=0,
                        log_format="console")
    lim = dict(request_idle_timeout_s=3.0, redis_op_timeout_s=1.0, drain_s=2.0)
    lim.update(limits)
    return GatewayService(settings, parse_tenants(TENANTS), GatewayLimits(**lim))


@dataclass
class Harness:
    gateway: GatewayService
    responder: Responder

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


class ThreadedGateway:
    """The gateway and the responder on their own event loop in a thread (for synchronous clients/hypothesis)."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.prefix = f"tfuzz{uuid.uuid4().hex[:8]}:"
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.svc = make_gateway(self.redis_url, self.prefix)
        self.port = await self.svc.start()
        self.responder = Responder(self.redis_url, self.prefix, cap=8, markers=False)
        self._stop = asyncio.Event()
        task = asyncio.create_task(self.responder.run(self._stop))
        self._ready.set()
        await self._stop.wait()
        await self.svc.stop()
        await task
        r = command_client(self.redis_url)
        keys = [k async for k in r.scan_iter(match=f"{self.prefix}*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()

    def __enter__(self) -> "ThreadedGateway":
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("gateway did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
