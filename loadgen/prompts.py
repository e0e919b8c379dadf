"""Prompt synthesis to an exact token count for a tenant's tokenizer.

A trace row gives only a prompt length; replay needs a text the server tokenizes to exactly that many tokens
(special tokens included). Two strategies: the byte-level tokenizer of the built-in tiny models (one byte per
token, plus a BOS the server adds), and a ``tokenizers`` ``tokenizer.json`` for checkpoints that ship one.
Texts differ per request (a salt picks where in a fixed pseudo-random corpus they start) so a prefix cache
cannot turn synthetic prompts into free hits.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from pathlib import Path

from shared.config import ConfigError, TenantConfig

_WORDS = ("the of and to in is it that for on with as was at by be this from or an are not have but all "
          "they one had word what were when your can said there use each which she how their will up other "
          "about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down "
          "day did get come made may part over new sound take only little work know place year live me back "
          "give most very after thing our just name good sentence man think say great where help through much "
          "before line right too mean old any same tell boy follow came want show also around form three small "
          "set put end does another well large must big even such because turn here why ask went men read need "
          "land different home us move try kind hand picture again change off play spell air away animal house").split()


class PromptSynthesizer(ABC):
    """Makes a prompt that tokenizes to exactly ``n_tokens`` (server-added special tokens included)."""

    @abstractmethod
    def prompt(self, n_tokens: int, salt: int = 0) -> str:
        """The prompt text; ``salt`` varies the content, never the length."""

    def count(self, text: str) -> int:
        """Tokens the server will see for ``text`` (including added special tokens)."""
        raise NotImplementedError


class ByteLevelSynthesizer(PromptSynthesizer):
    """One ASCII byte per token; the server adds a BOS, so ``n`` tokens are ``n − 1`` bytes."""

    _CORPUS_BYTES = 1 << 16

    def __init__(self, add_bos: bool = True) -> None:
        self.special = 1 if add_bos else 0
        rng = random.Random(1234)
        parts, size = [], 0
        while size < self._CORPUS_BYTES:
            w = rng.choice(_WORDS)
            parts.append(w)
            size += len(w) + 1
        self._corpus = " ".join(parts)

    def prompt(self, n_tokens: int, salt: int = 0) -> str:
        n = max(0, n_tokens - self.special)
        c = self._corpus
        start = (salt * 7919) % len(c)
        out = []
        while n > 0:
            piece = c[start:start + n]
            out.append(piece)
            n -= len(piece)
            start = 0
        return "".join(out)

    def count(self, text: str) -> int:
        return len(text.encode("utf-8")) + self.special


class TokenizerSynthesizer(PromptSynthesizer):
    """Exact counts with a Hugging Face ``tokenizer.json`` (``tokenizers`` library): words that encode to one
    token each are joined, then words are added or removed until the count is exact."""

    def __init__(self, tokenizer_file: str | Path, *, backend=None, special: int | None = None) -> None:
        from tokenizers import Tokenizer

        self.path = Path(tokenizer_file)
        if backend is not None:  # a tokenizer built from a GGUF file (the server adds ``special`` BOS tokens)
            self.tok = backend
        else:
            try:
                self.tok = Tokenizer.from_file(str(self.path))
            except Exception as e:  # the library raises plain Exception subclasses for bad files
                raise ConfigError(self.path, "(file)", f"cannot load tokenizer: {e}") from None
        probe = "hello"
        self.special = special if special is not None else \
            len(self.tok.encode(probe).ids) - len(self.tok.encode(probe, add_special_tokens=False).ids)
        self.words = [w for w in _WORDS if len(self.tok.encode(" " + w, add_special_tokens=False).ids) == 1
                      and len(self.tok.encode(w, add_special_tokens=False).ids) == 1]
        if not self.words:
            raise ConfigError(self.path, "(vocab)",
                              "no common English word is a single token; cannot synthesise prompts")

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids) + self.special

    def prompt(self, n_tokens: int, salt: int = 0) -> str:
        target = n_tokens
        rng = random.Random(salt)
        words = [rng.choice(self.words) for _ in range(max(0, target - self.special))]
        for _ in range(32):
            c = self.count(" ".join(words))
            if c == target or (c < target and not words and target <= self.special):
                break
            if c < target:
                words.extend(rng.choice(self.words) for _ in range(target - c))
            elif words:
                del words[-max(1, min(len(words), c - target)):]
            else:
                break
        return " ".join(words)


def synthesizer_for(tenant: TenantConfig) -> PromptSynthesizer:
    """A checkpoint with ``tokenizer.json`` or a GGUF vocabulary gets its tokenizer; everything else the byte-level
    one."""
    ck = tenant.model.checkpoint
    if ck and ck.endswith(".gguf"):
        from shared.model.tokenizer import load_tokenizer
        tok = load_tokenizer(ck, tenant.model.config)
        return TokenizerSynthesizer(ck, backend=tok._tok, special=int(tok.add_bos))  # type: ignore[attr-defined]
    if ck and (Path(ck) / "tokenizer.json").is_file():
        return TokenizerSynthesizer(Path(ck) / "tokenizer.json")
    return ByteLevelSynthesizer(add_bos=True)
