"""OpenAI-shaped response bodies: completion/chat JSON, SSE chunks, and errors coming back from the mesh."""
from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.core import ApiError

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = ("stop", "length")
_json = msgspec.json.Encoder()

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 502: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}


def response_id(request_id: str, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(raw: str | None) -> str | None:
    """The mesh reports stop | length; anything else it may add is reported to clients as ``stop``."""
    if raw is None:
        return None
    return raw if raw in FINISH_REASONS else "stop"


def _lp(v: float) -> float:
    return v if v > -9999.0 else -9999.0  # -inf is not JSON; vLLM reports it as -9999.0


class _IdNames:
    """vLLM's ``return_tokens_as_token_ids``: every token is named ``token_id:<id>``."""

    def token_text(self, t: int) -> str:
        return f"token_id:{t}"

    def token_bytes(self, t: int) -> bytes:
        return self.token_text(t).encode()


def logprobs_object(tokenizer: Any, token_ids: list[int], lps: list, *, chat: bool, offset: int = 0,
                    as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice (or of one streamed chunk) from the worker's per-token
    ``(logprob, [(token id, logprob), ...])`` entries; None when there are none."""
    if not lps:
        return None
    if as_ids:
        tokenizer = _IdNames()
    pairs = list(zip(token_ids, lps))
    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            b = tokenizer.token_bytes(t)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(lp), "bytes": list(b)}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, alp) for a, alp in top])
                            for t, (lp, top) in pairs]}
    tokens, offsets = [], []
    for t, _ in pairs:
        tokens.append(tokenizer.token_text(t))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_lp(lp) for _, (lp, _) in pairs],
            "top_logprobs": [{tokenizer.token_text(a): _lp(alp) for a, alp in top} for _, (_, top) in pairs],
            "text_offset": offsets}


def completion_body(*, request_id: str, chat: bool, created: int, model: str, text: str, finish: str | None,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict | None = None) -> dict[str, Any]:
    """A non-streamed ``text_completion`` or ``chat.completion`` object."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason(finish) or "stop"}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(finish) or "stop"}
    return {"id": response_id(request_id, chat), "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class StreamShaper:
    """Builds the SSE events of one streamed response (``text_completion`` or ``chat.completion.chunk``)."""

    def __init__(self, *, request_id: str, chat: bool, created: int, model: str, include_usage: bool) -> None:
        self.chat, self.include_usage = chat, include_usage
        self._base = {"id": response_id(request_id, chat),
                      "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": created, "model": model}

    def _chunk(self, choice: dict | None, usage_obj: dict | None = None) -> bytes:
        body = dict(self._base, choices=[choice] if choice is not None else [])
        if self.include_usage:
            body["usage"] = usage_obj
        return sse(body)

    def start(self) -> list[bytes]:
        """Events sent once, before any text (chat: the assistant role)."""
        if self.chat:
            return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})]
        return []

    def delta(self, text: str, logprobs: dict | None = None) -> bytes:
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None})

    def finish(self, finish: str | None, prompt_tokens: int, completion_tokens: int) -> list[bytes]:
        """The chunk with ``finish_reason``, the usage chunk when asked for, and ``[DONE]``."""
        fr = finish_reason(finish) or "stop"
        choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": fr} if self.chat
                  else {"index": 0, "text": "", "logprobs": None, "finish_reason": fr})
        out = [self._chunk(choice)]
        if self.include_usage:
            out.append(self._chunk(None, usage(prompt_tokens, completion_tokens)))
        out.append(DONE)
        return out

    @staticmethod
    def error(err: ApiError) -> list[bytes]:
        """An error after streaming began: an ``error`` event, then ``[DONE]``."""
        return [sse(err.body()), DONE]


def error_from_mesh(status: int, code: str, message: str, retryable: bool) -> ApiError:
    """Map a ``RequestError`` from the scheduler or a worker to an :class:`ApiError`."""
    if not 400 <= status <= 599:
        status = 500
    outcome = "error"
    if status == 429:
        outcome = "rejected_quota"
    elif status == 503 and code == "overloaded":
        outcome = "rejected_overload"
    return ApiError(status, message or code, type=ERROR_TYPES.get(status, "server_error" if status >= 500
                                                                   else "invalid_request_error"),
                    code=code or "internal_error", retry_after_s=1 if (retryable or status in (429, 503)) else None,
                    outcome=outcome)


def http_error(status: int, message: str, code: str) -> ApiError:
    """An error raised by aiohttp itself (unknown path, wrong method, body too large, ...)."""
    return ApiError(status, message, type=ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                                          else "server_error"), code=code)
