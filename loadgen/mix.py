"""Turning traces into per-tenant arrivals: popularity, offsets, time compression, tiling, thinning, caps.

Pure functions over numpy arrays; randomness comes from generators seeded by the workload seed and the
tenant's position, so the same inputs always give the same requests. The rules are documented in
``docs/loadgen.md`` ("Semantics").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadgen.traces import Trace
from shared.workload import WorkloadRequest

MIN_INPUT_TOKENS = 2  # a prompt of at least one token besides the BOS the server adds
SCALE_MODES = ("superpose", "compress")  # how a rate scale s > 1 adds load (docs/loadgen.md, "Semantics")


def popularity_weights(n: int, alpha: float) -> np.ndarray:
    """Power-law popularity over ``n`` tenants in order: w_i ∝ (i+1)^(−α), normalised to sum 1."""
    w = np.arange(1, n + 1, dtype=np.float64) ** (-float(alpha))
    return w / w.sum()


def tenant_rng(seed: int, index: int, stream: int) -> np.random.Generator:
    """The generator for one tenant and purpose (0 = offset, 1 = thinning/jitter)."""
    return np.random.default_rng([int(seed), int(index), int(stream)])


def auto_offset(seed: int, index: int, period_s: float) -> float:
    """A seeded circular shift in [0, period) so tenants sharing a trace do not burst together."""
    return float(tenant_rng(seed, index, 0).uniform(0.0, period_s))


@dataclass(frozen=True, eq=False)
class TenantPlan:
    """How one tenant draws from its trace."""

    tenant: str
    trace: Trace
    target_rate_rps: float  # at rate_scale 1
    offset_s: float  # circular shift in trace time
    context: int  # prompt + output ≤ context (the model's max_position_embeddings)
    max_input_tokens: int | None = None  # global caps from the workload file
    max_output_tokens: int | None = None
    jitter_s: float | None = None  # replica jitter in trace time; default one mean gap of the trace

    @property
    def factor(self) -> float:
        """Thinning (< 1) or replication (> 1) factor relative to the trace's native rate."""
        return self.target_rate_rps / self.trace.rate_rps if self.trace.rate_rps > 0 else 0.0


