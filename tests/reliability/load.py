"""Load for the reliability rows: an asyncio HTTP client that records every call's fate, and a probe for recovery.

Every request carries a unique ``seed`` so the harness's stream tap (:mod:`reliability.tap`) can tie a call to the
``request_id`` the gateway gave it, even when the client never saw a response. Outcomes of one call:

* ``ok``: a final chunk (streaming) or a 200 body;
* ``error``: an explicit error from the mesh (JSON error status, or an SSE ``error`` event), other than the
  gateway's own idle timeout;
* ``rejected``: 429/503 (with Retry-After) before the request was enqueued: never accepted;
* ``timeout`` (the gateway's ``request_timeout``: the mesh went silent), ``truncated`` (stream ended without a final
  chunk or error), ``exception`` (client deadline or connection failure): lost if the request was accepted.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from reliability.rig import KEYS

SILENT_CODES = ("request_timeout",)  # the gateway's idle timeout: the mesh never answered


@dataclass
class Call:
    """One client request and what happened to it (times are ``time.monotonic()``)."""

    idx: int
    seed: int
    tenant: str
    sent: float
    status: int | None = None
    began: bool = False  # 200 / streaming began
    request_id: str | None = None
    outcome: str = "exception"
    code: str | None = None
    retry_after: str | None = None
    tokens: int = 0
    terminals: int = 0  # final chunks + error events seen in this response
    first_token: float | None = None
    end: float | None = None
    text: str = ""
    detail: str = ""

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


class Driver:
    """Sends completion requests to the gateway; ``seed_base`` keeps seeds unique across rows."""

    def __init__(self, gateway: str, *, seed_base: int, max_tokens: int = 6, stream: bool = True,
                 deadline_s: float = 90.0, tenants: tuple[str, ...] = tuple(KEYS)) -> None:
        self.gateway, self.seed_base = gateway, seed_base
        self.max_tokens, self.stream, self.deadline_s, self.tenants = max_tokens, stream, deadline_s, tenants
        self.calls: list[Call] = []
        self._next = 0

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                     timeout=aiohttp.ClientTimeout(total=self.deadline_s))

    async def call(self, s: aiohttp.ClientSession, tenant: str | None = None, *, max_tokens: int | None = None,
                   stream: bool | None = None, prompt: str | None = None, cancel_after_s: float | None = None,
                   record: bool = True) -> Call:
        i = self._next
        self._next += 1
        tenant = tenant or self.tenants[i % len(self.tenants)]
        c = Call(i, self.seed_base + i, tenant, time.monotonic())
        if record:
            self.calls.append(c)
        body = {"model": tenant, "prompt": prompt or f"reliability {c.seed}", "seed": c.seed, "temperature": 0,
                "max_tokens": max_tokens or self.max_tokens, "stream": self.stream if stream is None else stream,
                "ignore_eos": True}
        job = self._send(s, c, body)
        try:
            if cancel_after_s is None:
                await job
            else:
                await asyncio.wait_for(job, timeout=cancel_after_s)
        except asyncio.TimeoutError:
            c.outcome, c.detail = ("cancelled", "client cancelled") if cancel_after_s else ("exception", "deadline")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            c.outcome, c.detail = "exception", repr(e)[:200]
        c.end = c.end or time.monotonic()
        return c

    async def _send(self, s: aiohttp.ClientSession, c: Call, body: dict) -> None:
        headers = {"Authorization": f"Bearer {KEYS[c.tenant]}"}
        async with s.post(f"{self.gateway}/v1/completions", json=body, headers=headers) as r:
            c.status, c.request_id = r.status, r.headers.get("X-Request-Id")
            c.retry_after = r.headers.get("Retry-After")
            if r.status != 200:
                err = (await r.json(content_type=None)).get("error", {})
                c.code = err.get("code")
                c.outcome = "timeout" if c.code in SILENT_CODES else "error"  # "rejected" decided with the tap
                c.terminals = 1
                return
            c.began = True
            if not body["stream"]:
                data = await r.json()
                c.text = data["choices"][0]["text"]
                c.tokens = data["usage"]["completion_tokens"]
                c.outcome, c.terminals, c.first_token = "ok", 1, None
                return
            c.outcome = "truncated"
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    c.terminals += 1
                    c.code = d["error"].get("code")
                    c.outcome = "timeout" if c.code in SILENT_CODES else "error"
                    continue
                ch = d["choices"][0] if d.get("choices") else {}
                if ch.get("text"):
                    c.first_token = c.first_token or time.monotonic()
                    c.text += ch["text"]
                    c.tokens += 1
                if ch.get("finish_reason"):
                    c.terminals += 1
                    c.outcome = "ok"
        c.end = time.monotonic()

    # ------------------------------------------------------------ load shapes
    async def open_loop(self, n: int, rate_rps: float, rng: random.Random, *, max_inflight: int = 400) -> list[Call]:
        """``n`` requests with Poisson arrivals at ``rate_rps`` (at most ``max_inflight`` outstanding)."""
        gate = asyncio.Semaphore(max_inflight)
        tasks = []

        async def one(s):
            async with gate:
                return await self.call(s)

        async with self.session() as s:
            t = time.monotonic()
            for _ in range(n):
                t += rng.expovariate(rate_rps)
                delay = t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(s)))
            return list(await asyncio.gather(*tasks))

    async def closed_loop(self, n: int, concurrency: int, **kw) -> list[Call]:
        gate = asyncio.Semaphore(concurrency)

        async def one(s):
            async with gate:
                return await self.call(s, **kw)

        async with self.session() as s:
            return list(await asyncio.gather(*(one(s) for _ in range(n))))


class Prober:
    """After a fault: one short request every ``interval_s`` until ``need`` succeed in a row; records when."""

    def __init__(self, driver: Driver, tenant: str, *, interval_s: float = 0.5, need: int = 3,
                 timeout_s: float = 120.0) -> None:
        self.driver, self.tenant = driver, tenant
        self.interval_s, self.need, self.timeout_s = interval_s, need, timeout_s
        self.recovered_at: float | None = None  # monotonic time of the first probe of the successful run
        self.attempts = 0

    async def run(self) -> float | None:
        t0, streak, first = time.monotonic(), 0, None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            while time.monotonic() - t0 < self.timeout_s:
                sent = time.monotonic()
                c = await self.driver.call(s, self.tenant, max_tokens=2, stream=False, record=False)
                self.attempts += 1
                if c.outcome == "ok":
                    first = first if streak else sent
                    streak += 1
                    if streak >= self.need:
                        self.recovered_at = first
                        return first
                else:
                    streak = 0
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - sent)))
        return None
