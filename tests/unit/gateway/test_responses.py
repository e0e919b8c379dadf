"""Response shaping: OpenAI completion/chat objects, SSE chunks with usage, mesh errors → HTTP errors."""
from __future__ import annotations

import json

import jsonschema

from services.gateway.core import ApiError
from services.gateway.openapi import openapi_document
from services.gateway.responses import DONE, StreamShaper, completion_body, error_from_mesh

DOC = openapi_document()


def validate(body, name):
    jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                     "components": DOC["components"]}).validate(body)


def events(chunks: list[bytes]) -> list:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        payload = c[6:-2]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_completion_and_chat_bodies():
    b = completion_body(request_id="r1", chat=False, created=5, model="ta", text="hi", finish="length",
                        prompt_tokens=3, completion_tokens=2)
    validate(b, "Completion")
    assert b["id"] == "cmpl-r1" and b["choices"][0]["text"] == "hi"
    assert b["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    c = completion_body(request_id="r1", chat=True, created=5, model="ta", text="yo", finish="weird",
                        prompt_tokens=1, completion_tokens=1)
    validate(c, "ChatCompletion")
    assert c["id"] == "chatcmpl-r1" and c["choices"][0]["message"]["content"] == "yo"
    assert c["choices"][0]["finish_reason"] == "stop"  # unknown reasons are reported as stop


def test_completion_stream_with_usage():
    s = StreamShaper(request_id="r", chat=False, created=1, model="ta", include_usage=True)
    ev = events(s.start() + [s.delta("a"), s.delta("b")] + s.finish("length", 4, 2))
    assert [e["choices"][0]["text"] for e in ev[:3]] == ["a", "b", ""]
    assert ev[2]["choices"][0]["finish_reason"] == "length" and ev[0]["usage"] is None
    assert ev[3]["choices"] == [] and ev[3]["usage"]["total_tokens"] == 6 and ev[4] == "[DONE]"
    assert all(e["object"] == "text_completion" and e["id"] == "cmpl-r" for e in ev[:4])


def test_chat_stream_without_usage():
    s = StreamShaper(request_id="r", chat=True, created=1, model="ta", include_usage=False)
    ev = events(s.start() + [s.delta("x")] + s.finish("stop", 1, 1))
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[1]["choices"][0]["delta"] == {"content": "x"} and ev[2]["choices"][0]["delta"] == {}
    assert ev[2]["choices"][0]["finish_reason"] == "stop" and ev[3] == "[DONE]" and len(ev) == 4
    assert all("usage" not in e for e in ev[:3])


def test_stream_error_event():
    err = ApiError(503, "gone", type="service_unavailable_error", code="worker_failed")
    chunks = StreamShaper.error(err)
    assert chunks[-1] == DONE and events(chunks)[0] == err.body()


def test_mesh_errors_map_to_http():
    e = error_from_mesh(503, "worker_failed", "boom", True)
    assert (e.status, e.type, e.code, e.retry_after_s, e.outcome) == (503, "service_unavailable_error",
                                                                      "worker_failed", 1, "error")
    assert error_from_mesh(503, "overloaded", "", False).outcome == "rejected_overload"
    assert error_from_mesh(429, "q", "m", False).outcome == "rejected_quota"
    e = error_from_mesh(504, "deadline_exceeded", "late", False)
    assert (e.status, e.type, e.retry_after_s) == (504, "timeout_error", None)
    assert error_from_mesh(200, "odd", "m", False).status == 500  # a non-error status is an internal error
    assert error_from_mesh(400, "", "", False).code == "internal_error"


def test_logprobs_objects_for_completions_and_chat():
    from services.gateway.responses import logprobs_object
    from shared.model.config import PRESETS
    from shared.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer(PRESETS["tiny"])
    lps = [(-0.5, [(104, -0.5), (105, -1.5)]), (float("-inf"), [(33, -0.1)])]
    c = logprobs_object(tok, [104, 105], lps, chat=False)
    assert c == {"tokens": ["h", "i"], "token_logprobs": [-0.5, -9999.0],
                 "top_logprobs": [{"h": -0.5, "i": -1.5}, {"!": -0.1}], "text_offset": [0, 1]}
    b = completion_body(request_id="r1", chat=False, created=5, model="ta", text="hi", finish="length",
                        prompt_tokens=2, completion_tokens=2, logprobs=c)
    validate(b, "Completion")
    ch = logprobs_object(tok, [104, 105], lps, chat=True)
    assert ch["content"][0] == {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]}, {"token": "i", "logprob": -1.5, "bytes": [105]}]}
    b = completion_body(request_id="r1", chat=True, created=5, model="ta", text="hi", finish="stop",
                        prompt_tokens=2, completion_tokens=2, logprobs=ch)
    validate(b, "ChatCompletion")
    assert logprobs_object(tok, [104], [], chat=True) is None
    ev = events([StreamShaper(request_id="r", chat=True, created=1, model="ta", include_usage=False)
                 .delta("h", logprobs_object(tok, [104], lps[:1], chat=True))])
    assert ev[0]["choices"][0]["logprobs"]["content"][0]["token"] == "h"
