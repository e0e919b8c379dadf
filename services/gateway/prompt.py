"""From a parsed request to prompt token ids: chat template, BOS as transformers, context and vocabulary checks."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.gateway.core import ParsedRequest, bad_request


def check_context(prompt_len: int, max_tokens: int, context: int, *, chat: bool,
                  max_tokens_param: str = "max_tokens") -> None:
    """Reject ``max_tokens`` above the context, and prompt (incl. BOS) + ``max_tokens`` over it."""
    if max_tokens > context:
        raise bad_request(f"'{max_tokens_param}' is {max_tokens}, more than the model's context of {context} tokens",
                          max_tokens_param)
    if prompt_len + max_tokens > context:
        raise bad_request(f"this model's maximum context length is {context} tokens; the request has {prompt_len} "
                          f"prompt tokens and asks for {max_tokens} completion tokens",
                          "messages" if chat else "prompt", code="context_length_exceeded")


def render_prompt(tokenizer: Any, p: ParsedRequest) -> str:
    """The prompt text: the completion prompt, or the chat messages through the model's chat template."""
    if not p.chat:
        return p.prompt_text or ""
    try:
        return tokenizer.apply_chat_template([dict(m) for m in p.messages])
    except Exception as e:  # a checkpoint's Jinja template may reject a conversation (e.g. roles must alternate)
        if type(e).__name__ == "NoChatTemplate":
            raise bad_request(str(e), "messages", code="unsupported_parameter") from None
        raise bad_request(f"the messages cannot be rendered with the model's chat template: {str(e)[:200]}",
                          "messages") from None


def encode_prompt(tokenizer: Any, p: ParsedRequest, text: str) -> list[int]:
    """Token ids as transformers makes them: a completion prompt as ``tokenizer(text)`` (BOS where the tokenizer
    adds one), a rendered chat without added special tokens (its template writes them)."""
    if p.chat:
        if hasattr(tokenizer, "encode_bytes"):  # the byte-level fallback: BOS + the simple chat format
            return tokenizer.encode(text, add_bos=True)
        return tokenizer.encode(text)
    return tokenizer.encode_prompt(text)


def check_token_ids(ids: tuple[int, ...], vocab_size: int, param: str = "prompt") -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab_size})", f"{param}[{i}]")


def with_model_defaults(p: ParsedRequest, generation: Any) -> ParsedRequest:
    """Fill the sampling fields the request left out from the checkpoint's generation defaults (vLLM's rule),
    then from the OpenAI defaults."""
    def pick(v: Any, key: str, default: Any) -> Any:
        if v is not None:
            return v
        g = getattr(generation, key, None)
        return default if g is None else g
    return replace(p, temperature=float(pick(p.temperature, "temperature", 1.0)),
                   top_p=float(pick(p.top_p, "top_p", 1.0)), top_k=int(pick(p.top_k, "top_k", 0)),
                   repetition_penalty=float(pick(p.repetition_penalty, "repetition_penalty", 1.0)))
