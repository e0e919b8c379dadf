"""Fitting a device profile to measured segment times (the fitting half of ``slicesched profile``).

The cost model predicts a segment as the sum over its operators of
``max(flops / (peak·eff_c), bytes / (bandwidth·eff_m)) + launch`` with efficiencies per (operator class, size
bucket) (:mod:`shared.costmodel.model_cost`). Given measured mean times of whole segments over a grid of shapes
(:mod:`shared.costmodel.profiling`), the effective rates ``peak·eff`` of every (class, bucket) and the launch
overhead are found by Levenberg–Marquardt on the squared log-ratio of predicted to measured time (so the fit
minimises relative error, what MAPE scores), each point weighted by the precision of its mean. A weak
smoothness penalty across neighbouring buckets settles rates the data cannot separate. Rates are capped at the
measured peaks (the fastest GEMM and copy), so every efficiency is a fraction in (0, 1]. Pure numpy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from shared.costmodel.model_cost import OP_CLASS, ModelCost
from shared.costmodel.profiles import OP_CLASSES, DeviceProfile, LinkSpec
from shared.costmodel.profiling import Case, Measurement
from shared.model.config import ModelConfig
from shared.model.graph import ModelGraph

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # powers of two, as the workers bucket statistics
STARTS = tuple((launch, ce, me) for launch in (1e-6, 1e-5, 5e-5) for ce in (0.1, 0.5) for me in (0.02, 0.3))
MIN_EFF = 1e-4


def case_terms(graph: ModelGraph, case: Case) -> list[tuple[str, int, float, float]]:
    """(operator class, rows the size bucket is chosen by, FLOPs, bytes) of every cost-model operator a case
    runs, exactly as :class:`~shared.costmodel.model_cost.ModelCost` costs them."""
    t = case.tokens
    if case.kind in ("embed", "mlp", "head"):
        seg = {"embed": "embed", "mlp": "mlp[0]", "head": "head"}[case.kind]
        return [(OP_CLASS[op.kind], t, op.flops(t), op.bytes_moved(t)) for op in graph.operators_of(seg)]
    if case.kind != "attn":
        raise ValueError(f"unknown case kind {case.kind!r}")
    ops = graph.operators_of("attn[0]")
    out = [(OP_CLASS[op.kind], t, op.flops(t), op.bytes_moved(t)) for op in ops if op.kind != "attention"]
    att = next(op for op in ops if op.kind == "attention")
    if case.n_decode:
        d, kv = case.n_decode, case.decode_kv
        out.append(("attention", d, att.flops(d, kv), att.bytes_moved(d, kv, kv)))
    p, pairs, reads = case.prefill_work()
    if p:
        out.append(("attention", p, att.flops(p, pairs), att.bytes_moved(p, pairs, reads)))
    return out


def predict_s(cost: ModelCost, case: Case) -> float:
    """The cost model's time (s) for one case (what the simulator would predict for that segment)."""
    if case.kind == "embed":
        return cost.embed_time(case.tokens)
    if case.kind == "mlp":
        return cost.mlp_time(case.tokens)
    if case.kind == "head":
        return cost.head_time(case.tokens)
    t = cost.attn_dense_time(case.tokens)
    if case.n_decode:
        t += cost.decode_attention_time(case.n_decode, case.decode_kv)
    p, pairs, reads = case.prefill_work()
    if p:
        t += cost.prefill_attention_time(p, pairs, reads)
    return t


@dataclass
class FitResult:
    """Fitted effective rates and launch overheads, and how well they reproduce the measurements."""

    compute_rate: np.ndarray  # [class, bucket] FLOP/s
    memory_rate: np.ndarray  # [class, bucket] bytes/s
    launch_s: np.ndarray  # [class] (all equal for a single overhead)
    observed: np.ndarray  # [class, bucket] whether any measurement involved the cell
    log_rms: float  # weighted RMS of log(pred / measured)
    iterations: int


