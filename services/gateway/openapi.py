"""The OpenAPI 3.1 document the gateway serves at ``GET /openapi.json`` (schemas are JSON Schema 2020-12).

Tests validate real responses against these schemas, so the document stays accurate enough to fuzz the API with.
"""
from __future__ import annotations

from typing import Any

from services.gateway.core import CHAT_ROLES, MAX_LOGPROBS, MAX_STOP


def _nullable(schema: dict) -> dict:
    t = schema.get("type")
    if isinstance(t, str):
        return dict(schema, type=[t, "null"])
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_SAMPLING = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1, "default": 16,
                             "description": "completion tokens to generate; prompt + max_tokens <= context"}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2, "default": 1}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1}),
    "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
                       {"type": "null"}]},
    "stream": _nullable({"type": "boolean", "default": False}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}),
    "n": _nullable({"type": "integer", "enum": [1]}),
    "user": _nullable({"type": "string", "maxLength": 256}),
    "ignore_eos": _nullable({"type": "boolean", "default": False,
                             "description": "extension: keep generating past EOS until max_tokens"}),
    "top_k": _nullable({"type": "integer", "minimum": -1,
                        "description": "extension: sample among the k most likely tokens; -1 or 0 = off"}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2, "default": 0}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2, "default": 0}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2,
                                     "description": "extension (vLLM): > 1 discourages prompt and output tokens"}),
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0},
                                 "description": "extension (vLLM): token ids that end generation"}),
    "return_tokens_as_token_ids": _nullable({"type": "boolean", "default": False,
                                             "description": "extension (vLLM): logprobs name tokens 'token_id:<id>'"}),
}
_TOP = {"type": "object", "required": ["token", "logprob"],
        "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                       "bytes": {"type": "array", "items": {"type": "integer"}}}}
_CHAT_LOGPROBS = _nullable({"type": "object", "required": ["content"], "properties": {"content": {
    "type": "array", "items": dict(_TOP, properties=dict(_TOP["properties"], top_logprobs={
        "type": "array", "items": _TOP}))}}})
_COMPLETION_LOGPROBS = _nullable({"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs"],
                                  "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                                                 "token_logprobs": {"type": "array", "items": {"type": "number"}},
                                                 "top_logprobs": {"type": "array", "items": {"type": "object"}},
                                                 "text_offset": {"type": "array", "items": {"type": "integer"}}}})

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"type": "string", "enum": ["stop", "length"]}

SCHEMAS: dict[str, Any] = {
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "description": "the tenant name"},
            "prompt": {"anyOf": [{"type": "string"},
                                 {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                 {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                                 {"type": "array", "minItems": 1, "maxItems": 1,
                                  "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}}]},
            **_SAMPLING,
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "log-probability of each token and of the k most likely"}),
        },
    },
    "ChatMessage": {
        "type": "object", "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": list(CHAT_ROLES)},
            "content": {"anyOf": [{"type": "string"},
                                  {"type": "array", "items": {
                                      "type": "object", "required": ["type", "text"],
                                      "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
                                  {"type": "null"}]},
        },
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "description": "the tenant name"},
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            **_SAMPLING,
            "logprobs": _nullable({"type": "boolean", "default": False}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                       "description": "needs logprobs: true"}),
        },
    },
    "Usage": _USAGE,
    "Completion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string", "pattern": "^cmpl-"}, "object": {"const": "text_completion"},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": {"const": 0}, "text": {"type": "string"}, "finish_reason": _FINISH,
                               "logprobs": _COMPLETION_LOGPROBS}}},
        },
    },
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string", "pattern": "^chatcmpl-"}, "object": {"const": "chat.completion"},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {"index": {"const": 0}, "finish_reason": _FINISH, "logprobs": _CHAT_LOGPROBS, "message": {
                    "type": "object", "required": ["role", "content"],
                    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}}},
        },
    },
    "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                             "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    },
    "Health": {"type": "object", "required": ["status", "service"],
               "properties": {"status": {"type": "string", "enum": ["ok", "starting", "degraded", "draining"]},
                              "service": {"type": "string"}, "name": {"type": "string"},
                              "uptime_s": {"type": "number"}, "redis": {"type": "boolean"}}},
    "Readiness": {"type": "object", "required": ["status", "not_ready", "tenants"],
                  "properties": {"status": {"type": "string", "enum": ["ready", "not_ready"]},
                                 "gateway": {"type": "string"},
                                 "not_ready": {"type": "array", "items": {"type": "string"}},
                                 "tenants": {"type": "object", "additionalProperties": {
                                     "type": "object", "required": ["ready", "reason"],
                                     "properties": {"ready": {"type": "boolean"}, "reason": {"type": "string"}}}}}},
}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


def _error(desc: str, retry_after: bool = False) -> dict:
    r: dict[str, Any] = {"description": desc, "content": _json("Error")}
    if retry_after:
        r["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait"}}
    return r


_REQ_ID = {"X-Request-Id": {"schema": {"type": "string"}, "description": "the request id (also in every log line)"}}
_GEN_ERRORS = {
    "400": _error("invalid request (malformed JSON, wrong types, out-of-range values, context exceeded)"),
    "401": _error("missing or invalid API key"), "403": _error("the key's tenant may not use this model"),
    "404": _error("unknown model"), "413": _error("body larger than the limit"),
    "415": _error("Content-Type is not application/json"),
    "429": _error("tenant over its quota or queue bound", True),
    "500": _error("a worker failed while generating"), "502": _error("token stream broken between worker and gateway"),
    "503": _error("cluster saturated, Redis unreachable, or draining", True),
    "504": _error("no progress from the mesh within the idle timeout"),
}


def _generate_op(summary: str, req: str, resp: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": _json(req)},
        "responses": {"200": {"description": "the completion (JSON), or a server-sent event stream ending in "
                                             "'data: [DONE]' when stream is true", "headers": _REQ_ID,
                              "content": {**_json(resp), "text/event-stream": {"schema": {"type": "string"}}}},
                      **_GEN_ERRORS},
    }}


def openapi_document() -> dict[str, Any]:
    """The whole document (the component schemas are shared module-level dicts: do not mutate)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "SliceScheduler gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat completions; a tenant's model id is the "
                                "tenant name."},
        "paths": {
            "/v1/completions": _generate_op("Text completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generate_op("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": {"get": {"summary": "The caller's tenant's model", "security": [{"bearerAuth": []}],
                                   "responses": {"200": {"description": "models", "content": _json("ModelList")},
                                                 "401": _GEN_ERRORS["401"]}}},
            "/health": {"get": {"summary": "Liveness", "security": [],
                                "responses": {"200": {"description": "alive", "content": _json("Health")},
                                              "503": {"description": "starting, Redis down, or draining",
                                                      "content": _json("Health")}}}},
            "/ready": {"get": {"summary": "Readiness: a live worker for every tenant", "security": [],
                               "responses": {"200": {"description": "every tenant can be served",
                                                     "content": _json("Readiness")},
                                             "503": {"description": "some tenants cannot be served (named, with why)",
                                                     "content": _json("Readiness")}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": [],
                                 "responses": {"200": {"description": "Prometheus text format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1 document",
                                                            "content": {"application/json": {
                                                                "schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                          "description": "a tenant API key"}}},
    }
