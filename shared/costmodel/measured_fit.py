"""Fitting GPU profiles to Vidur's measured operator and send/recv timings (:mod:`shared.costmodel.measured`).

What is fitted, per GPU, jointly over every measured model (TP 1):

* efficiency rows (effective FLOP/s and bytes/s per power-of-two token bucket, as fractions of the datasheet
  peaks) and a launch overhead for the ``gemm`` class (qkv, o, gate+up, down projections; also what the
  unmeasured lm-head uses), the ``embedding`` class, the operator kinds ``rmsnorm``, ``rope``, ``silu_mul`` and
  ``residual_add`` (each its own kernel with its own efficiency), and the ``elementwise`` class (those four
  jointly: the fallback of any other elementwise operator);
* the ``nvlink`` link (latency and bandwidth) to send/recv between two GPUs of one NVSwitch node; ``cuda_ipc``
  (same host, over NVLink) takes the same bandwidth.

The solver is :func:`shared.costmodel.fitting.fit_row` (Levenberg–Marquardt on the log-ratio predicted /
measured) with a few rounds of reweighting toward the mean absolute relative error (the score the comparison
reports); every distinct operator shape weighs the same however many models share it (CodeLlama-34B and
Llama-2-70B have the same attention width). Attention rows stay as they were: the data has no attention
kernels, so attention is modelled from first principles (datasheet peaks × estimated efficiencies).
Peaks, memory and the other links stay datasheet values. The H200 has no measurements: its profile is derived
from the H100 fit with the datasheet ratios (same compute, 4.8 vs 3.35 TB/s HBM, same NVLink).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from typing import Sequence

import numpy as np

from shared.costmodel.fitting import BUCKETS, MIN_EFF, STARTS, fit_row
from shared.costmodel.measured import OPERATORS, ComputeTable, Measurements, TransferTable
from shared.costmodel.profiles import MAX_MEMORY_EFF, OP_CLASSES, DeviceProfile, LinkSpec
from shared.model.graph import ModelGraph

# profile row -> the Vidur columns it is fitted to
FIT_ROWS: dict[str, tuple[str, ...]] = {
    "gemm": ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"),
    "embedding": ("emb",),
    "rmsnorm": ("input_layernorm", "post_attention_layernorm"),
    "rope": ("attn_rope",),
    "silu_mul": ("mlp_act",),
    "residual_add": ("add",),
    "elementwise": ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add"),
}
REWEIGHT_ROUNDS = 3


def _row_data(tables: Sequence[ComputeTable], columns: Sequence[str], buckets: Sequence[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bucket index, FLOPs, bytes, measured s, shape weight) of every row of ``columns`` in ``tables``."""
    tb, fl, by, y, shape = [], [], [], [], []
    for t in tables:
        graph = ModelGraph.from_config(t.config)
        for col in columns:
            op = graph.operator(OPERATORS[col][0])
            key = (op.kind, op.in_features, op.out_features, op.num_heads, op.num_kv_heads)
            for tokens, times in t.rows:
                tb.append(bisect.bisect_left(buckets, tokens))
                fl.append(op.flops(tokens))
                by.append(op.bytes_moved(tokens))
                y.append(times[col])
                shape.append((key, t.model))
    models_per_shape = Counter(k for k, _ in set(shape))
    rows_per_model = Counter(shape)
    w = [1.0 / (models_per_shape[k] * rows_per_model[(k, m)]) for k, m in shape]
    w = np.array(w) * len(w) / sum(w)
    return np.array(tb), np.array(fl, float), np.array(by, float), np.array(y), w


