"""Tokenizers and chat templates, as transformers applies them.

- A checkpoint directory's ``tokenizer.json`` (Hugging Face ``tokenizers``), with ``tokenizer_config.json``
  (special tokens, ``chat_template``) or ``chat_template.jinja``.
- A GGUF file's vocabulary, merges and special tokens (``tokenizer.ggml.*``), built into a byte-level BPE the way
  transformers' GGUF loader does; its ``tokenizer.chat_template``.
- The byte-level fallback of the random-weight presets: ids 0..255 are the bytes of the UTF-8 text,
  ``bos_token_id``/``eos_token_id`` come from the model config, other ids decode to nothing.

BOS as transformers: a completion prompt is encoded like ``tokenizer(text)`` (BOS only where the tokenizer adds
it: its post-processor, or GGUF ``tokenizer.ggml.add_bos_token``); a chat is rendered with the template and
encoded without special tokens, as ``apply_chat_template`` does, so a template that writes ``{{ bos_token }}``
gets one BOS. Token-id prompts are taken as given. A checkpoint without a chat template refuses chat requests
(:class:`NoChatTemplate`); only the byte-level fallback has the built-in :data:`SIMPLE_CHAT_TEMPLATE`.
"""
from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

from shared.model.config import ModelConfig

log = structlog.get_logger(__name__)
SIMPLE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
_MAX_HELD_TOKENS = 6  # longest token run that can still be an incomplete UTF-8 character


class NoChatTemplate(ValueError):
    """The model has no chat template (transformers refuses ``apply_chat_template`` too)."""