def tenant_arrivals(plan: TenantPlan, rate_scale: float, duration_s: float,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Times (s, sorted, in [0, duration_s)), input and output tokens of one tenant.

    The trace is shifted circularly by the offset, tiled end to end over ``duration_s × rate_scale`` seconds of
    trace time, thinned (factor < 1) or replicated with seeded jitter (factor > 1) to the tenant's rate, then
    compressed in time by ``rate_scale``.
    """
    tr = plan.trace
    n = len(tr)
    if n == 0 or plan.factor <= 0 or duration_s <= 0:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
    period = tr.period_s
    horizon = duration_s * rate_scale
    u = np.mod(tr.arrival_s - plan.offset_s, period)  # the tenant starts reading its trace at offset_s
    order = np.argsort(u, kind="stable")
    u, inp_src, out_src = u[order], tr.input_tokens[order], tr.output_tokens[order]
    f = plan.factor
    whole = math.floor(f)
    jitter = plan.jitter_s if plan.jitter_s is not None else period / n
    parts_t, parts_i = [], []
    # tile by tile, choosing rows before materialising them: a heavily thinned tenant stays cheap
    for c in range(max(1, math.ceil(horizon / period))):
        last = int(np.searchsorted(u, horizon - c * period, side="left"))
        copies = np.full(last, whole, dtype=np.int64) + (rng.random(last) < (f - whole))
        idx = np.repeat(np.arange(last), copies) if f != 1.0 else np.arange(last)
        t = c * period + u[idx]
        if whole >= 1 and f != 1.0:
            copy_no = np.arange(idx.size) - np.repeat(np.cumsum(copies) - copies, copies)
            t = t + np.where(copy_no > 0, rng.uniform(0.0, jitter, idx.size), 0.0)
        parts_t.append(t)
        parts_i.append(idx)
    times = np.concatenate(parts_t)
    idx = np.concatenate(parts_i)
    inp, out = inp_src[idx], out_src[idx]
    times = times / rate_scale
    keep = times < duration_s
    times, inp, out = times[keep], inp[keep], out[keep]
    order = np.argsort(times, kind="stable")
    inp, out = cap_lengths(inp[order], out[order], plan.context, plan.max_input_tokens, plan.max_output_tokens)
    return times[order], inp, out


def cap_lengths(inp: np.ndarray, out: np.ndarray, context: int, max_input: int | None = None,
                max_output: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Length caps, in order: the output to [1, min(max_output, context − MIN_INPUT_TOKENS)]; then the prompt
    to [MIN_INPUT_TOKENS, min(max_input, context − output)], so prompt + output ≤ context always holds."""
    out_cap = context - MIN_INPUT_TOKENS if max_output is None else min(max_output, context - MIN_INPUT_TOKENS)
    out = np.clip(out, 1, max(1, out_cap))
    in_cap = context - out if max_input is None else np.minimum(max_input, context - out)
    inp = np.maximum(np.minimum(inp, in_cap), MIN_INPUT_TOKENS)
    return inp.astype(np.int64), out.astype(np.int64)


def superposed_arrivals(plan: TenantPlan, rate_scale: float, duration_s: float, seed: int,
                        index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rate scale as more users: ``⌈s⌉`` independent copies of the tenant's arrivals at scale 1, each read from
    the trace at its own seeded offset (the first at the tenant's own), the last copy thinned to ``s − ⌊s⌋``
    (at ``s < 1`` the one copy is thinned to ``s``). Bursts keep their length; more of them overlap."""
    whole = math.floor(rate_scale)
    frac = rate_scale - whole
    copies = whole + (1 if frac > 1e-12 else 0)
    offsets = tenant_rng(seed, index, 2).uniform(0.0, plan.trace.period_s, max(0, copies - 1))
    parts = []
    for c in range(copies):
        p = plan if c == 0 else TenantPlan(plan.tenant, plan.trace, plan.target_rate_rps, float(offsets[c - 1]),
                                           plan.context, plan.max_input_tokens, plan.max_output_tokens, plan.jitter_s)
        rng = tenant_rng(seed, index, 1) if c == 0 else np.random.default_rng([int(seed), int(index), 3, c])
        t, inp, out = tenant_arrivals(p, 1.0, duration_s, rng)
        if c == copies - 1 and frac > 1e-12:
            keep = np.random.default_rng([int(seed), int(index), 4]).random(t.size) < frac
            t, inp, out = t[keep], inp[keep], out[keep]
        parts.append((t, inp, out))
    times = np.concatenate([p[0] for p in parts])
    order = np.argsort(times, kind="stable")
    return (times[order], np.concatenate([p[1] for p in parts])[order],
            np.concatenate([p[2] for p in parts])[order])


def build_requests(plans: list[TenantPlan], rate_scale: float, duration_s: float,
                   seed: int, scale_mode: str = "superpose") -> tuple[WorkloadRequest, ...]:
    """All tenants' arrivals merged in time order (ties keep tenant order); ids are ``<tenant>-<n>``.
    ``scale_mode``: ``superpose`` adds independent copies of each tenant's arrivals (more users), ``compress``
    compresses the trace in time (sharper bursts; a stress variant)."""
    if rate_scale <= 0:
        raise ValueError("rate_scale must be positive")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {', '.join(SCALE_MODES)}, not {scale_mode!r}")
    t_all, k_all, i_all, o_all, n_all = [], [], [], [], []
    for k, plan in enumerate(plans):
        if scale_mode == "superpose" and rate_scale != 1.0:
            t, inp, out = superposed_arrivals(plan, rate_scale, duration_s, seed, k)
        else:
            t, inp, out = tenant_arrivals(plan, rate_scale, duration_s, tenant_rng(seed, k, 1))
        t_all.append(t)
        k_all.append(np.full(t.size, k, dtype=np.int64))
        i_all.append(inp)
        o_all.append(out)
        n_all.append(np.arange(t.size))
    if not plans:
        return ()
    times = np.concatenate(t_all)
    ks = np.concatenate(k_all)
    order = np.lexsort((ks, times))
    names = [p.tenant for p in plans]
    times_l = times[order].tolist()
    ks_l = ks[order].tolist()
    inp_l = np.concatenate(i_all)[order].tolist()
    out_l = np.concatenate(o_all)[order].tolist()
    num_l = np.concatenate(n_all)[order].tolist()
    ids = [f"{names[k]}-{j}" for k, j in zip(ks_l, num_l)]
    tenants = [names[k] for k in ks_l]
    return tuple(map(WorkloadRequest, ids, times_l, tenants, inp_l, out_l))
