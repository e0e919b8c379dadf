"""Iteration time when some MLP segments of a tenant run on guest devices under leases (pipelined micro-batches).

The driver splits its batch into ``micro_batches`` equal parts. For every offloaded ``mlp[l]`` the hidden states
of a micro-batch go to the guest and back (two transfers); while a guest runs ``mlp[l]`` of one micro-batch, the
home runs ``attn`` of the next. The closed form adds, layer by layer, the local layers' home time and, for each
offloaded layer, the longest of: the home's attention over all micro-batches, the guest's MLP over all of them
(at the share of its time it gives us), and one micro-batch's round trip. ``explicit_schedule`` lays the same
segments out one by one (list scheduling) and is used in tests to check the closed form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.costmodel.model_cost import ModelCost
from shared.costmodel.profiles import LinkSpec


@dataclass(slots=True)
class OffloadPart:
    """``layers`` MLP segments of the driver's model placed on one guest, which gives ``share`` of its time."""

    guest: str
    layers: int
    share: float
    link: LinkSpec
    guest_cost: ModelCost
    lease_id: str = ""


@dataclass(slots=True)
class OffloadTiming:
    """Result of :func:`offloaded_iteration_time`: total time, home busy time, and per-guest busy/link time."""

    total_s: float
    home_busy_s: float
    guest_busy_s: list[float]
    link_busy_s: list[float]
    link_bytes: list[float]


def _mb_parts(cost: ModelCost, n_decode: int, decode_kv: int, prefill_tokens: int, prefill_pairs: int,
              prefill_reads: int, sampled: int, m: int) -> tuple[int, float, float, float]:
    """(tokens per micro-batch, attn time per layer, home mlp time per layer, embed+head) for one micro-batch."""
    tm = -(-(n_decode + prefill_tokens) // m)
    a = cost.attn_dense_time(tm)
    if n_decode:
        a += cost.decode_attention_time(-(-n_decode // m), decode_kv // m)
    if prefill_tokens:
        a += cost.prefill_attention_time(-(-prefill_tokens // m), prefill_pairs // m, prefill_reads // m)
    eh = cost.embed_time(tm) + cost.head_time(-(-sampled // m) if sampled else 0)
    return tm, a, cost.mlp_time(tm), eh


def offloaded_iteration_time(cost: ModelCost, parts: list[OffloadPart], shares: list[float], n_decode: int,
                             decode_kv: int, prefill_tokens: int = 0, prefill_pairs: int = 0, prefill_reads: int = 0,
                             sampled: int | None = None, micro_batches: int = 2,
                             mb: tuple[int, float, float, float] | None = None) -> OffloadTiming:
    """Predicted time of one iteration with ``parts`` offloaded; ``shares[i]`` is the fraction of guest i's time
    available to us during this iteration (1.0 when its own tenant is idle). ``mb`` is :func:`micro_batch_parts`
    of the same arguments when the caller already has it (it depends on the home's batch only)."""
    m = max(1, micro_batches)
    s_rows = n_decode if sampled is None else sampled
    tm, a, mh, eh = mb if mb is not None else \
        _mb_parts(cost, n_decode, decode_kv, prefill_tokens, prefill_pairs, prefill_reads, s_rows, m)
    layers = cost.layers
    s_total = sum(p.layers for p in parts)
    home_mb = eh + layers * a + (layers - s_total) * mh
    hb = tm * cost.hidden_bytes_per_token
    chain = home_mb
    guest_busy, link_busy, link_bytes = [], [], []
    # Layer by layer: a local layer costs the home m·(a + mh); an offloaded one costs the longest of the home's
    # attention for all micro-batches, the guest's MLP for all of them, and one micro-batch's round trip
    # (attention, transfer, guest MLP, transfer back) — the next layer's attention waits for it.
    total = m * eh + (layers - s_total) * m * (a + mh)
    for p, f in zip(parts, shares):
        g = p.guest_cost.mlp_time(tm) / max(f, 1e-9)
        x_bw = hb / p.link.bandwidth
        x = p.link.latency_s + x_bw
        guest_busy.append(m * p.layers * p.guest_cost.mlp_time(tm))
        link_busy.append(m * p.layers * 2 * x_bw)
        link_bytes.append(m * p.layers * 2 * hb)
        total += p.layers * max(m * a, a + g + 2 * x, m * g)
    total = max([total] + link_busy)
    return OffloadTiming(total, m * (eh + layers * a + (layers - s_total) * mh), guest_busy, link_busy, link_bytes)


def micro_batch_parts(cost: ModelCost, n_decode: int, decode_kv: int, prefill_tokens: int = 0,
                      prefill_pairs: int = 0, prefill_reads: int = 0, sampled: int | None = None,
                      micro_batches: int = 2) -> tuple[int, float, float, float]:
    """The home-side terms :func:`offloaded_iteration_time` needs, for passing to several calls with one batch."""
    return _mb_parts(cost, n_decode, decode_kv, prefill_tokens, prefill_pairs, prefill_reads,
                     n_decode if sampled is None else sampled, max(1, micro_batches))


def explicit_schedule(cost: ModelCost, parts: list[OffloadPart], n_decode: int, decode_kv: int,
                      prefill_tokens: int = 0, prefill_pairs: int = 0, prefill_reads: int = 0,
                      sampled: int | None = None, micro_batches: int = 2) -> float:
    """Makespan of the same iteration laid out segment by segment (guests fully available, offloaded layers
    assigned to guests in contiguous blocks spread evenly over the depth); a check for the closed form."""
    m = max(1, micro_batches)
    s_rows = n_decode if sampled is None else sampled
    tm, a, mh, eh = _mb_parts(cost, n_decode, decode_kv, prefill_tokens, prefill_pairs, prefill_reads, s_rows, m)
    layers = cost.layers
    placement: list[int] = [-1] * layers  # guest index per layer's mlp, -1 = home
    s_total = sum(p.layers for p in parts)
    if s_total:
        chosen = sorted({min(layers - 1, int(math.floor(i * layers / s_total))) for i in range(s_total)})
        k = 0
        for gi, p in enumerate(parts):
            for _ in range(p.layers):
                if k < len(chosen):
                    placement[chosen[k]] = gi
                    k += 1
    home_free = 0.0
    guest_free = [0.0] * len(parts)
    ready = [0.0] * m  # when each micro-batch's next segment may start
    hb = tm * cost.hidden_bytes_per_token
    for mb in range(m):  # embed
        start = max(home_free, ready[mb])
        home_free = ready[mb] = start + eh / 2
    for layer in range(layers):
        for mb in range(m):
            start = max(home_free, ready[mb])
            home_free = ready[mb] = start + a
        for mb in range(m):
            gi = placement[layer]
            if gi < 0:
                start = max(home_free, ready[mb])
                home_free = ready[mb] = start + mh
            else:
                p = parts[gi]
                x = p.link.latency_s + hb / p.link.bandwidth
                start = max(guest_free[gi], ready[mb] + x)
                guest_free[gi] = start + p.guest_cost.mlp_time(tm)
                ready[mb] = guest_free[gi] + x
    for mb in range(m):  # head
        start = max(home_free, ready[mb])
        home_free = ready[mb] = start + eh / 2
    return max(ready)