@lru_cache(maxsize=16)
def _compiled(template: str):
    """A template compiled as transformers compiles chat templates (sandboxed, trim/lstrip blocks, tojson
    without ASCII escaping, ``raise_exception``, ``strftime_now``, loop controls)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """Common interface: encoding, decoding, special ids, the chat template."""

    bos_token_id: int | None
    eos_token_id: int | None  # the primary EOS (a template's ``eos_token``)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation
    chat_template: str | None = None
    add_bos: bool = False  # a completion prompt gets BOS (transformers' ``tokenizer(text)``)
    special_tokens: dict[str, str] = {}

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` without special tokens (``add_bos``: BOS first)."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs' ``bytes``); special tokens give their text."""
        return self.decode([token_id]).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt, encoded as transformers' ``tokenizer(text)`` would."""
        return self.encode(text, add_bos=self.add_bos)

    def _with_bos(self, ids: list[int], add_bos: bool) -> list[int]:
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    @staticmethod
    def check_messages(messages: list[dict[str, Any]]) -> None:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: expected a mapping with string 'role' and 'content'")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The chat rendered with the model's template, asking for the assistant's turn."""
        self.check_messages(messages)
        if not self.chat_template:
            raise NoChatTemplate("this model has no chat template; use /v1/completions")
        return _compiled(self.chat_template).render(messages=messages, add_generation_prompt=True, tools=None,
                                                    documents=None, **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render and encode a chat as transformers' ``apply_chat_template(..., tokenize=True)``."""
        return self.encode(self.apply_chat_template(messages))


class ByteTokenizer(Tokenizer):
    """ids 0..255 = UTF-8 bytes; special ids from the config; the built-in simple chat format."""

    add_bos = True

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.vocab_size < 256:
            raise ValueError(f"byte-level tokenizer needs vocab_size >= 256, model has {cfg.vocab_size}")
        eos = cfg.eos_token_ids
        self.bos_token_id, self.eos_token_id, self.eos_token_ids = cfg.bos_token_id, eos[0] if eos else None, eos
        self.vocab_size = cfg.vocab_size
        self._special = {cfg.bos_token_id, *eos}

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._with_bos(list(text.encode("utf-8")), add_bos)

    def encode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of ``ids`` (special and non-byte ids dropped)."""
        return bytes(i for i in ids if 0 <= i < 256 and i not in self._special)

    def decode(self, ids: list[int]) -> str:
        return self.encode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encode_bytes([token_id])

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Every message becomes ``<|{role}|>\\n{content}\\n``; the prompt ends with ``<|assistant|>\\n``."""
        self.check_messages(messages)
        return "".join(SIMPLE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) \
            + "<|assistant|>\n"

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_bos=True)


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``, or built from a GGUF vocabulary)."""

    def __init__(self, path: str | Path | None, cfg: ModelConfig, *, backend: Any = None,
                 config: dict[str, Any] | None = None, chat_template: str | None = None,
                 add_bos: bool | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        if backend is None:
            try:
                backend = _Tok.from_file(str(path))
            except Exception as e:  # the Rust library raises plain Exception
                raise ValueError(f"{path}: not a readable tokenizer.json: {e}") from None
        self._tok = backend
        self.vocab_size = backend.get_vocab_size()
        tc = config if config is not None else _tokenizer_config(Path(path)) if path else {}
        self.special_tokens = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if isinstance(v := _content(tc.get(k)), str)}
        self.bos_token_id = cfg.bos_token_id
        if self.bos_token_id is None and "bos_token" in self.special_tokens:
            self.bos_token_id = backend.token_to_id(self.special_tokens["bos_token"])
        tok_eos = backend.token_to_id(self.special_tokens["eos_token"]) if "eos_token" in self.special_tokens \
            else None
        eos = list(cfg.eos_token_ids) + ([tok_eos] if tok_eos is not None and tok_eos not in cfg.eos_token_ids
                                         else [])
        self.eos_token_id = tok_eos if tok_eos is not None else (eos[0] if eos else None)
        self.eos_token_ids = tuple(eos)
        for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if name not in self.special_tokens and tid is not None:
                self.special_tokens[name] = backend.id_to_token(tid) or ""
        tpl = chat_template if chat_template is not None else tc.get("chat_template")
        if isinstance(tpl, list):  # named templates: transformers uses "default"
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if tpl is None and path is not None and (Path(path).parent / "chat_template.jinja").is_file():
            tpl = (Path(path).parent / "chat_template.jinja").read_text()
        self.chat_template = tpl if isinstance(tpl, str) and tpl else None
        if add_bos is None:  # what tokenizer(text) adds: the post-processor's special tokens
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(probe) and self.bos_token_id is not None and probe[0] == self.bos_token_id
        self.add_bos = add_bos
        self._all_special = {i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None}

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        return self._with_bos(self._tok.encode(text, add_special_tokens=False).ids, add_bos)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in self._all_special], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _content(v: Any) -> Any:
    return v.get("content") if isinstance(v, dict) else v


def _tokenizer_config(tokenizer_json: Path) -> dict[str, Any]:
    tc = tokenizer_json.with_name("tokenizer_config.json")
    if not tc.is_file():
        return {}
    try:
        d = json.loads(tc.read_text())
    except ValueError as e:
        raise ValueError(f"{tc}: invalid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def gguf_tokenizer(path: str | Path, cfg: ModelConfig) -> HFTokenizer:
    """The tokenizer a GGUF file describes (``tokenizer.ggml.model`` gpt2: byte-level BPE), built as transformers'
    GGUF loader builds it: vocabulary respelled into the byte alphabet, the file's merges, GPT-2 byte-level
    pre-tokenizer (or the split its ``tokenizer.ggml.pre`` names), control tokens special, user-defined added."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    from shared.model.gguf_file import open_gguf
    from shared.model.hf_config import CheckpointError
    g = open_gguf(path)
    md = g.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(path, "tokenizer.ggml.model", f"{kind!r} is not supported (only gpt2 byte-level "
                              "BPE vocabularies)")
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise CheckpointError(path, "tokenizer.ggml.merges", "missing: the file carries no BPE vocabulary")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = _Tok(bpe)
    split = _PRE_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == 3 and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
    if user:
        tok.add_tokens(user)
    specials = {name: tokens[md[f"tokenizer.ggml.{key}"]] for name, key in
                (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                 ("pad_token", "padding_token_id")) if isinstance(md.get(f"tokenizer.ggml.{key}"), int)
                and 0 <= md[f"tokenizer.ggml.{key}"] < len(tokens)}
    return HFTokenizer(None, cfg, backend=tok, config=specials, chat_template=md.get("tokenizer.chat_template"),
                       add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def load_tokenizer(checkpoint: str | Path | None, cfg: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer (``tokenizer.json`` of a directory, or a GGUF file's vocabulary); the
    byte-level fallback for random-weight models and checkpoint directories without ``tokenizer.json``."""
    if checkpoint is not None:
        p = Path(checkpoint)
        if p.suffix == ".gguf":
            return gguf_tokenizer(p, cfg)
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json", cfg)
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

    def state(self) -> tuple:
        """What :meth:`restore` needs to continue this detokenizer elsewhere (plain values)."""
        return (self._utf8.getstate(),) if self._utf8 is not None else (list(self.ids), self.prefix, self.read)

    def restore(self, state: tuple) -> None:
        """Continue from :meth:`state` of a detokenizer over the same tokenizer."""
        if self._utf8 is not None:
            self._utf8.setstate(state[0])
        else:
            self.ids, self.prefix, self.read = list(state[0]), state[1], state[2]

    def flush(self) -> str:
        """Everything still held (an incomplete character decodes as U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""
