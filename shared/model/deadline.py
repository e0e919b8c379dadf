"""Deadline-aware chunked prefill: one rule for the engines (``shared/model/engine.py``) and the simulator's
replicas (``shared/sim/replica.py``), on when the cluster asks for it (``deadline_chunks``; docs/simulator.md).

Under a per-request SLA a short prompt has a short TTFT target (tens of milliseconds on an H100), and its first token
comes at the end of the iteration that prefills it. With chunks handed out in arrival order and the token budget
filled, that iteration also carries up to a whole budget of another, longer prompt, whose own target has hundreds of
milliseconds to spare: the short prompt misses on the length of the step, not on its place in the queue. Here the
sequences in prefill get their chunks in deadline order (arrival + TTFT target), and a step stops taking chunks at the
first one that would make it end past the deadline of a prompt it completes that it would otherwise meet. The
prompts left out take the next steps; at least one chunk is always taken.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TypeVar

K = TypeVar("K")

# (prefill tokens, query-key pairs, KV rows read, prompts completed) -> the step's predicted seconds with its batch
StepTime = Callable[[int, int, int, int], float]


def deadline_chunks(items: Iterable[tuple[K, int, int, float]], budget: int, now: float,
                    step_time: StepTime) -> list[tuple[K, int]]:
    """The prefill chunks of one step: ``items`` are ``(key, prompt tokens done, prompt tokens left, first-token
    deadline)`` of the sequences in prefill, ``budget`` the tokens the step has for them. Returns ``(key, tokens)``
    in deadline order (ties: the order given)."""
    out: list[tuple[K, int]] = []
    p = pairs = reads = done = 0
    t_cur, tight = 0.0, math.inf
    for key, computed, left, deadline in sorted(items, key=lambda x: x[3]):
        if budget <= 0:
            break
        q = min(left, budget)
        completes = q >= left
        q_pairs = q * computed + q * (q + 1) // 2
        t = step_time(p + q, pairs + q_pairs, reads + computed + q, done + completes)
        if out and now + t_cur <= tight < now + t:
            break  # this chunk would make a prompt the step completes miss a deadline it meets without it
        out.append((key, q))
        p, pairs, reads, done, t_cur = p + q, pairs + q_pairs, reads + computed + q, done + completes, t
        budget -= q
        if completes and deadline < tight:
            tight = deadline
    return out
