"""The gateway against a real redis-server: completions and chat (JSON and SSE), usage counts, duplicate and
out-of-order chunks, the official openai client, mesh errors, disconnects (cancel sent), a cancellation storm,
idle timeouts."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import jsonschema
import pytest

from gateway_harness import BOS, KEY_A, KEY_B, Responder, make_gateway
from services.gateway.openapi import openapi_document
from support.wait import until

pytestmark = pytest.mark.integration
DOC = openapi_document()


def auth(key: str = KEY_A) -> dict:
    return {"Authorization": f"Bearer {key}"}


def check_schema(body, name: str) -> None:
    jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": DOC["components"]}) \
        .validate(body)


async def post(url: str, path: str, body, key: str | None = KEY_A, **kw):
    headers = {"Content-Type": "application/json", **(auth(key) if key else {}), **kw.pop("headers", {})}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=data, headers=headers, **kw) as r:
            raw = await r.read()
            return r.status, r.headers, raw


def sse_events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------- happy paths
async def test_completion_json(gw):
    st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": "hello", "max_tokens": 5,
                                                        "temperature": 0, "stop": ["zz"], "seed": 7})
    assert st == 200, raw
    body = json.loads(raw)
    check_schema(body, "Completion")
    rid = h["X-Request-Id"]
    assert body["id"] == f"cmpl-{rid}" and body["object"] == "text_completion" and body["model"] == "ta"
    assert body["choices"][0]["text"] == "abcde" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    req = gw.responder.requests[rid]
    assert req.prompt_ids == [BOS, *b"hello"] and req.tenant == "ta" and req.gateway == gw.gateway.gateway_id
    assert (req.max_tokens, req.temperature, req.seed, req.stop) == (5, 0.0, 7, ["zz"])
    assert req.deadline_ts > req.arrival_ts > 0


async def test_completion_default_max_tokens_and_prompt_forms(gw):
    st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": [1, 2, 3]})
    assert st == 200 and json.loads(raw)["usage"] == {"prompt_tokens": 3, "completion_tokens": 16,
                                                      "total_tokens": 19}  # token ids are taken as given
    assert gw.responder.requests[h["X-Request-Id"]].prompt_ids == [1, 2, 3]
    st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": ["hi"], "max_tokens": 2})
    assert st == 200 and gw.responder.requests[h["X-Request-Id"]].prompt_ids == [BOS, *b"hi"]


async def test_chat_json(gw):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hey"}]}]
    st, h, raw = await post(gw.url, "/v1/chat/completions", {"model": "ta", "messages": msgs,
                                                             "max_completion_tokens": 3})
    assert st == 200, raw
    body = json.loads(raw)
    check_schema(body, "ChatCompletion")
    assert body["id"] == f"chatcmpl-{h['X-Request-Id']}" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    req = gw.responder.requests[h["X-Request-Id"]]
    prompt = bytes(req.prompt_ids[1:]).decode()
    assert req.prompt_ids[0] == BOS and "be brief" in prompt and "hey" in prompt and req.max_tokens == 3
    assert body["usage"]["prompt_tokens"] == len(req.prompt_ids) and body["usage"]["completion_tokens"] == 3


async def test_completion_stream_with_usage(gw):
    st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": "hi", "max_tokens": 4,
                                                        "stream": True, "stream_options": {"include_usage": True}})
    assert st == 200 and h["Content-Type"].startswith("text/event-stream")
    ev = sse_events(raw)
    assert ev[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == "abcd"
    assert ev[-3]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                           "total_tokens": 7}
    assert all(e["id"] == f"cmpl-{h['X-Request-Id']}" for e in ev[:-1])


async def test_chat_stream(gw):
    st, _, raw = await post(gw.url, "/v1/chat/completions", {"model": "ta", "max_tokens": 3, "stream": True,
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert st == 200
    ev = sse_events(raw)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1]) == "abc"
    assert ev[-2]["choices"][0]["finish_reason"] == "length" and ev[-1] == "[DONE]"
    assert all("usage" not in e for e in ev[:-1]) and all(e["object"] == "chat.completion.chunk" for e in ev[:-1])


async def test_duplicate_and_reordered_chunks_are_fixed(gw):
    st, _, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": "DUPS", "max_tokens": 7})
    body = json.loads(raw)
    assert st == 200 and body["choices"][0]["text"] == "abcdefg" and body["usage"]["completion_tokens"] == 7
    assert gw.gateway.router.duplicates >= 7


async def test_models_lists_only_own_tenant(gw):
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/models", headers=auth(KEY_B)) as r:
            body = await r.json()
        assert r.status == 200 and [m["id"] for m in body["data"]] == ["tb"]
        check_schema(body, "ModelList")
        async with s.get(gw.url + "/v1/models") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "missing_api_key"


async def test_openai_client(gw):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0)
    c = await client.completions.create(model="ta", prompt="hi", max_tokens=3)
    assert c.choices[0].text == "abc" and c.usage.total_tokens == 6
    ch = await client.chat.completions.create(model="ta", messages=[{"role": "user", "content": "q"}], max_tokens=2)
    assert ch.choices[0].message.content == "ab"
    text, usage = "", None
    stream = await client.chat.completions.create(model="ta", messages=[{"role": "user", "content": "q"}],
                                                  max_tokens=4, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == "abcd" and usage.completion_tokens == 4
    with pytest.raises(openai.PermissionDeniedError):
        await client.completions.create(model="tb", prompt="hi", max_tokens=1)
    await client.close()


# ---------------------------------------------------------------- mesh errors, disconnects, timeouts
@pytest.mark.parametrize("stream", [False, True])
async def test_request_error_before_tokens_keeps_its_status(gw, stream):
    st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": "ERR503", "stream": stream})
    body = json.loads(raw)
    assert st == 503 and body["error"]["code"] == "worker_failed" and h["Retry-After"]
    check_schema(body, "Error")
    st, _, raw = await post(gw.url, "/v1/chat/completions", {"model": "ta", "stream": stream,
                                                             "messages": [{"role": "user", "content": "ERR500"}]})
    assert st == 500 and json.loads(raw)["error"]["type"] == "server_error"


async def test_request_error_mid_stream(gw):
    st, _, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": "MIDERR", "stream": True})
    ev = sse_events(raw)
    assert st == 200 and [e["choices"][0]["text"] for e in ev[:2]] == ["a", "b"]
    assert ev[2]["error"]["code"] == "worker_failed" and ev[3] == "[DONE]" and len(ev) == 4


async def test_disconnect_mid_stream_sends_cancel(gw):
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/completions", headers=auth(),
                            json={"model": "ta", "prompt": "SLOW", "max_tokens": 30, "stream": True})
        rid = resp.headers["X-Request-Id"]
        await resp.content.readuntil(b"\n\n")
        resp.close()  # drop the connection mid-stream
    assert await until(lambda: any(c.request_id == rid for c in gw.responder.cancels))
    cancel = next(c for c in gw.responder.cancels if c.request_id == rid)
    assert cancel.tenant == "ta" and cancel.reason == "client_disconnected"
    assert await until(lambda: gw.gateway.admission.total_inflight == 0)
    assert gw.gateway.router.pending_count() == 0


async def test_disconnect_while_waiting_non_streaming_sends_cancel(gw):
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/completions", headers=auth(),
                                          json={"model": "ta", "prompt": "SILENT"}))
        assert await until(lambda: len(gw.responder.requests) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    rid = next(iter(gw.responder.requests))
    assert await until(lambda: any(c.request_id == rid for c in gw.responder.cancels))


async def test_cancellation_storm_then_no_mixups(gw):
    async def doomed(i):
        async with aiohttp.ClientSession() as s:
            try:
                await asyncio.wait_for(s.post(gw.url + "/v1/completions", headers=auth(), json={
                    "model": "ta", "prompt": "SLOW" if i % 2 else "SILENT", "stream": bool(i % 3)}),
                    timeout=0.005 * (i % 10) + 0.001)
            except asyncio.TimeoutError:
                pass

    await asyncio.gather(*(doomed(i) for i in range(60)))

    async def good(i):
        st, h, raw = await post(gw.url, "/v1/completions", {"model": "ta", "prompt": f"p{i}", "max_tokens": 1 + i % 9})
        body = json.loads(raw)
        return st, body["choices"][0]["text"], body["usage"]["completion_tokens"], i

    for st, text, n, i in await asyncio.gather(*(good(i) for i in range(30))):
        assert st == 200 and n == 1 + i % 9 and text == "abcdefghi"[:n]
    assert await until(lambda: gw.gateway.admission.total_inflight == 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_idle_timeout_is_504_and_cancels(redis, redis_url, prefix, stream):
    svc = make_gateway(redis_url, prefix, request_idle_timeout_s=0.4)
    await svc.start()
    responder, stop = Responder(redis_url, prefix), asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    try:
        t0 = time.monotonic()
        st, h, raw = await post(f"http://127.0.0.1:{svc.port}", "/v1/completions",
                                {"model": "ta", "prompt": "SILENT", "stream": stream})
        assert st == 504 and json.loads(raw)["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 3
        assert await until(lambda: any(c.request_id == h["X-Request-Id"] and c.reason == "idle_timeout"
                                           for c in responder.cancels))
    finally:
        stop.set()
        await svc.stop()
        await task
