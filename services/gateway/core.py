"""Gateway decisions as plain objects: limits, errors, request parsing/validation, auth and model resolution.

Nothing here touches Redis or aiohttp; ``service.py`` does the I/O. Quotas live in ``admission.py`` and response
shaping in ``responses.py``. Every rejection is an :class:`ApiError` that renders as an OpenAI-style error body.
"""
from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from shared.config import ConfigError, TenantConfig, TenantsConfig, env_number, hash_api_key

MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_MESSAGES = 4096
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
# Fields accepted with their default value only: anything else asks for a feature the mesh does not provide.
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, "")}


@dataclass(frozen=True)
class GatewayLimits:
    """Process limits from the environment (``SLICESCHED_*``), built once in ``__main__``."""

    max_body_bytes: int = 1024 * 1024
    max_inflight: int = 4096
    request_idle_timeout_s: float = 60.0
    redis_op_timeout_s: float = 2.0
    drain_s: float = 20.0
    retry_after_s: int = 1
    admit_sla_fraction: float = 0.5  # SLA limiter targets as a fraction of the tenant's SLA; 0 = limiter off
    stream_interval_ms: float = 10.0  # the tokens stream is read at most once per interval while it is busy; 0 = off

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "GatewayLimits":
        def num(name: str, default: float, kind: type) -> Any:
            return env_number(name, default, kind, above=0, env=env)

        fraction = env_number("SLICESCHED_ADMIT_SLA_FRACTION", 0.5, float, minimum=0, env=env)
        interval = env_number("SLICESCHED_STREAM_INTERVAL_MS", 10.0, float, minimum=0, maximum=1000, env=env)
        return cls(admit_sla_fraction=fraction, stream_interval_ms=interval,
                   max_body_bytes=num("SLICESCHED_MAX_BODY_BYTES", 1024 * 1024, int),
                   max_inflight=num("SLICESCHED_MAX_INFLIGHT", 4096, int),
                   request_idle_timeout_s=num("SLICESCHED_REQUEST_IDLE_TIMEOUT_S", 60.0, float),
                   redis_op_timeout_s=num("SLICESCHED_REDIS_TIMEOUT_S", 2.0, float),
                   drain_s=num("SLICESCHED_DRAIN_S", 20.0, float))


# ---------------------------------------------------------------- errors
class ApiError(Exception):
    """An HTTP error with an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str, code: str, param: str | None = None,
                 retry_after_s: int | None = None, outcome: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after_s = retry_after_s
        self.outcome = outcome  # label for slicesched_requests_total

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def invalid_type(param: str, expected: str, value: Any) -> ApiError:
    return bad_request(f"'{param}' must be {expected}, got {_json_type(value)}", param, code="invalid_type")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "value")


# ---------------------------------------------------------------- parsed request
@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request, before tokenization."""

    chat: bool
    model: str
    prompt_text: str | None = None  # completions with a text prompt
    prompt_ids: tuple[int, ...] | None = None  # completions with a token-id prompt (no BOS added)
    messages: tuple[dict, ...] = ()  # chat: ({"role", "content"} with content as a plain string)
    max_tokens: int = 16
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (chat: max_completion_tokens)
    # None: not in the request; :func:`with_model_defaults` fills in the checkpoint's generation_config.json
    # values, else the API defaults (temperature 1, top_p 1, top_k off, no penalty)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely tokens'
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignore_eos: bool = False


def check_content_type(content_type_header: str | None) -> None:
    """Accept JSON (``application/json``, ``*/*+json``) or no header at all; anything else is 415."""
    if content_type_header is None or content_type_header.strip() == "":
        return
    mime = content_type_header.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    raise ApiError(415, f"Content-Type must be application/json, got {mime[:100]!r}", type="invalid_request_error",
                   code="unsupported_media_type")


def decode_json(body: bytes) -> Any:
    """Parse a request body; malformed JSON, bad UTF-8 or absurd nesting is a 400 ``invalid_json``."""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None


