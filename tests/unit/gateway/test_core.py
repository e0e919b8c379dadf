"""Request parsing and validation, content type, JSON decoding, auth, model resolution and context checks."""
from __future__ import annotations

import json

import pytest

from services.gateway.core import (ApiError, GatewayLimits, KeyIndex, ParsedRequest, check_content_type,
                                   decode_json, parse_request)
from services.gateway.prompt import check_context, check_token_ids, render_prompt, with_model_defaults
from shared.model.hf_config import GenerationDefaults
from shared.config import ConfigError, parse_tenants
from shared.model.config import PRESETS
from shared.model.tokenizer import load_tokenizer

TENANTS = parse_tenants({"tenants": [
    {"name": "ta", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d0"],
     "api_keys": ["sk-key-a-000001", "sk-key-a-000002"]},
    {"name": "tb", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d1"],
     "api_keys": ["sk-key-b-000001"]},
]})


def err(fn, *a, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*a, **kw)
    return e.value


def bad(body, chat=False) -> ApiError:
    return err(parse_request, body, chat=chat)


# ---------------------------------------------------------------- valid requests
def test_completion_defaults():
    p = parse_request({"model": "ta", "prompt": "hi"}, chat=False)
    # sampling fields left out stay None until the model's generation defaults (or the API's) fill them in
    assert (p.model, p.prompt_text, p.prompt_ids, p.max_tokens, p.temperature, p.top_p) == ("ta", "hi", None, 16,
                                                                                           None, None)
    d = with_model_defaults(p, GenerationDefaults())
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.logprobs) == (1.0, 1.0, 0, 1.0, None)
    g = with_model_defaults(p, GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1))
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    q = parse_request({"model": "ta", "prompt": "hi", "temperature": 0, "top_k": -1}, chat=False)
    assert with_model_defaults(q, GenerationDefaults(temperature=0.6, top_k=20)).temperature == 0.0
    assert with_model_defaults(q, GenerationDefaults(temperature=0.6, top_k=20)).top_k == 0
    assert (p.stream, p.include_usage, p.stop, p.seed, p.ignore_eos) == (False, False, (), None, False)


def test_completion_all_fields():
    p = parse_request({"model": "ta", "prompt": [1, 2], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": -3,
                       "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "u",
                       "ignore_eos": True, "logprobs": None, "echo": False, "unknown_extra": {"a": 1}}, chat=False)
    assert p.prompt_ids == (1, 2) and p.max_tokens == 7 and p.temperature == 0.0 and p.top_p == 0.5
    assert p.seed == -3 and p.stop == ("x",) and p.stream and p.include_usage and p.user == "u" and p.ignore_eos


@pytest.mark.parametrize("prompt, text, ids", [("", "", None), (["one"], "one", None), ([], None, ()),
                                               ([[4, 5]], None, (4, 5))])
def test_prompt_forms(prompt, text, ids):
    p = parse_request({"model": "ta", "prompt": prompt}, chat=False)
    assert (p.prompt_text, p.prompt_ids) == (text, ids)