class _Problem:
    """Measurements flattened into operator terms for vectorised prediction and Jacobians."""

    def __init__(self, data: Sequence[tuple[ModelConfig, Measurement]], buckets: Sequence[int],
                 per_class_launch: bool) -> None:
        graphs: dict[ModelConfig, ModelGraph] = {}
        tp, tc, tb, fl, by = [], [], [], [], []
        y, w = [], []
        for i, (cfg, m) in enumerate(data):
            g = graphs.get(cfg) or graphs.setdefault(cfg, ModelGraph.from_config(cfg.with_(num_hidden_layers=1)))
            for cls, rows, f, b in case_terms(g, m.case):
                tp.append(i)
                tc.append(OP_CLASSES.index(cls))
                tb.append(int(np.searchsorted(buckets, rows, side="left")))
                fl.append(f)
                by.append(b)
            y.append(m.value_ms / 1e3)
            w.append(1.0 / (m.rel_se ** 2 + 0.02 ** 2))
        self._setup(tp, tc, tb, fl, by, y, w, len(OP_CLASSES), len(buckets) + 1, per_class_launch)

    @classmethod
    def from_terms(cls, tb: Sequence[int], flops: Sequence[float], nbytes: Sequence[float], y: Sequence[float],
                   w: Sequence[float], nb: int) -> "_Problem":
        """One row (class or kind) whose every measurement is a single operator: bucket index, FLOPs, bytes,
        measured seconds, weight."""
        pr = cls.__new__(cls)
        n = len(y)
        pr._setup(range(n), [0] * n, tb, flops, nbytes, y, w, 1, nb, True)
        return pr

    def _setup(self, tp, tc, tb, fl, by, y, w, nc: int, nb: int, per_class_launch: bool) -> None:
        self.nc, self.nb = nc, nb
        self.tp, self.tc, self.tb = np.array(tp), np.array(tc), np.array(tb)
        self.f, self.b = np.array(fl, dtype=float), np.array(by, dtype=float)
        self.y, self.w = np.array(y), np.array(w)
        self.n = len(y)
        cells = self.nc * self.nb
        self.ic = self.tc * self.nb + self.tb
        self.im = cells + self.ic
        self.il = 2 * cells + (self.tc if per_class_launch else 0)
        self.nparams = 2 * cells + (self.nc if per_class_launch else 1)
        self.per_class_launch = per_class_launch
        self.observed = np.zeros((self.nc, self.nb), dtype=bool)
        self.observed[self.tc, self.tb] = True
        # embedding operators do no arithmetic: their compute rate is irrelevant
        self.uses_compute = np.zeros((self.nc, self.nb), dtype=bool)
        self.uses_compute[self.tc[self.f > 0], self.tb[self.f > 0]] = True

    def predict(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        ct = self.f * np.exp(-theta[self.ic])
        mt = self.b * np.exp(-theta[self.im])
        launch = np.exp(theta[self.il])
        pred = np.bincount(self.tp, weights=launch + np.maximum(ct, mt), minlength=self.n)
        return pred, ct, mt, launch

    def jacobian(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pred, ct, mt, launch = self.predict(theta)
        comp = ct >= mt
        size = self.n * self.nparams
        flat = self.tp * self.nparams
        J = np.bincount(flat + np.where(comp, self.ic, self.im), weights=-np.where(comp, ct, mt), minlength=size)
        J += np.bincount(flat + self.il, weights=launch, minlength=size)
        return pred, J.reshape(self.n, self.nparams) / pred[:, None]


def _smoothness(nc: int, nb: int, nparams: int) -> np.ndarray:
    """Rows of a difference operator between neighbouring buckets of one class (compute and memory rates)."""
    rows = []
    for part in (0, nc * nb):
        for c in range(nc):
            for b in range(nb - 1):
                r = np.zeros(nparams)
                r[part + c * nb + b], r[part + c * nb + b + 1] = 1.0, -1.0
                rows.append(r)
    return np.array(rows)


def fit_rates(data: Sequence[tuple[ModelConfig, Measurement]], *, peak_flops: float, mem_bandwidth: float,
              buckets: Sequence[int] = BUCKETS, per_class_launch: bool = False, smooth: float = 1.0,
              max_iter: int = 200, starts: Sequence[tuple[float, float, float]] = STARTS) -> FitResult:
    """Fit effective (FLOP/s, bytes/s) per (class, bucket) and the launch overhead(s) to ``data``.

    The roofline's max() makes the problem non-convex: the fit runs from each of ``starts`` (launch seconds,
    compute and memory efficiency everywhere) and keeps the best."""
    from threadpoolctl import threadpool_limits

    pr = _Problem(data, buckets, per_class_launch)
    if pr.n == 0:
        raise ValueError("no measurements to fit")
    # the systems are ~100 x 100: a threaded BLAS only thrashes (40x slower on a loaded 2-core machine)
    with threadpool_limits(1):
        return _fit(pr, peak_flops, mem_bandwidth, smooth, max_iter, starts)


def fit_row(bucket_index: Sequence[int], flops: Sequence[float], nbytes: Sequence[float], measured_s: Sequence[float],
            weights: Sequence[float], *, n_buckets: int, peak_flops: float, mem_cap: float, smooth: float = 1.0,
            max_iter: int = 200, starts: Sequence[tuple[float, float, float]] = STARTS) -> FitResult:
    """Fit one efficiency row (effective FLOP/s and bytes/s per bucket, one launch overhead) to measurements of
    single operators (one term each), capped at ``peak_flops`` and ``mem_cap`` bytes/s. Same objective and
    solver as :func:`fit_rates`."""
    from threadpoolctl import threadpool_limits

    pr = _Problem.from_terms(bucket_index, flops, nbytes, measured_s, weights, n_buckets)
    if pr.n == 0:
        raise ValueError("no measurements to fit")
    with threadpool_limits(1):
        return _fit(pr, peak_flops, mem_cap, smooth, max_iter, starts)


def _fit(pr: _Problem, peak_flops: float, mem_bandwidth: float, smooth: float, max_iter: int,
         starts: Sequence[tuple[float, float, float]]) -> FitResult:
    D = _smoothness(pr.nc, pr.nb, pr.nparams) * np.sqrt(smooth)
    log_y = np.log(pr.y)
    best = None
    for launch0, ceff0, meff0 in starts:
        theta0 = np.concatenate([np.full(pr.nc * pr.nb, np.log(peak_flops * ceff0)),
                                 np.full(pr.nc * pr.nb, np.log(mem_bandwidth * meff0)),
                                 np.full(pr.nparams - 2 * pr.nc * pr.nb, np.log(launch0))])
        ridge = 1e-4

        def loss(th: np.ndarray) -> float:
            r = np.log(pr.predict(th)[0]) - log_y
            return float(np.sum(pr.w * r * r) + np.sum((D @ th) ** 2) + ridge * np.sum((th - theta0) ** 2))

        cap = np.full(pr.nparams, np.inf)
        cap[:pr.nc * pr.nb] = np.log(peak_flops)
        cap[pr.nc * pr.nb:2 * pr.nc * pr.nb] = np.log(mem_bandwidth)
        theta0 = np.minimum(theta0, cap)
        theta, cur, lam, it = theta0.copy(), loss(theta0), 1e-2, 0
        for it in range(1, max_iter + 1):
            pred, J = pr.jacobian(theta)
            r = np.log(pred) - log_y
            A = J.T @ (pr.w[:, None] * J) + D.T @ D + ridge * np.eye(pr.nparams)
            g = J.T @ (pr.w * r) + D.T @ (D @ theta) + ridge * (theta - theta0)
            improved = False
            for _ in range(12):
                step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-9), -g)
                cand = np.minimum(theta + np.clip(step, -3.0, 3.0), cap)
                new = loss(cand)
                if new < cur:
                    improved = cur - new > 1e-7 * cur
                    theta, cur, lam = cand, new, max(lam / 3, 1e-9)
                    break
                lam *= 4
            if not improved:
                break
        if best is None or cur < best[0]:
            best = (cur, theta, it)
    _, theta, it = best
    pred = pr.predict(theta)[0]
    cells = pr.nc * pr.nb
    rc = np.exp(theta[:cells]).reshape(pr.nc, pr.nb)
    rm = np.exp(theta[cells:2 * cells]).reshape(pr.nc, pr.nb)
    launch = np.exp(theta[2 * cells:])
    launch = launch if pr.per_class_launch else np.full(pr.nc, launch[0])
    _fill_unobserved(rc, pr.observed & pr.uses_compute)
    _fill_unobserved(rm, pr.observed)
    r = np.log(pred) - log_y
    return FitResult(rc, rm, launch, pr.observed, float(np.sqrt(np.sum(pr.w * r * r) / np.sum(pr.w))), it)


