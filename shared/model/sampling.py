"""Token sampling: greedy, temperature and top-p (nucleus), with a per-request seeded generator.

The same seed, logits and parameters give the same token: each request draws from its own
``torch.Generator``, one draw per sampled token, so other requests in the batch do not change its stream.
"""
from __future__ import annotations

import torch


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with ``seed`` (fresh entropy when ``None``)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def greedy(logits: torch.Tensor) -> list[int]:
    """Arg-max token of every row of ``logits`` [R, V] (lowest id wins a tie)."""
    return logits.argmax(dim=-1).tolist()


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Sample one token from a logits row [V] at ``temperature`` restricted to the top-p nucleus."""
    if temperature <= 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = (cum - sorted_p) < top_p
        sorted_p = sorted_p * keep
        idx = torch.multinomial(sorted_p, 1, generator=generator)
        return int(order[idx])
    return int(torch.multinomial(probs, 1, generator=generator))


def validate_params(temperature: float, top_p: float) -> None:
    """``ValueError`` for out-of-range sampling parameters."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
