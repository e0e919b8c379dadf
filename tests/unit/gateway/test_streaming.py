"""Streaming responder: events already routed to a request leave in one write, one SSE event per token, in order."""
from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from services.gateway import streaming
from services.gateway.core import ParsedRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.streaming import RequestContext, respond
from services.gateway.tokens import PendingRequest
from shared.config import parse_tenants
from shared.messages import RequestError, TokenChunk

TENANT = parse_tenants({"tenants": [
    {"name": "t", "model": "tiny", "sla": {"ttft_ms": 1000, "tpot_ms": 100}, "home_devices": ["d"]}]}).get("t")


class RecordingResponse:
    """Stands in for aiohttp's StreamResponse: records each write."""

    def __init__(self, **_kw) -> None:
        self.writes: list[bytes] = []
        self.eof = False

    async def prepare(self, _request) -> None:
        pass

    async def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def write_eof(self) -> None:
        self.eof = True


@pytest.fixture
def recorded(monkeypatch):
    made: list[RecordingResponse] = []

    def factory(**kw):
        made.append(RecordingResponse(**kw))
        return made[-1]

    monkeypatch.setattr(streaming.web, "StreamResponse", factory)
    return made


def chunk(seq: int, finish: str | None = None) -> TokenChunk:
    return TokenChunk(msg_id=f"m{seq}", request_id="r1", tenant="t", seq=seq, token_ids=[65 + seq],
                      text=chr(65 + seq), finish_reason=finish, completion_tokens=seq + 1)


def context(chat: bool) -> RequestContext:
    parsed = ParsedRequest(chat=chat, model="t", prompt_text="hi", max_tokens=4, stream=True, include_usage=True)
    return RequestContext(request_id="r1", tenant=TENANT, parsed=parsed, prompt_tokens=3, arrival_mono=0.0,
                          created=1, idle_timeout_s=5.0)


def events(writes: list[bytes]) -> list[str]:
    return [e for e in b"".join(writes).decode().split("\n\n") if e]


async def run(pending: PendingRequest, chat: bool) -> None:
    await respond({}, context(chat), pending, GatewayMetrics(CollectorRegistry()), lambda *_: None)


async def test_queued_tokens_leave_in_one_write_each_its_own_event(recorded):
    pending = PendingRequest("r1", "t")
    for i in range(3):
        pending.queue.put_nowait(chunk(i))
    pending.queue.put_nowait(chunk(3, "length"))
    await run(pending, chat=True)
    resp = recorded[0]
    assert len(resp.writes) == 1 and resp.eof  # role, 4 tokens, finish, usage and [DONE]: one system call
    evs = events(resp.writes)
    assert evs[-1] == "data: [DONE]"
    bodies = [json.loads(e[len("data: "):]) for e in evs[:-1]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [b["choices"][0]["delta"].get("content") for b in bodies[1:5]] == ["A", "B", "C", "D"]
    assert bodies[5]["choices"][0]["finish_reason"] == "length"
    assert bodies[6]["choices"] == [] and bodies[6]["usage"]["completion_tokens"] == 4


async def test_a_token_is_written_as_soon_as_nothing_else_is_queued(recorded):
    pending = PendingRequest("r1", "t")
    pending.queue.put_nowait(chunk(0))

    async def later() -> None:
        await asyncio.sleep(0.05)
        # the first token must already be out before the next one exists
        assert recorded and any(b"\"A\"" in w for w in recorded[0].writes)
        pending.queue.put_nowait(chunk(1, "stop"))

    task = asyncio.create_task(later())
    await run(pending, chat=False)
    await task
    assert len(recorded[0].writes) == 2
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events(recorded[0].writes)[:2]] == ["A", "B"]


async def test_error_mid_stream_flushes_the_tokens_before_it(recorded):
    pending = PendingRequest("r1", "t")
    pending.queue.put_nowait(chunk(0))
    pending.queue.put_nowait(chunk(1))
    pending.queue.put_nowait(RequestError(msg_id="e", request_id="r1", tenant="t", status=500, code="worker_failed",
                                          message="boom", retryable=False))
    await run(pending, chat=False)
    evs = events(recorded[0].writes)
    assert [json.loads(e[6:])["choices"][0]["text"] for e in evs[:2]] == ["A", "B"]
    assert json.loads(evs[2][6:])["error"]["code"] == "worker_failed" and evs[3] == "data: [DONE]"