def fit_efficiency_row(tables: Sequence[ComputeTable], columns: Sequence[str], peak_flops: float,
                       mem_bandwidth: float, buckets: Sequence[int] = BUCKETS, rounds: int = REWEIGHT_ROUNDS
                       ) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(compute efficiencies, memory efficiencies, launch s) of one profile row fitted to ``columns`` (compute
    efficiencies of 1 where compute never binds in the data).

    Each distinct (operator shape, model) weighs the same in total whatever its number of rows, and a shape
    shared by several models counts once; then ``rounds`` of reweighting by 1/|log error| move the
    least-squares fit toward the least absolute relative error."""
    tb, fl, by, y, w0 = _row_data(tables, columns, buckets)
    nb = len(buckets) + 1
    w, starts = w0, STARTS
    for _ in range(rounds + 1):
        fit = fit_row(tb, fl, by, y, w, n_buckets=nb, peak_flops=peak_flops,
                      mem_cap=mem_bandwidth * MAX_MEMORY_EFF, starts=starts)
        rc, rm, launch = fit.compute_rate[0], fit.memory_rate[0], float(fit.launch_s[0])
        # later rounds only move the weights: restart near the last solution (and from two defaults)
        starts = ((launch, float(np.median(rc)) / peak_flops, float(np.median(rm)) / mem_bandwidth),
                  STARTS[0], STARTS[-1])
        pred = np.maximum(np.where(fl > 0, fl / rc[tb], 0.0), by / rm[tb]) + launch
        w = w0 / np.maximum(np.abs(np.log(pred / y)), 0.01)
    # a row whose compute never binds (embedding; the memory-bound elementwise kernels) has no measured
    # compute rate: it gets the peak, which changes no prediction
    binds = np.any(np.where(fl > 0, fl / rc[tb], 0.0) > by / rm[tb])
    ce = np.clip(rc / peak_flops, MIN_EFF, 1.0) if binds else np.ones(nb)
    me = np.clip(rm / mem_bandwidth, MIN_EFF, MAX_MEMORY_EFF)
    return tuple(float(x) for x in ce), tuple(float(x) for x in me), launch


def fit_link(rows: Sequence[tuple[int, float]], rounds: int = 20) -> LinkSpec:
    """Latency and bandwidth of ``latency + bytes / bandwidth`` minimising the mean absolute relative error
    over (bytes, seconds) rows (iteratively reweighted least squares)."""
    if len(rows) < 2:
        raise ValueError("need at least two send/recv rows to fit a link")
    n = np.array([r[0] for r in rows], float)
    y = np.array([r[1] for r in rows], float)
    a = np.vstack([np.ones_like(n), n]).T / y[:, None]  # relative residuals: (lat + n/bw) / y - 1
    w = np.ones_like(y)
    coef = np.array([0.0, 1.0])
    for _ in range(rounds):
        coef, *_ = np.linalg.lstsq(a * w[:, None], w, rcond=None)
        coef = np.maximum(coef, [0.0, 1e-15])  # latency >= 0, bandwidth finite
        w = 1.0 / np.sqrt(np.maximum(np.abs(a @ coef - 1.0), 1e-3))
    return LinkSpec(bandwidth=float(1.0 / coef[1]), latency_s=float(coef[0]))


def resample_row(row: Sequence[float], old: Sequence[int], new: Sequence[int]) -> tuple[float, ...]:
    """An efficiency row over buckets ``old`` expressed over buckets ``new`` (each new bucket takes the value of
    the old bucket holding its upper bound; exact when the old bounds are among the new)."""
    reps = [*new, new[-1] + 1]
    return tuple(float(row[bisect.bisect_left(old, r)]) for r in reps)


def fit_profile(base: DeviceProfile, tables: Sequence[ComputeTable], nvlink: TransferTable | None,
                buckets: Sequence[int] = BUCKETS, source: str = "fitted") -> DeviceProfile:
    """``base`` (datasheet peaks, links, attention rows) with every :data:`FIT_ROWS` row and its launch
    overhead fitted to ``tables``, and its ``nvlink`` (and ``cuda_ipc`` bandwidth) to ``nvlink``'s rows
    within one node."""
    if not tables:
        raise ValueError("no compute measurements to fit")
    compute = {c: resample_row(base.compute_eff[c], base.buckets, buckets) for c in OP_CLASSES}
    memory = {c: resample_row(base.memory_eff[c], base.buckets, buckets) for c in OP_CLASSES}
    launch = {"attention": base.launch_s("attention")}
    for row, columns in FIT_ROWS.items():
        compute[row], memory[row], launch[row] = fit_efficiency_row(tables, columns, base.peak_flops,
                                                                    base.mem_bandwidth, buckets)
    links = dict(base.links)
    if nvlink is not None and nvlink.intra:
        links["nvlink"] = fit_link(nvlink.intra)
        if "cuda_ipc" in links:
            links["cuda_ipc"] = LinkSpec(links["nvlink"].bandwidth, links["cuda_ipc"].latency_s)
    return dataclasses.replace(base, source=source, buckets=tuple(buckets), compute_eff=compute,
                               memory_eff=memory, launch_overhead_by_class=launch, links=links, file="<memory>",
                               _eff_cache={})


def derive_profile(fitted: DeviceProfile, datasheet: DeviceProfile, source: str,
                   links_from_fit: Sequence[str] = ("nvlink", "cuda_ipc")) -> DeviceProfile:
    """A profile for a device without measurements: ``datasheet``'s peaks, memory and links (but
    ``links_from_fit`` taken from ``fitted``) with ``fitted``'s efficiencies and overheads, i.e. the measured
    device's fractions of its peaks applied to the other device's peaks."""
    links = dict(datasheet.links)
    links.update({k: fitted.links[k] for k in links_from_fit if k in fitted.links})
    return dataclasses.replace(fitted, kind=datasheet.kind, source=source, peak_flops=datasheet.peak_flops,
                               mem_bandwidth=datasheet.mem_bandwidth, memory_bytes=datasheet.memory_bytes,
                               links=links, file="<memory>", _eff_cache={})


def fit_all(data: Measurements, bases: dict[str, DeviceProfile], nvlink_topologies: dict[str, str]
            ) -> dict[str, DeviceProfile]:
    """Fitted profiles per Vidur GPU name (``h100``, ``a100``) in ``bases`` that ``data`` has timings for;
    ``nvlink_topologies`` names each GPU's send/recv file (e.g. ``h100`` -> ``h100_dgx``)."""
    by_topology = {t.topology: t for t in data.transfer}
    out = {}
    for gpu, base in bases.items():
        tables = data.compute_for(gpu)
        if tables:
            out[gpu] = fit_profile(base, tables, by_topology.get(nvlink_topologies.get(gpu, "")))
    return out


