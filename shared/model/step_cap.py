"""TPOT-bounded chunked prefill: one rule for the engines (``shared/model/engine.py``) and the simulator's replicas
(``shared/sim/replica.py``), on when the cluster asks for it (``step_cap_s``; docs/simulator.md).

While sequences decode, the length of each step is the gap between their tokens. A step that also carries a full
prefill chunk (2,048 tokens) lasts several times a decode-only step, so every sequence decoding beside a long prompt
sees gaps of that length, and a tenant with a tight TPOT target misses it on other requests' prompts. With a cap of
``S`` seconds, a step that has sequences decoding takes prefill tokens only while its predicted time stays within
``S``: the chunks in the order they were picked (arrival or deadline order), the last one cut to the largest number of
tokens that fits. A prompt still progresses when the decode batch alone takes longer than ``S``: the first chunk keeps
at least :data:`MIN_TOKENS` tokens. A step with nothing decoding is not capped.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from shared.model.deadline import StepTime

K = TypeVar("K")

MIN_TOKENS = 16  # prompt tokens a capped step still takes (one KV block) when not one more fits under the cap


def cap_chunks(chunks: Iterable[tuple[K, int, int, int]], cap_s: float, step_time: StepTime) -> list[tuple[K, int]]:
    """The prefix of a step's prefill chunks that keeps its predicted time within ``cap_s``. ``chunks`` are ``(key,
    prompt tokens done, tokens picked, prompt tokens left)`` in the order picked; ``step_time`` prices the step with
    its decode batch (as :func:`shared.model.deadline.deadline_chunks`'s). Returns ``(key, tokens)``."""
    out: list[tuple[K, int]] = []
    p = pairs = reads = done = 0

    def at(computed: int, n: int, left: int) -> tuple[int, int, int, int]:
        return p + n, pairs + n * computed + n * (n + 1) // 2, reads + computed + n, done + (n >= left)

    for key, computed, q, left in chunks:
        if q <= 0:
            continue
        if step_time(*at(computed, q, left)) <= cap_s:
            out.append((key, q))
            p, pairs, reads, done = at(computed, q, left)
            continue
        lo, hi = 0, q - 1  # the largest n < q that fits (the step's time grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step_time(*at(computed, mid, left)) <= cap_s:
                lo = mid
            else:
                hi = mid - 1
        n = lo if (lo or out) else min(q, MIN_TOKENS)
        if n:
            out.append((key, n))
        break
    return out
