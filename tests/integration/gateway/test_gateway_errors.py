"""Every bad input, admission (quotas, queue bound, global bound), Redis down or stalled, metrics, logs, OpenAPI."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import jsonschema
import pytest
import structlog

from gateway_harness import CONTEXT, KEY_A, KEY_B, KEY_Q, Responder, make_gateway
from services.gateway.openapi import openapi_document
from shared.procutil import RedisServer, free_port

pytestmark = pytest.mark.integration
DOC = openapi_document()
ERROR_VALIDATOR = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/Error",
                                                   "components": DOC["components"]})
C, CHAT = "/v1/completions", "/v1/chat/completions"
J = "application/json"
MSGS = [{"role": "user", "content": "hi"}]

# name, method, path, key, content-type, body, status, code, param
BAD = [
    ("malformed_json", "POST", C, KEY_A, J, b'{"model": "ta", "prompt": ', 400, "invalid_json", None),
    ("empty_body", "POST", C, KEY_A, J, b"", 400, "invalid_json", None),
    ("not_utf8", "POST", C, KEY_A, J, b'{"model": "\xff"}', 400, "invalid_json", None),
    ("body_not_object", "POST", C, KEY_A, J, [1, 2], 400, "invalid_type", None),
    ("max_tokens_string", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "max_tokens": "5"}, 400,
     "invalid_type", "max_tokens"),
    ("temperature_string", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "temperature": "hot"}, 400,
     "invalid_type", "temperature"),
    ("stream_string", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "stream": "yes"}, 400, "invalid_type",
     "stream"),
    ("prompt_number", "POST", C, KEY_A, J, {"model": "ta", "prompt": 5}, 400, "invalid_type", "prompt"),
    ("prompt_missing", "POST", C, KEY_A, J, {"model": "ta"}, 400, "missing_required_parameter", "prompt"),
    ("model_number", "POST", C, KEY_A, J, {"model": 3, "prompt": "x"}, 400, "invalid_type", "model"),
    ("stop_number", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "stop": 3}, 400, "invalid_type", "stop"),
    ("stop_too_many", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "stop": list("abcde")}, 400,
     "invalid_value", "stop"),
    ("messages_string", "POST", CHAT, KEY_A, J, {"model": "ta", "messages": "hi"}, 400, "invalid_type", "messages"),
    ("content_number", "POST", CHAT, KEY_A, J, {"model": "ta", "messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_type", "messages[0].content"),
    ("bad_role", "POST", CHAT, KEY_A, J, {"model": "ta", "messages": [{"role": "god", "content": "x"}]}, 400,
     "invalid_value", "messages[0].role"),
    ("include_usage_string", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "stream": True,
                                                   "stream_options": {"include_usage": "y"}}, 400, "invalid_type",
     "stream_options.include_usage"),
    ("n_two", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "n": 2}, 400, "unsupported_parameter", "n"),
    ("token_out_of_vocab", "POST", C, KEY_A, J, {"model": "ta", "prompt": [1, 99999]}, 400, "invalid_value",
     "prompt[1]"),
    ("unknown_model", "POST", C, KEY_A, J, {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
    ("missing_key", "POST", C, None, J, {"model": "ta", "prompt": "x"}, 401, "missing_api_key", None),
    ("invalid_key", "POST", C, "sk-wrong-key-000", J, {"model": "ta", "prompt": "x"}, 401, "invalid_api_key", None),
    ("other_tenants_model", "POST", C, KEY_B, J, {"model": "ta", "prompt": "x"}, 403, "model_not_allowed", "model"),
    ("other_tenants_model_chat", "POST", CHAT, KEY_A, J, {"model": "tb", "messages": MSGS}, 403,
     "model_not_allowed", "model"),
    ("prompt_over_context", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x" * 200}, 400,
     "context_length_exceeded", "prompt"),
    ("prompt_plus_max_tokens_over_context", "POST", C, KEY_A, J,
     {"model": "ta", "prompt": "x" * 100, "max_tokens": CONTEXT - 100}, 400, "context_length_exceeded", "prompt"),
    ("chat_over_context", "POST", CHAT, KEY_A, J, {"model": "ta", "messages": [{"role": "user", "content": "y" * 150}]},
     400, "context_length_exceeded", "messages"),
    ("max_tokens_zero", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "max_tokens": 0}, 400, "invalid_value",
     "max_tokens"),
    ("max_tokens_negative", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "max_tokens": -3}, 400,
     "invalid_value", "max_tokens"),
    ("max_tokens_over_context", "POST", C, KEY_A, J, {"model": "ta", "prompt": "x", "max_tokens": CONTEXT + 1}, 400,
     "invalid_value", "max_tokens"),
    ("max_completion_tokens_zero", "POST", CHAT, KEY_A, J, {"model": "ta", "messages": MSGS,
                                                            "max_completion_tokens": 0}, 400, "invalid_value",
     "max_completion_tokens"),
    ("body_too_large", "POST", C, KEY_A, J, b'{"model": "ta", "prompt": "' + b"x" * (1024 * 1024) + b'"}', 413,
     "request_too_large", None),
    ("wrong_content_type", "POST", C, KEY_A, "text/plain", {"model": "ta", "prompt": "x"}, 415,
     "unsupported_media_type", None),
    ("form_content_type", "POST", CHAT, KEY_A, "application/x-www-form-urlencoded", b"model=ta", 415,
     "unsupported_media_type", None),
    ("unknown_path", "GET", "/v1/nothing", KEY_A, None, None, 404, "not_found", None),
    ("wrong_method", "GET", C, KEY_A, None, None, 405, "method_not_allowed", None),
    ("wrong_method_models", "DELETE", "/v1/models", KEY_A, None, None, 405, "method_not_allowed", None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
async def test_bad_input(gw, case):
    _, method, path, key, ctype, body, status, code, param = case
    headers = {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if ctype:
        headers["Content-Type"] = ctype
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.request(method, gw.url + path, data=data, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == status, await r.text()
            assert r.headers["Content-Type"].startswith("application/json") and r.headers["X-Request-Id"]
            err = await r.json()
    ERROR_VALIDATOR.validate(err)
    assert err["error"]["code"] == code and err["error"]["param"] == param
    assert not gw.responder.requests  # nothing reached the scheduler


async def test_exact_context_fit_is_accepted(gw):
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + C, headers={"Authorization": f"Bearer {KEY_A}"},
                          json={"model": "ta", "prompt": "x" * 99, "max_tokens": CONTEXT - 100}) as r:
            assert r.status == 200  # 1 BOS + 99 prompt + 28 = 128 = context


async def _post(url, body, key=KEY_Q, path=C):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, headers={"Authorization": f"Bearer {key}"}, json=body) as r:
            return r.status, r.headers, await r.json()


async def test_concurrency_quota_is_429_with_retry_after(gw):
    async def hold():
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + C, headers={"Authorization": f"Bearer {KEY_Q}"},
                              json={"model": "tq", "prompt": "SLOW", "max_tokens": 12}) as r:
                return r.status

    holders = [asyncio.create_task(hold()) for _ in range(2)]
    while gw.gateway.admission.inflight("tq") < 2:
        await asyncio.sleep(0.01)
    st, h, body = await _post(gw.url, {"model": "tq", "prompt": "x", "max_tokens": 1})
    assert st == 429 and body["error"]["code"] == "concurrency_quota_exceeded" and int(h["Retry-After"]) >= 1
    assert body["error"]["type"] == "rate_limit_error"
    st_other, _, _ = await _post(gw.url, {"model": "ta", "prompt": "x", "max_tokens": 1}, key=KEY_A)
    assert st_other == 200  # another tenant is not affected
    assert await asyncio.gather(*holders) == [200, 200]


async def test_tokens_per_minute_quota(gw):
    for _ in range(3):  # 1 BOS + 9 prompt + 100 = 110 tokens each, quota 400/min
        st, _, _ = await _post(gw.url, {"model": "tq", "prompt": "123456789", "max_tokens": 100})
        assert st == 200
    st, h, body = await _post(gw.url, {"model": "tq", "prompt": "123456789", "max_tokens": 100})
    assert st == 429 and body["error"]["code"] == "tokens_quota_exceeded" and 1 <= int(h["Retry-After"]) <= 60
    st, _, _ = await _post(gw.url, {"model": "tq", "prompt": "1", "max_tokens": 50})  # 52 more still fits
    assert st == 200


async def test_global_bound_is_503_with_retry_after(redis, redis_url, prefix):
    svc = make_gateway(redis_url, prefix, max_inflight=1)
    await svc.start()
    responder, stop = Responder(redis_url, prefix), asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    url = f"http://127.0.0.1:{svc.port}"
    try:
        hold = asyncio.create_task(_post(url, {"model": "ta", "prompt": "SLOW", "max_tokens": 10}, key=KEY_A))
        while svc.admission.total_inflight < 1:
            await asyncio.sleep(0.01)
        st, h, body = await _post(url, {"model": "tb", "prompt": "x"}, key=KEY_B)
        assert st == 503 and body["error"]["code"] == "overloaded" and h["Retry-After"] == "1"
        assert (await hold)[0] == 200
    finally:
        stop.set()
        await svc.stop()
        await task


async def test_redis_unreachable_is_503_promptly(prefix):
    svc = make_gateway(f"redis://127.0.0.1:{free_port()}/0", prefix)
    await svc.start()
    url = f"http://127.0.0.1:{svc.port}"
    try:
        for _ in range(2):
            t0 = time.monotonic()
            st, h, body = await _post(url, {"model": "ta", "prompt": "x"}, key=KEY_A)
            assert st == 503 and body["error"]["code"] == "redis_unavailable" and int(h["Retry-After"]) >= 1
            assert time.monotonic() - t0 < 3.0
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["redis"] is False
    finally:
        await svc.stop()


async def test_redis_stalled_is_503_within_timeout_then_recovers(tmp_path, prefix):
    server = RedisServer(data_dir=tmp_path / "redis").start()
    svc = make_gateway(server.url, prefix, redis_op_timeout_s=0.5)
    await svc.start()
    responder, stop = Responder(server.url, prefix), asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    url = f"http://127.0.0.1:{svc.port}"
    try:
        assert (await _post(url, {"model": "ta", "prompt": "x", "max_tokens": 2}, key=KEY_A))[0] == 200
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            st, h, body = await _post(url, {"model": "ta", "prompt": "x"}, key=KEY_A)
            assert st == 503 and body["error"]["code"] == "redis_unavailable" and h["Retry-After"]
            assert time.monotonic() - t0 < 2.5
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            st, _, body = await _post(url, {"model": "ta", "prompt": "x", "max_tokens": 2}, key=KEY_A)
            if st == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert st == 200 and body["choices"][0]["text"] == "ab"
    finally:
        stop.set()
        await svc.stop()
        await task
        server.stop()


async def test_metrics_count_outcomes_and_latency(gw):
    await _post(gw.url, {"model": "ta", "prompt": "x", "max_tokens": 3}, key=KEY_A)
    await _post(gw.url, {"model": "ta", "prompt": "x", "max_tokens": 0}, key=KEY_A)
    await _post(gw.url, {"model": "ta", "prompt": "ERR503"}, key=KEY_A)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert r.status == 200

    def value(line_start: str) -> float:
        return float(next(ln for ln in text.splitlines() if ln.startswith(line_start)).split()[-1])

    assert value('slicesched_requests_total{outcome="ok",tenant="ta"}') == 1
    assert value('slicesched_requests_total{outcome="bad_request",tenant="ta"}') == 1
    assert value('slicesched_requests_total{outcome="error",tenant="ta"}') == 1
    assert value('slicesched_ttft_seconds_count{tenant="ta"}') == 1
    assert value('slicesched_tpot_seconds_count{tenant="ta"}') == 1
    assert value('slicesched_e2e_seconds_count{tenant="ta"}') == 1
    assert value('slicesched_sla_violations_total{tenant="ta"}') == 1  # the failed request
    assert value('slicesched_gateway_inflight{tenant="ta"}') == 0


async def test_log_lines_carry_service_tenant_and_request_id(gw):
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        st, h, _ = await _post(gw.url, {"model": "ta", "prompt": "x", "max_tokens": 2}, key=KEY_A)
    rid = h["X-Request-Id"]
    mine = [e for e in logs if e.get("request_id") == rid]
    events = {e["event"] for e in mine}
    assert {"request_enqueued", "request_completed"} <= events
    assert all(e["tenant"] == "ta" and e["service"] == "gateway" for e in mine
               if e["event"] in ("request_enqueued", "request_completed"))


async def test_openapi_document_is_served_and_valid(gw):
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/openapi.json") as r:
            doc = await r.json()
    assert r.status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    assert refs and all(r.split("/")[-1] in doc["components"]["schemas"] for r in refs)


async def test_chunked_body_over_limit_is_413(gw):
    async def body():
        yield b'{"model": "ta", "prompt": "'
        for _ in range(20):
            yield b"x" * 65536
        yield b'"}'

    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + C, data=body(), headers={"Authorization": f"Bearer {KEY_A}",
                                                            "Content-Type": J}) as r:
            assert r.status == 413
            err = await r.json()
    ERROR_VALIDATOR.validate(err)
    assert err["error"]["code"] == "request_too_large" and not gw.responder.requests