def provenance(data: Measurements, gpu: str, nvlink_topology: str | None, scores: dict[str, float], date: str,
               command: str, holdout: Sequence[str] = ()) -> dict:
    """The ``provenance`` block of a fitted profile file: source, files, what was and was not fitted, scores."""
    from shared.costmodel.measured import VIDUR_SOURCE
    files = [f"{t.path.rsplit('/', 1)[-1]} ({t.model})" for t in data.compute_for(gpu) if t.model not in holdout]
    files += [f"network__{nvlink_topology}__send_recv.csv.gz (2 ranks in one node)"] if nvlink_topology else []
    return {
        "data": VIDUR_SOURCE,
        "files": files,
        "rows": "tensor parallelism 1; the median of each row (ms); 1-4096 tokens per batch",
        "fitted": "efficiency rows and launch overheads of " + ", ".join(FIT_ROWS)
                  + f" over {len(BUCKETS) + 1} power-of-two token buckets, jointly over all the models listed"
                  + (" (held out: " + ", ".join(holdout) + ")" if holdout else "")
                  + "; links.nvlink latency and bandwidth; links.cuda_ipc bandwidth (= nvlink)",
        "not_fitted": "attention rows and overhead: modelled from first principles (datasheet peaks x estimated "
                      "efficiencies; the data has no attention kernels); peak_flops, mem_bandwidth, memory_bytes "
                      "and the other links: datasheet values",
        "mape_after_fit": {k: round(v, 4) for k, v in scores.items()},
        "date": date,
        "command": command,
    }


def fitted_profile_yaml(profile: DeviceProfile, header: str, prov: dict) -> str:
    """The profile file: :func:`~shared.costmodel.fitting.profile_yaml` plus the ``provenance`` block (which
    the loader ignores)."""
    import yaml

    from shared.costmodel.fitting import profile_yaml
    return profile_yaml(profile, header) + yaml.safe_dump({"provenance": prov}, sort_keys=False, width=116,
                                                          allow_unicode=True)
