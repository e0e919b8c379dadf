"""``pooled-bound``: an analytic ceiling on what any policy can sustain on a cluster, sound under the cost model.

Two facts bound every schedule the simulator can produce, whatever the policy:

1. **Work.** Under the roofline cost model an operator over a batch takes at least its FLOPs over the device's best
   compute rate and at least its bytes over the best memory rate. FLOPs of the dense operators (GEMMs, prefill
   attention) and bytes of the per-token ones (decode attention's KV reads, norms, activations, residual adds)
   add up request by request, so every request costs at least ``min_work(r)`` device-seconds however it is
   batched, wherever it runs (weights shared with a batch, launch and step overheads, transfers and switches
   are counted as free).
2. **Deadlines.** A request that meets its SLA has finished by ``d_r = arrival + TTFT target + (output − 1) × TPOT
   target``. So in any window [a, b) the requests that arrive and are due inside it and meet their SLA got their
   work done inside it, on N devices: at most N·(b − a) device-seconds. Those that do not fit are violations; the
   fewest violations are had by keeping the cheapest requests.

Summing over disjoint windows (tilings of time by one window length, several lengths and offsets tried, the best
taken) gives a lower bound on the violations of every policy at every scale: a fluid, fully pooled cluster with
free migration, perfect batching and no memory limits. Its sustainable scale is where that bound reaches the
violation limit (in aggregate: a per-tenant split of the bound would not be sound, so the ceiling is only held to
the aggregate, which can only raise it), and its throughput there is every offered token. It is a real bound, not a
policy: nothing is simulated. How far above what is reachable it sits is reported beside it (docs/results.md).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from shared.config import ClusterConfig
from shared.costmodel import cost_for
from shared.costmodel.model_cost import OP_CLASS
from shared.costmodel.sla import RequestTargets
from shared.model.config import ModelConfig
from shared.workload import Workload

WINDOWS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 600.0, 1800.0, 3600.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


def _best(profile, op) -> tuple[float, float]:
    """(best FLOP/s, best bytes/s) the profile ever gives this operator, over every size bucket."""
    rates = [profile.rates(OP_CLASS[op.kind], n, op.kind) for n in _SIZES]
    return max(r[0] for r in rates), max(r[1] for r in rates)


class MinWork:
    """``min_work(input, output)``: device-seconds a request costs at least on one device kind (module docstring)."""

    def __init__(self, model: ModelConfig, kind: str) -> None:
        cost = cost_for(model, kind)
        prof, g, layers = cost.profile, cost.graph, model.num_hidden_layers
        per_token = 0.0  # every processed token: dense FLOPs and per-token bytes of one pass through the layers
        per_pair = per_read = 0.0
        for seg in ("attn[0]", "mlp[0]"):
            for op in g.operators_of(seg):
                rc, rm = _best(prof, op)
                if op.kind == "attention":
                    per_pair = layers * (op.flops(1, 1) - op.flops(1, 0)) / rc
                    per_read = layers * (op.bytes_moved(1, 1, 1) - op.bytes_moved(1, 0, 0)) / rm
                elif OP_CLASS[op.kind] == "gemm":
                    per_token += layers * op.flops(1) / rc
                else:  # norms, rotary, activation, residual add: bytes per token (weights shared)
                    per_token += layers * (op.bytes_moved(1) - op.weight_bytes) / rm
        per_sampled = 0.0
        for op in g.operators_of("head"):
            rc, rm = _best(prof, op)
            per_sampled += op.flops(1) / rc if OP_CLASS[op.kind] == "gemm" else (op.bytes_moved(1) - op.weight_bytes) / rm
        self.per_token, self.per_pair, self.per_read, self.per_sampled = per_token, per_pair, per_read, per_sampled

    def __call__(self, inp: np.ndarray, out: np.ndarray) -> np.ndarray:
        inp, out = np.asarray(inp, dtype=np.float64), np.asarray(out, dtype=np.float64)
        dec = np.maximum(out - 1.0, 0.0)  # decode steps: the first token comes with the prefill
        pairs = inp * (inp + 1.0) / 2.0  # causal prefill attention, however it is chunked
        reads = dec * inp + dec * (dec + 1.0) / 2.0  # step i attends to input + i positions
        return (inp + dec) * self.per_token + pairs * self.per_pair + reads * self.per_read + out * self.per_sampled


def request_arrays(workload: Workload, cluster: ClusterConfig,
                   chunk: int = 2048) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, deadline, min work, tenant index) per request of ``workload``; the work is priced on the kind of
    each tenant's first home device (the cluster's first device's if the home is not in ``cluster``)."""
    ids = {d.id: d.kind for d in cluster.devices}
    tenants = workload.tenants.tenants
    index = {t.name: i for i, t in enumerate(tenants)}
    n = len(workload.requests)
    arr, inp, out, ten = np.empty(n), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    for i, r in enumerate(workload.requests):
        arr[i], inp[i], out[i], ten[i] = r.arrival_s, max(1, r.input_tokens), max(1, r.output_tokens), index[r.tenant]
    dead, work = np.empty(n), np.empty(n)
    for k, t in enumerate(tenants):
        m = ten == k
        if not m.any():
            continue
        kind = ids.get(t.home_devices[0], cluster.devices[0].kind) if t.home_devices else cluster.devices[0].kind
        targets = RequestTargets(t.sla, t.model.config, chunk)
        tt = np.array([targets(int(a), int(b)) for a, b in zip(inp[m], out[m])])
        dead[m] = arr[m] + tt[:, 0] + (out[m] - 1) * tt[:, 1]
        work[m] = MinWork(t.model.config, kind)(inp[m], out[m])
    return arr, dead, work, ten


