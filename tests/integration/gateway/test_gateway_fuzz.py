"""Hypothesis fuzz of the HTTP API: random methods, paths, keys, content types and (mostly plausible) bodies.

Every answer must be below 500, every error a JSON body matching the OpenAPI ``Error`` schema, every success
match its documented schema, and nothing may hang. ~150 cases by default, 1000 in the ``slow`` run.
"""
from __future__ import annotations

import http.client
import json
import time
from collections import Counter

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_harness import KEY_A, KEY_B, KEY_Q, ThreadedGateway
from services.gateway.openapi import openapi_document

pytestmark = pytest.mark.integration
DOC = openapi_document()
GEN_PATHS = {"/v1/completions": "Completion", "/v1/chat/completions": "ChatCompletion"}


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": DOC["components"]})


VALIDATORS = {n: _validator(n) for n in ("Error", "Completion", "ChatCompletion", "ModelList", "Health")}

def weighted(*pairs):
    """One of several strategies, drawn with integer weights."""
    return st.sampled_from([s for w, s in pairs for _ in range(w)]).flatmap(lambda s: s)


scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=40))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                     max_size=4), max_leaves=12)
texts = st.text(max_size=60)
# valid requests for tenant ta (context 128): prompt + max_tokens stay well inside it
valid_options = {
    "max_tokens": st.integers(1, 40), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.text(min_size=1, max_size=5) | st.lists(
        st.text(min_size=1, max_size=5), max_size=4), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.just(1),
    "user": st.text(max_size=20), "ignore_eos": st.booleans(), "logprobs": st.none()}
valid_completion = st.fixed_dictionaries(
    {"model": st.sampled_from(["ta", "ta", "ta", "tb", "tq"]),
     "prompt": st.text(max_size=20) | st.lists(st.integers(0, 511), max_size=20) | st.lists(st.text(max_size=20),
                                                                                           min_size=1, max_size=1)},
    optional=valid_options)
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                       "content": st.text(max_size=15) | st.lists(st.fixed_dictionaries(
                                           {"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)})
valid_chat = st.fixed_dictionaries({"model": st.sampled_from(["ta", "ta", "ta", "tb", "tq"]),
                                    "messages": st.lists(valid_message, min_size=1, max_size=3)},
                                   optional={**valid_options, "max_completion_tokens": st.integers(1, 40)})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | anything},
                                optional={"content": texts | st.lists(st.fixed_dictionaries(
                                    {"type": st.sampled_from(["text", "image_url"]), "text": texts})) | anything})
fields = {
    "model": st.sampled_from(["ta", "tb", "tq", "nope", ""]) | anything,
    "prompt": texts | st.lists(st.integers(-5, 600), max_size=20) | st.lists(texts, max_size=2) | anything,
    "messages": st.lists(message, max_size=3) | anything,
    "max_tokens": st.integers(-3, 300) | anything,
    "max_completion_tokens": st.integers(-3, 300) | anything,
    "temperature": st.floats(-1, 3) | anything, "top_p": st.floats(-0.5, 1.5) | anything,
    "seed": st.integers(-(2**65), 2**65) | anything, "stop": texts | st.lists(texts, max_size=6) | anything,
    "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | anything}) | anything,
    "n": st.integers(0, 3) | anything, "user": texts | anything, "ignore_eos": st.booleans() | anything,
    "logprobs": st.none() | anything, "echo": st.booleans(), "best_of": st.integers(0, 3),
}
random_fields = st.fixed_dictionaries({}, optional=fields)


def mutated(valid):
    """A valid body with one field replaced by something drawn from the hostile field strategies."""
    return st.tuples(valid, st.sampled_from(sorted(fields)).flatmap(
        lambda k: fields[k].map(lambda v: (k, v)))).map(lambda t: {**t[0], t[1][0]: t[1][1]})


def bodies(valid):
    as_json = weighted((6, valid), (4, mutated(valid)), (1, random_fields), (1, anything)).map(
        lambda d: json.dumps(d).encode())
    return weighted((10, as_json), (1, st.binary(max_size=120)), (1, st.none()))


BODIES = {"/v1/completions": bodies(valid_completion), "/v1/chat/completions": bodies(valid_chat)}
OTHER_BODIES = weighted((3, st.none()), (1, st.binary(max_size=60)), (1, bodies(valid_completion)))
paths = weighted((6, st.just("/v1/completions")), (6, st.just("/v1/chat/completions")),
                 (2, st.sampled_from(["/v1/models", "/health", "/metrics", "/openapi.json", "/", "/v1",
                                      "/v1/completions/x", "/V1/COMPLETIONS", "/v1/models/ta", "/v1//completions"])),
                 (1, st.text("abcxyz/._-~%20", max_size=20).map(lambda s: "/" + s)))
methods_for_generation = weighted((8, st.just("POST")),
                                  (1, st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])))