def _fill_unobserved(rates: np.ndarray, observed: np.ndarray) -> None:
    """Cells no measurement constrains take the nearest observed bucket's rate of the same class."""
    for c in range(rates.shape[0]):
        seen = np.flatnonzero(observed[c])
        if seen.size == 0:
            continue
        for b in range(rates.shape[1]):
            if not observed[c, b]:
                rates[c, b] = rates[c, seen[np.argmin(np.abs(seen - b))]]


def build_profile(fit: FitResult, *, kind: str, peak_flops: float, mem_bandwidth: float, memory_bytes: int,
                  links: dict[str, LinkSpec], step_overhead_s: float = 0.0, buckets: Sequence[int] = BUCKETS,
                  source: str = "measured") -> DeviceProfile:
    """A :class:`DeviceProfile` from rates fitted under the caps ``peak_flops`` and ``mem_bandwidth``.
    Embedding operators do no arithmetic; their compute efficiency is set to 1."""
    emb = OP_CLASSES.index("embedding")
    peak_c, peak_m = float(peak_flops), float(mem_bandwidth)
    ce = np.clip(fit.compute_rate / peak_c, MIN_EFF, 1.0)
    ce[emb] = 1.0
    me = np.clip(fit.memory_rate / peak_m, MIN_EFF, 1.0)
    launch = {c: float(fit.launch_s[i]) for i, c in enumerate(OP_CLASSES)}
    uniform = len(set(launch.values())) == 1
    return DeviceProfile(kind=kind, source=source, peak_flops=peak_c, mem_bandwidth=peak_m,
                         memory_bytes=int(memory_bytes), launch_overhead_s=float(np.median(fit.launch_s)),
                         links=dict(links), buckets=tuple(buckets),
                         compute_eff={c: tuple(float(x) for x in ce[i]) for i, c in enumerate(OP_CLASSES)},
                         memory_eff={c: tuple(float(x) for x in me[i]) for i, c in enumerate(OP_CLASSES)},
                         launch_overhead_by_class={} if uniform else launch, step_overhead_s=float(step_overhead_s))


