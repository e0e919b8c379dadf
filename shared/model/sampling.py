"""Token sampling: greedy, penalties, temperature, top-k and top-p, with a per-request seeded generator, and
log-probabilities.

The same seed, logits and parameters give the same token: each request draws from its own CPU
``torch.Generator``, one draw per sampled token, so other requests in the batch do not change its stream.
Order, as vLLM and transformers apply it: repetition penalty (prompt and output tokens: a positive logit is
divided by it, a negative one multiplied), presence and frequency penalties (output tokens, OpenAI's
definition: ``logit -= presence * (count > 0) + frequency * count``), temperature, top-k, top-p, draw.
Log-probabilities are those of the model's own distribution (``log_softmax`` of the raw logits, before any
penalty or temperature: vLLM's default ``raw_logprobs``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingOptions:
    """What shapes one draw (temperature 0 = greedy; top_k 0 = off; penalties 0 / 1 = off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with ``seed`` (fresh entropy when ``None``)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def greedy(logits: torch.Tensor) -> list[int]:
    """Arg-max token of every row of ``logits`` [R, V] (lowest id wins a tie)."""
    return logits.argmax(dim=-1).tolist()


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
               top_k: int = 0) -> int:
    """Sample one token from a logits row [V] at ``temperature``, restricted to the ``top_k`` most likely tokens
    and then to the top-p nucleus."""
    if temperature <= 0.0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = (cum - sorted_p) < top_p
        sorted_p = sorted_p * keep
        idx = torch.multinomial(sorted_p, 1, generator=generator)
        return int(order[idx])
    return int(torch.multinomial(probs, 1, generator=generator))


def apply_penalties(logits: torch.Tensor, opts: SamplingOptions, prompt_ids: torch.Tensor | None,
                    output_ids: list[int]) -> torch.Tensor:
    """``logits`` [V] (float32, not modified) with the repetition/presence/frequency penalties applied."""
    out = logits.float().clone()
    if opts.repetition_penalty != 1.0:
        seen = torch.tensor(output_ids, dtype=torch.long, device=out.device)
        if prompt_ids is not None:
            seen = torch.cat([prompt_ids.to(out.device), seen])
        seen = seen.unique()
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / opts.repetition_penalty, vals * opts.repetition_penalty)
    if (opts.presence_penalty or opts.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=out.shape[-1])
        counts = counts[:out.shape[-1]].to(out.device, out.dtype)
        out -= opts.frequency_penalty * counts + opts.presence_penalty * (counts > 0).to(out.dtype)
    return out


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``top`` most likely tokens with theirs) under ``logits`` [V]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alts: list[tuple[int, float]] = []
    if top:
        vals, idx = torch.topk(lp, min(top, lp.shape[-1]))
        alts = list(zip(idx.tolist(), vals.tolist()))
    return float(lp[token]), alts


def validate_params(temperature: float, top_p: float, top_k: int = 0, repetition_penalty: float = 1.0,
                    logprobs: int | None = None) -> None:
    """``ValueError`` for out-of-range sampling parameters."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
