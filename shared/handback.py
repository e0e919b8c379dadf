"""Which device of a tenant's container decodes a sequence that a guest lane hands home (docs/guest-execution.md,
"Lane hand-off"): one rule, used by the simulator's lease book (``shared/sim/lease_book.py``) and by the workers
(``services/worker/handoff.py``).

The lease's home takes the sequence while its step, predicted with the sequence in its batch and with the chunk of
queued prompt tokens each step also carries while the device prefills, stays within :data:`HANDBACK_FILL` × the
sequence's TPOT target (a device that is still prefilling a queue of prompts steps slower than its decode batch alone
says). Past that, of the container's other devices with memory for the KV, the one whose predicted step is the longest
still within that bound takes it (best fit): decode packs onto a few devices run near the target, and the others keep
short steps for the prompts they prefill. When no device is within the bound, the rule before it applies (the lease's
home, or the device with the most free memory when the home has no room). Spreading the sequences to the shortest step
instead lost (docs/design-decisions.md): every device's prompts then share their steps with a larger decode batch.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

K = TypeVar("K")

HANDBACK_FILL = 0.95  # a device takes a handed-back sequence while its predicted step stays within this × its TPOT


def step_with(cost, running: int, context_tokens: int, prompt_tokens: int, queued_prefill: int = 0,
              budget: int = 0) -> float:
    """Predicted step (s) of a batch of ``running`` sequences attending to ``context_tokens`` positions once a
    sequence with a ``prompt_tokens`` prompt and its first token joins it (``cost``: a :class:`ModelCost`), while the
    device still has ``queued_prefill`` prompt tokens to prefill: each step then also carries a chunk of them, as
    many as the ``budget`` of tokens per iteration leaves (:meth:`ModelCost.chunk_iteration`)."""
    return cost.chunk_iteration(running + 1, context_tokens + prompt_tokens + 1, queued_prefill, budget)[0]


def best_fit(candidates: Iterable[tuple[K, float]], bound: float) -> K | None:
    """Of ``(key, predicted step)`` pairs, the key whose step is the longest still within ``bound``; None when no
    step is."""
    best, longest = None, -1.0
    for key, step in candidates:
        if longest < step <= bound:
            best, longest = key, step
    return best