methods_other = weighted((4, st.just("GET")), (1, st.sampled_from(["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])))
auths = st.sampled_from([f"Bearer {KEY_A}"] * 8 + [f"Bearer {KEY_B}", f"Bearer {KEY_Q}", "Bearer wrong-key-123",
                                                   "Basic YTpi", "Bearer", "", None])
ctypes = st.sampled_from(["application/json"] * 8 + ["application/json; charset=utf-8", "text/plain",
                                                     "application/x-www-form-urlencoded", "multipart/form-data",
                                                     "application/vnd.api+json", "", None])


@st.composite
def requests(draw):
    path = draw(paths)
    method = draw(methods_for_generation if path in BODIES else methods_other)
    body = draw(BODIES.get(path, OTHER_BODIES))
    return method, path, draw(auths), draw(ctypes), body


@pytest.fixture(scope="module")
def fuzz_gateway(redis_url):
    with ThreadedGateway(redis_url) as g:
        yield g


def _check(port: int, method: str, path: str, auth, ctype, body, seen: Counter) -> None:
    headers = {}
    if auth is not None:
        headers["Authorization"] = auth
    if ctype is not None:
        headers["Content-Type"] = ctype
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)  # a hang fails the case
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    assert r.status < 500, (r.status, raw[:500])
    seen[(r.status, path in GEN_PATHS)] += 1
    if method == "HEAD":
        return
    assert r.getheader("X-Request-Id") or path == "/metrics" or r.status < 300
    if r.status >= 400:
        assert r.getheader("Content-Type", "").startswith("application/json"), raw[:200]
        VALIDATORS["Error"].validate(json.loads(raw))
    elif r.status == 200 and path in GEN_PATHS and method == "POST":
        if r.getheader("Content-Type", "").startswith("text/event-stream"):
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        else:
            VALIDATORS[GEN_PATHS[path]].validate(json.loads(raw))
    elif r.status == 200 and path == "/v1/models":
        VALIDATORS["ModelList"].validate(json.loads(raw))


def _fuzz(g: ThreadedGateway, n: int) -> Counter:
    seen: Counter = Counter()

    @settings(max_examples=n, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests())
    def run(req):
        _check(g.port, *req, seen)

    run()
    print("fuzz statuses (status, generation endpoint):", dict(seen))
    return seen


def test_fuzz_http_api(fuzz_gateway):
    seen = _fuzz(fuzz_gateway, 150)
    assert seen[(200, True)] >= 3 and sum(v for (st_, _), v in seen.items() if 400 <= st_ < 500) >= 50
    # the gateway releases a request's admission after its response is written, so the last one may still be on
    # its way out when the client has read it; a leaked slot stays
    deadline = time.monotonic() + 5.0
    while fuzz_gateway.svc.admission.total_inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fuzz_gateway.svc.admission.total_inflight == 0


@pytest.mark.slow
def test_fuzz_http_api_1000(fuzz_gateway):
    seen = _fuzz(fuzz_gateway, 1000)
    assert sum(seen.values()) >= 1000 and seen[(200, True)] >= 20
    assert fuzz_gateway.svc.admission.total_inflight == 0