def parse_request(data: Any, *, chat: bool) -> ParsedRequest:
    """Validate a decoded JSON body of ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions``."""
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(data)}", code="invalid_type")
    model = _req_str(data, "model")
    for name, allowed in UNSUPPORTED.items():
        if name in data and not any(data[name] == a and type(data[name]) is type(a) for a in allowed):
            raise bad_request(f"'{name}' is not supported by this server", name, code="unsupported_parameter")
    n = _opt(data, "n", int, "an integer")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", "n", code="unsupported_parameter")

    prompt_text = prompt_ids = None
    messages: tuple[dict, ...] = ()
    if chat:
        messages = _parse_messages(data)
    else:
        prompt_text, prompt_ids = _parse_prompt(data)

    max_tokens = _opt(data, "max_tokens", int, "an integer")
    if chat:
        mct = _opt(data, "max_completion_tokens", int, "an integer")
        if mct is not None:
            max_tokens, mt_param = mct, "max_completion_tokens"
        else:
            mt_param = "max_tokens"
    else:
        mt_param = "max_tokens"
    if max_tokens is None:
        max_tokens = 16
    if max_tokens <= 0:
        raise bad_request(f"'{mt_param}' must be at least 1, got {max_tokens}", mt_param)

    temperature = _opt_float(data, "temperature", 0.0, 2.0, default=None)
    top_p = _opt_float(data, "top_p", 0.0, 1.0, default=None)
    if top_p is not None and top_p <= 0.0:
        raise bad_request("'top_p' must be greater than 0", "top_p")
    top_k = _opt(data, "top_k", int, "an integer")
    if top_k is not None and top_k < -1:
        raise bad_request(f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
    top_k = None if top_k is None else max(0, top_k)
    rep = _opt_float(data, "repetition_penalty", 0.0, 2.0, default=None)
    if rep is not None and rep <= 0.0:
        raise bad_request("'repetition_penalty' must be greater than 0", "repetition_penalty")
    presence = _opt_float(data, "presence_penalty", -2.0, 2.0, default=0.0)
    frequency = _opt_float(data, "frequency_penalty", -2.0, 2.0, default=0.0)
    logprobs = _parse_logprobs(data, chat)
    stop_ids = _opt(data, "stop_token_ids", list, "an array of token ids") or []
    for i, t in enumerate(stop_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise invalid_type(f"stop_token_ids[{i}]", "a token id (non-negative integer)", t)
    seed = _opt(data, "seed", int, "an integer")
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise bad_request("'seed' must fit in a signed 64-bit integer", "seed")
    stop = _parse_stop(data)
    stream = _opt(data, "stream", bool, "a boolean") or False
    include_usage = False
    so = _opt(data, "stream_options", dict, "an object")
    if so is not None:
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise invalid_type("stream_options.include_usage", "a boolean", iu)
        include_usage = bool(iu)
    user = _opt(data, "user", str, "a string")
    if user is not None:
        _check_text(user, "user", MAX_USER_CHARS)
    ignore_eos = _opt(data, "ignore_eos", bool, "a boolean") or False
    return ParsedRequest(chat=chat, model=model, prompt_text=prompt_text, prompt_ids=prompt_ids, messages=messages,
                         max_tokens=max_tokens, max_tokens_param=mt_param, temperature=temperature, top_p=top_p,
                         top_k=top_k, repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
                         logprobs=logprobs, stop_token_ids=tuple(stop_ids), seed=seed, stop=stop,
                         tokens_as_ids=_opt(data, "return_tokens_as_token_ids", bool, "a boolean") or False,
                         stream=stream, include_usage=include_usage, user=user, ignore_eos=ignore_eos)


def _parse_logprobs(data: dict, chat: bool) -> int | None:
    """Completions: ``logprobs`` = k alternatives (0..20). Chat: ``logprobs`` true, ``top_logprobs`` = k."""
    if not chat:
        k = _opt(data, "logprobs", int, "an integer")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad_request(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {k}", "logprobs")
        return k
    on = _opt(data, "logprobs", bool, "a boolean")
    top = _opt(data, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs")
    if top and not on:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _req_str(data: dict, key: str) -> str:
    if key not in data or data[key] is None:
        raise bad_request(f"'{key}' is required", key, code="missing_required_parameter")
    v = data[key]
    if not isinstance(v, str):
        raise invalid_type(key, "a string", v)
    return v


def _opt(data: dict, key: str, kind: type, expected: str) -> Any:
    v = data.get(key)
    if v is None:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise invalid_type(key, expected, v)
    return v


def _opt_float(data: dict, key: str, lo: float, hi: float, *, default: float | None) -> float | None:
    v = data.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid_type(key, "a number", v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"'{key}' must be between {lo:g} and {hi:g}, got {v!r}", key)
    return float(v)


def _check_text(s: str, param: str, max_chars: int | None = None) -> None:
    if max_chars is not None and len(s) > max_chars:
        raise bad_request(f"'{param}' is longer than {max_chars} characters", param)
    if "\x00" in s:
        raise bad_request(f"'{param}' contains a NUL character", param)


def _parse_prompt(data: dict) -> tuple[str | None, tuple[int, ...] | None]:
    if "prompt" not in data or data["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt", code="missing_required_parameter")
    p = data["prompt"]
    if isinstance(p, str):
        _check_text(p, "prompt")
        return p, None
    if not isinstance(p, list):
        raise invalid_type("prompt", "a string, an array of token ids, or an array with one string", p)
    if p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise bad_request("batched prompts are not supported: give one string", "prompt",
                              code="unsupported_parameter")
        _check_text(p[0], "prompt")
        return p[0], None
    if len(p) == 1 and isinstance(p[0], list):
        p = p[0]
    for i, t in enumerate(p):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid_type(f"prompt[{i}]", "a token id (integer)", t)
    return None, tuple(p)


def _parse_messages(data: dict) -> tuple[dict, ...]:
    if "messages" not in data or data["messages"] is None:
        raise bad_request("'messages' is required", "messages", code="missing_required_parameter")
    msgs = data["messages"]
    if not isinstance(msgs, list):
        raise invalid_type("messages", "an array of messages", msgs)
    if not msgs:
        raise bad_request("'messages' must contain at least one message", "messages")
    if len(msgs) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds more than {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_type(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid_type(f"{where}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict):
                    raise invalid_type(pw, "an object", part)
                if part.get("type") != "text":
                    raise bad_request(f"'{pw}.type' must be 'text' (only text content is supported)", f"{pw}.type",
                                      code="unsupported_parameter")
                if not isinstance(part.get("text"), str):
                    raise invalid_type(f"{pw}.text", "a string", part.get("text"))
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise invalid_type(f"{where}.content", "a string or an array of text parts", content)
        _check_text(text, f"{where}.content")
        out.append({"role": role, "content": text})
    return tuple(out)


def _parse_stop(data: dict) -> tuple[str, ...]:
    s = data.get("stop")
    if s is None:
        return ()
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list):
        raise invalid_type("stop", "a string or an array of strings", s)
    if len(items) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} sequences", "stop")
    for i, x in enumerate(items):
        if not isinstance(x, str):
            raise invalid_type(f"stop[{i}]" if items is s else "stop", "a string", x)
        if not x:
            raise bad_request("stop sequences must not be empty", "stop")
        _check_text(x, "stop", MAX_STOP_CHARS)
    return tuple(items)


# ---------------------------------------------------------------- auth and models
class KeyIndex:
    """API key → tenant, over the sha256 hashes in the tenants config (keys are never stored in plain text)."""

    def __init__(self, tenants: TenantsConfig) -> None:
        self._entries = [(h.encode(), t.name) for t in tenants.tenants for h in t.api_key_hashes]
        self._tenants = {t.name: t for t in tenants.tenants}

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """Map an ``Authorization: Bearer <key>`` header to a tenant, comparing hashes in constant time."""
        if not authorization:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                           code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "malformed Authorization header: expected 'Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        digest = hash_api_key(key).encode()
        found = None
        for h, name in self._entries:  # no early exit: every stored hash is compared
            if hmac.compare_digest(h, digest):
                found = name
        if found is None:
            raise ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return self._tenants[found]

    def resolve_model(self, tenant: TenantConfig, model: str) -> TenantConfig:
        """A tenant's model id is the tenant name; a key reaches only its own tenant's model."""
        if model == tenant.name:
            return tenant
        if model in self._tenants:
            raise ApiError(403, f"this API key may not use model '{model}'", type="permission_error",
                           code="model_not_allowed", param="model")
        raise ApiError(404, f"model '{model[:200]}' does not exist", type="invalid_request_error",
                       code="model_not_found", param="model")
