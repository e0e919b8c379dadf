"""Tokenizers: a checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) or a byte-level fallback.

Byte-level fallback: ids 0..255 are the bytes of the UTF-8 text; ``bos_token_id``/``eos_token_id`` come from the
model config. Ids that are neither bytes nor special (a random-weight model samples them) decode to nothing.

Chat template: a checkpoint's ``tokenizer_config.json`` ``chat_template`` (Jinja) is used when present and Jinja
is installed; otherwise :data:`SIMPLE_CHAT_TEMPLATE`: every message becomes ``<|{role}|>\\n{content}\\n`` and the
prompt ends with ``<|assistant|>\\n``.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

import structlog

from shared.model.config import ModelConfig

log = structlog.get_logger(__name__)
SIMPLE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
_MAX_HELD_TOKENS = 6  # longest token run that can still be an incomplete UTF-8 character


class Tokenizer:
    """Common interface: ``encode``, ``decode``, special ids and the chat template."""

    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None = None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _with_bos(self, ids: list[int], add_bos: bool) -> list[int]:
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render chat ``messages`` ({"role", "content"}) into a prompt that asks for the assistant's turn."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: expected a mapping with string 'role' and 'content'")
        if self.chat_template:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                log.warning("chat_template_unrendered", reason="jinja2 not installed")
            else:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                return env.from_string(self.chat_template).render(
                    messages=messages, add_generation_prompt=True, bos_token=self._special_text(self.bos_token_id),
                    eos_token=self._special_text(self.eos_token_id))
        return "".join(SIMPLE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) \
            + "<|assistant|>\n"

    def _special_text(self, token_id: int | None) -> str:
        return ""


class ByteTokenizer(Tokenizer):
    """ids 0..255 = UTF-8 bytes; special ids from the config."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.vocab_size < 256:
            raise ValueError(f"byte-level tokenizer needs vocab_size >= 256, model has {cfg.vocab_size}")
        self.bos_token_id, self.eos_token_id = cfg.bos_token_id, cfg.eos_token_id
        self.vocab_size = cfg.vocab_size
        self._special = {cfg.bos_token_id, cfg.eos_token_id}

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._with_bos(list(text.encode("utf-8")), add_bos)

    def encode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ``ids`` (special and non-byte ids dropped)."""
        return bytes(i for i in ids if 0 <= i < 256 and i not in self._special)

    def decode(self, ids: list[int]) -> str:
        return self.encode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception
            raise ValueError(f"{path}: not a readable tokenizer.json: {e}") from None
        self.bos_token_id, self.eos_token_id = cfg.bos_token_id, cfg.eos_token_id
        self.vocab_size = self._tok.get_vocab_size()
        tc = Path(path).with_name("tokenizer_config.json")
        if tc.is_file():
            try:
                tpl = json.loads(tc.read_text()).get("chat_template")
            except ValueError as e:
                raise ValueError(f"{tc}: invalid JSON: {e}") from None
            self.chat_template = tpl if isinstance(tpl, str) else None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._with_bos(self._tok.encode(text, add_special_tokens=False).ids, add_bos)

    def decode(self, ids: list[int]) -> str:
        special = (self.bos_token_id, self.eos_token_id)
        return self._tok.decode([i for i in ids if i not in special], skip_special_tokens=True)

    def _special_text(self, token_id: int | None) -> str:
        return (self._tok.id_to_token(token_id) or "") if token_id is not None else ""


def load_tokenizer(checkpoint_dir: str | Path | None, cfg: ModelConfig) -> Tokenizer:
    """``tokenizer.json`` of the checkpoint when present, else the byte-level fallback."""
    if checkpoint_dir is not None:
        f = Path(checkpoint_dir) / "tokenizer.json"
        if f.is_file():
            return HFTokenizer(f, cfg)
    return ByteTokenizer(cfg)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, holding back an incomplete UTF-8 character.

    Byte-level fallback: an incremental UTF-8 decoder, so the deltas join to exactly ``decode(all ids)``.
    Otherwise: decodes a short window of recent tokens (prefix/read offsets, as vLLM does), O(window) per step.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if isinstance(tokenizer, ByteTokenizer) else None
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids and self._utf8 is None else []
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly complete text."""
        if self._utf8 is not None:
            return self._utf8.decode(self.tok.encode_bytes(new_ids))  # type: ignore[attr-defined]
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        held = len(self.ids) - self.read
        if len(text) > len(prefix_text) and (not text.endswith("\ufffd") or held >= _MAX_HELD_TOKENS):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Everything still held (an incomplete character decodes as U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""