def prediction_errors(profile: DeviceProfile, data: Iterable[tuple[ModelConfig, Measurement]]
                      ) -> list[tuple[ModelConfig, Measurement, float, float]]:
    """(config, measurement, predicted ms, relative error against its :attr:`~Measurement.value_ms`) for every
    measurement, predicted through :class:`ModelCost` exactly as the simulator would."""
    costs: dict[ModelConfig, ModelCost] = {}
    out = []
    for cfg, m in data:
        cost = costs.get(cfg) or costs.setdefault(cfg, ModelCost(cfg, profile))
        pred = predict_s(cost, m.case) * 1e3
        out.append((cfg, m, pred, (pred - m.value_ms) / m.value_ms))
    return out


def profile_yaml(profile: DeviceProfile, header: str = "", meta: dict | None = None) -> str:
    """The profile as a YAML file in the layout of the shipped profiles (``meta`` keys go after ``source``;
    :func:`~shared.costmodel.profiles.parse_profile` ignores them)."""
    def num(x: float) -> str:
        return f"{x:.4g}" if 1e-3 <= abs(x) < 1e4 or x == 0 else f"{x:.4e}"

    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    lines += [f"kind: {profile.kind}", f"source: {json.dumps(profile.source)}"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in (meta or {}).items()]  # JSON is YAML (flow style)
    lines += [f"peak_flops: {profile.peak_flops:.4e}", f"mem_bandwidth: {profile.mem_bandwidth:.4e}",
              f"memory_bytes: {profile.memory_bytes}", f"launch_overhead_s: {profile.launch_overhead_s:.4e}"]
    if profile.launch_overhead_by_class:
        lines.append("launch_overhead_by_class:")
        lines += [f"  {c}: {v:.4e}" for c, v in profile.launch_overhead_by_class.items()]
    lines.append(f"step_overhead_s: {profile.step_overhead_s:.4e}")
    lines.append("links:")
    lines += [f"  {k}: {{bandwidth: {v.bandwidth:.4e}, latency_s: {v.latency_s:.4e}}}"
              for k, v in profile.links.items()]
    lines += ["efficiency:", f"  buckets: [{', '.join(str(b) for b in profile.buckets)}]", "  compute:"]
    lines += [f"    {c}: [{', '.join(num(x) for x in row)}]" for c, row in profile.compute_eff.items()]
    lines.append("  memory:")
    lines += [f"    {c}: [{', '.join(num(x) for x in row)}]" for c, row in profile.memory_eff.items()]
    return "\n".join(lines) + "\n"


def write_profile(path: str | Path, profile: DeviceProfile, header: str = "", meta: dict | None = None) -> Path:
    """Write :func:`profile_yaml` to ``path`` and check that it loads back as the same profile."""
    from shared.costmodel.profiles import load_profile_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(profile_yaml(profile, header, meta))
    load_profile_file(p)  # a file this writes must always load
    return p
