"""The whole mesh, started like ``make up --redis-cluster 3`` (every service on a 3-master Redis Cluster), driven with
the official openai client. The other e2e modules run on a single redis-server."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

pytestmark = pytest.mark.e2e

KEYS = {"tiny-a": "sk-dev-tiny-a-0001", "tiny-b": "sk-dev-tiny-b-0001"}


@pytest.fixture(scope="module")
def mesh(cluster_mesh):
    return cluster_mesh


def _client(mesh, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.gateway}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


@pytest.mark.parametrize("tenant", sorted(KEYS))
async def test_completions_and_chat_stream_and_not(mesh, tenant):
    c = _client(mesh, tenant)
    r = await c.completions.create(model=tenant, prompt="Hello, mesh", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("Hello, mesh".encode()) + 1  # byte tokenizer + BOS
    chunks = []
    stream = await c.completions.create(model=tenant, prompt="Stream me", max_tokens=6, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for ch in stream:
        chunks.append(ch)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert isinstance(text, str)
    chat = await c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    n = 0
    stream = await c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    async for ch in stream:
        n += 1
    assert n >= 2
    await c.close()


async def test_greedy_is_deterministic_across_requests(mesh):
    c = _client(mesh, "tiny-a")
    a = await c.completions.create(model="tiny-a", prompt="same prompt", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    b = await c.completions.create(model="tiny-a", prompt="same prompt", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    await c.close()


async def test_key_reaches_only_its_tenant(mesh):
    c = _client(mesh, "tiny-a")
    with pytest.raises(openai.PermissionDeniedError):
        await c.completions.create(model="tiny-b", prompt="x", max_tokens=2)
    await c.close()


async def test_32_concurrent_streams_finish_with_requested_counts(mesh):
    clients = {t: _client(mesh, t) for t in KEYS}

    async def one(i: int) -> tuple[int, int]:
        tenant = sorted(KEYS)[i % 2]
        want = 8 + i % 9
        stream = await clients[tenant].completions.create(
            model=tenant, prompt=f"request number {i}", max_tokens=want, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
        return want, usage.completion_tokens

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=180)
    assert all(want == got for want, got in results), results
    for c in clients.values():
        await c.close()