def test_chat_messages_and_max_completion_tokens():
    p = parse_request({"model": "ta", "max_tokens": 5, "max_completion_tokens": 9, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]}, chat=True)
    assert p.messages == ({"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                          {"role": "assistant", "content": ""})
    assert p.max_tokens == 9 and p.max_tokens_param == "max_completion_tokens"


# ---------------------------------------------------------------- every bad input names its field
@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "x"}, "model", "missing_required_parameter"),
    ({"model": 1, "prompt": "x"}, "model", "invalid_type"),
    ({"model": "ta"}, "prompt", "missing_required_parameter"),
    ({"model": "ta", "prompt": 3}, "prompt", "invalid_type"),
    ({"model": "ta", "prompt": {"a": 1}}, "prompt", "invalid_type"),
    ({"model": "ta", "prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({"model": "ta", "prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
    ({"model": "ta", "prompt": [1, True]}, "prompt[1]", "invalid_type"),
    ({"model": "ta", "prompt": "a\x00b"}, "prompt", "invalid_value"),
    ({"model": "ta", "prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ({"model": "ta", "prompt": "x", "max_tokens": 5.0}, "max_tokens", "invalid_type"),
    ({"model": "ta", "prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"model": "ta", "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "ta", "prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"model": "ta", "prompt": "x", "temperature": "1"}, "temperature", "invalid_type"),
    ({"model": "ta", "prompt": "x", "temperature": 2.5}, "temperature", "invalid_value"),
    ({"model": "ta", "prompt": "x", "temperature": -0.1}, "temperature", "invalid_value"),
    ({"model": "ta", "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"model": "ta", "prompt": "x", "top_p": 1.5}, "top_p", "invalid_value"),
    ({"model": "ta", "prompt": "x", "seed": 2**64}, "seed", "invalid_value"),
    ({"model": "ta", "prompt": "x", "seed": "1"}, "seed", "invalid_type"),
    ({"model": "ta", "prompt": "x", "stop": 1}, "stop", "invalid_type"),
    ({"model": "ta", "prompt": "x", "stop": ["a", 1]}, "stop[1]", "invalid_type"),
    ({"model": "ta", "prompt": "x", "stop": ["a"] * 5}, "stop", "invalid_value"),
    ({"model": "ta", "prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ({"model": "ta", "prompt": "x", "stop": "s" * 300}, "stop", "invalid_value"),
    ({"model": "ta", "prompt": "x", "stream": 1}, "stream", "invalid_type"),
    ({"model": "ta", "prompt": "x", "stream_options": []}, "stream_options", "invalid_type"),
    ({"model": "ta", "prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "invalid_type"),
    ({"model": "ta", "prompt": "x", "n": 2}, "n", "unsupported_parameter"),
    ({"model": "ta", "prompt": "x", "n": "1"}, "n", "invalid_type"),
    ({"model": "ta", "prompt": "x", "user": 5}, "user", "invalid_type"),
    ({"model": "ta", "prompt": "x", "user": "u" * 300}, "user", "invalid_value"),
    ({"model": "ta", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"model": "ta", "prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"model": "ta", "prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"model": "ta", "prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"model": "ta", "prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
    ({"model": "ta", "prompt": "x", "top_k": -2}, "top_k", "invalid_value"),
    ({"model": "ta", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"model": "ta", "prompt": "x", "frequency_penalty": "1"}, "frequency_penalty", "invalid_type"),
    ({"model": "ta", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"model": "ta", "prompt": "x", "stop_token_ids": [1, -1]}, "stop_token_ids[1]", "invalid_type"),
    ({"model": "ta", "prompt": "x", "suffix": "s"}, "suffix", "unsupported_parameter"),
])
def test_bad_completion_fields(body, param, code):
    e = bad(body)
    assert (e.status, e.param, e.code, e.type) == (400, param, code, "invalid_request_error")
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param, "code": code}}


@pytest.mark.parametrize("body, param, code", [
    ({"model": "ta"}, "messages", "missing_required_parameter"),
    ({"model": "ta", "messages": "hi"}, "messages", "invalid_type"),
    ({"model": "ta", "messages": []}, "messages", "invalid_value"),
    ({"model": "ta", "messages": ["hi"]}, "messages[0]", "invalid_type"),
    ({"model": "ta", "messages": [{"content": "x"}]}, "messages[0].role", "invalid_type"),
    ({"model": "ta", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": "ta", "messages": [{"role": "user", "content": 1}]}, "messages[0].content", "invalid_type"),
    ({"model": "ta", "messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]", "invalid_type"),
    ({"model": "ta", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "unsupported_parameter"),
    ({"model": "ta", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text", "invalid_type"),
    ({"model": "ta", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens", "invalid_value"),
    ({"model": "ta", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "3"},
     "max_completion_tokens", "invalid_type"),
])
def test_bad_chat_fields(body, param, code):
    e = bad(body, chat=True)
    assert (e.status, e.param, e.code) == (400, param, code)


@pytest.mark.parametrize("body", [[], "x", 3, None, True])
def test_body_must_be_object(body):
    e = bad(body)
    assert e.status == 400 and e.code == "invalid_type" and e.param is None


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"{'a': 1}", b'{"a": NaN}', b"\xff\xfe", b"[" * 100_000,
                                 b'{"a": 1} x', b'"\\ud800"'])
def test_malformed_json(raw):
    e = err(decode_json, raw)
    assert e.status == 400 and e.code == "invalid_json"


def test_json_decodes():
    assert decode_json(b' {"model": "ta"} ') == {"model": "ta"}


@pytest.mark.parametrize("ct", [None, "", "application/json", "Application/JSON; charset=utf-8",
                                "application/vnd.api+json"])
def test_content_type_accepted(ct):
    assert check_content_type(ct) is None  # raises ApiError(415) for anything else


@pytest.mark.parametrize("ct", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=1",
                                "application/jsonx", "json"])
def test_content_type_rejected(ct):
    e = err(check_content_type, ct)
    assert e.status == 415 and e.code == "unsupported_media_type"


# ---------------------------------------------------------------- auth and models
@pytest.mark.parametrize("header, tenant", [("Bearer sk-key-a-000001", "ta"), ("bearer  sk-key-a-000002 ", "ta"),
                                            ("Bearer sk-key-b-000001", "tb")])
def test_auth_maps_key_to_tenant(header, tenant):
    assert KeyIndex(TENANTS).authenticate(header).name == tenant


@pytest.mark.parametrize("header, code", [(None, "missing_api_key"), ("", "missing_api_key"),
                                          ("Bearer", "invalid_api_key"), ("Basic sk-key-a-000001", "invalid_api_key"),
                                          ("Bearer sk-key-a-00000", "invalid_api_key"),
                                          ("sk-key-a-000001", "invalid_api_key"),
                                          ("Bearer sha256:" + "0" * 64, "invalid_api_key")])
def test_auth_rejects(header, code):
    e = err(KeyIndex(TENANTS).authenticate, header)
    assert (e.status, e.type, e.code) == (401, "authentication_error", code)


def test_auth_uses_hashes_only():
    keys = KeyIndex(TENANTS)
    stored = repr(keys._entries)
    assert "sk-key-a-000001" not in stored and "sha256:" in stored


def test_model_resolution():
    keys = KeyIndex(TENANTS)
    ta = TENANTS.get("ta")
    assert keys.resolve_model(ta, "ta") is ta
    e = err(keys.resolve_model, ta, "tb")
    assert (e.status, e.code, e.param, e.type) == (403, "model_not_allowed", "model", "permission_error")
    e = err(keys.resolve_model, ta, "gpt-4")
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")


# ---------------------------------------------------------------- context, vocabulary, prompt rendering
def test_context_checks():
    check_context(100, 28, 128, chat=False)  # exactly fits
    e = err(check_context, 101, 28, 128, chat=False)
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "prompt")
    e = err(check_context, 300, 1, 128, chat=True)
    assert (e.code, e.param) == ("context_length_exceeded", "messages")
    e = err(check_context, 1, 129, 128, chat=True, max_tokens_param="max_completion_tokens")
    assert (e.code, e.param) == ("invalid_value", "max_completion_tokens")


def test_token_ids_must_be_in_vocabulary():
    check_token_ids((0, 511), 512)
    assert err(check_token_ids, (0, 512), 512).param == "prompt[1]"
    assert err(check_token_ids, (-1,), 512).param == "prompt[0]"


def test_render_prompt_uses_the_chat_template():
    tok = load_tokenizer(None, PRESETS["tiny"])
    p = parse_request({"model": "ta", "messages": [{"role": "user", "content": "hello"}]}, chat=True)
    text = render_prompt(tok, p)
    assert "hello" in text and text == tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert render_prompt(tok, ParsedRequest(chat=False, model="ta", prompt_text="abc")) == "abc"


def test_render_prompt_template_failure_is_400():
    class Failing:
        def apply_chat_template(self, messages):
            raise RuntimeError("Conversation roles must alternate user/assistant")

    p = parse_request({"model": "ta", "messages": [{"role": "user", "content": "x"}]}, chat=True)
    e = err(render_prompt, Failing(), p)
    assert e.status == 400 and e.param == "messages" and "alternate" in e.message


# ---------------------------------------------------------------- limits from the environment
def test_limits_from_env():
    lim = GatewayLimits.from_env({"SLICESCHED_MAX_BODY_BYTES": "2048", "SLICESCHED_MAX_INFLIGHT": "7",
                                  "SLICESCHED_REQUEST_IDLE_TIMEOUT_S": "1.5", "SLICESCHED_DRAIN_S": "3"})
    assert (lim.max_body_bytes, lim.max_inflight, lim.request_idle_timeout_s, lim.drain_s) == (2048, 7, 1.5, 3.0)
    assert GatewayLimits.from_env({}) == GatewayLimits()


@pytest.mark.parametrize("name, value", [("SLICESCHED_MAX_BODY_BYTES", "1MB"), ("SLICESCHED_MAX_INFLIGHT", "0"),
                                         ("SLICESCHED_REQUEST_IDLE_TIMEOUT_S", "nan"), ("SLICESCHED_DRAIN_S", "-2")])
def test_limits_reject_bad_env(name, value):
    with pytest.raises(ConfigError) as e:
        GatewayLimits.from_env({name: value})
    assert name in str(e.value)


def test_error_body_is_json_serialisable():
    e = ApiError(429, "slow down", type="rate_limit_error", code="queue_full", retry_after_s=3)
    assert json.loads(json.dumps(e.body()))["error"]["code"] == "queue_full" and e.headers() == {"Retry-After": "3"}


def test_logprobs_fields_of_completions_and_chat():
    assert parse_request({"model": "ta", "prompt": "x", "logprobs": 3}, chat=False).logprobs == 3
    assert parse_request({"model": "ta", "prompt": "x", "logprobs": 0}, chat=False).logprobs == 0
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_request({"model": "ta", "messages": msgs, "logprobs": True, "top_logprobs": 5}, chat=True).logprobs == 5
    assert parse_request({"model": "ta", "messages": msgs, "logprobs": True}, chat=True).logprobs == 0
    assert parse_request({"model": "ta", "messages": msgs, "logprobs": False}, chat=True).logprobs is None
    e = bad({"model": "ta", "messages": msgs, "top_logprobs": 2}, chat=True)
    assert (e.param, e.code) == ("top_logprobs", "invalid_value")
    e = bad({"model": "ta", "messages": msgs, "logprobs": 2}, chat=True)
    assert (e.param, e.code) == ("logprobs", "invalid_type")
    p = parse_request({"model": "ta", "prompt": "x", "top_k": 40, "presence_penalty": -1, "frequency_penalty": 0.5,
                       "repetition_penalty": 1.2, "stop_token_ids": [7]}, chat=False)
    assert (p.top_k, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.stop_token_ids) == \
        (40, -1.0, 0.5, 1.2, (7,))