def violations_lower_bound(arrival: np.ndarray, deadline: np.ndarray, work: np.ndarray, devices: int,
                           windows: Iterable[float] = WINDOWS_S) -> int:
    """Fewest requests that must miss their SLA on ``devices`` devices (module docstring): the best over tilings
    of time by each window length (offsets 0 and half a window) of the per-window excess, cheapest kept first."""
    best = 0
    for length in windows:
        for off in (0.0, length / 2):
            a = np.floor((arrival - off) / length)
            d = np.floor((deadline - off) / length)
            inside = a == d  # arrives and is due in the same window
            if not inside.any():
                continue
            w_id, w = a[inside], work[inside]
            order = np.lexsort((w, w_id))  # by window, cheapest first
            w_id, w = w_id[order], w[order]
            starts = np.flatnonzero(np.r_[True, w_id[1:] != w_id[:-1]])
            csum = np.cumsum(w)
            base = np.repeat(np.r_[0.0, csum[starts[1:] - 1]], np.diff(np.r_[starts, w.size]))
            fits = (csum - base) <= devices * length * (1 + 1e-12)
            best = max(best, int(w.size - fits.sum()))
    return best


def ceiling_point(cluster: ClusterConfig, workload: Workload) -> dict:
    """The bound at one scale, shaped like a simulator result: the violation rate is the lower bound, throughput
    every offered token (over the workload's window)."""
    arr, dead, work, _ = request_arrays(workload, cluster)
    n = len(arr)
    lb = violations_lower_bound(arr, dead, work, len(cluster.devices)) if n else 0
    window = workload.duration_s or (float(arr.max()) if n else 1.0)
    tokens = sum(r.output_tokens for r in workload.requests)
    return {"tokens_per_s": tokens / window, "violation_rate": lb / n if n else 0.0, "violations_lower_bound": lb,
            "requests": n, "device_seconds_lower_bound": float(work.sum()),
            "utilisation_lower_bound": float(work.sum()) / (len(cluster.devices) * window), "window_s": window,
            "fidelity": "analytic bound"}
