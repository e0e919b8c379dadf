"""ServeGen per-client workload parameters → per-client arrival traces.

ServeGen (Alibaba Bailian, arXiv 2505.09999) publishes, per model and per client, one row per 600 s window with
the mean rate, the CV of inter-arrival times and a Gamma or Weibull fit (``iat_param1`` = shape, ``iat_param2`` =
scale; checked against the published CV: Gamma CV = 1/sqrt(shape)), and per 6 h window the p50/p90/p99 of token
counts. Generation, per client and window:

* count = ``rate_rps × 600`` rounded stochastically (a missing window has no requests);
* inter-arrival gaps: ``count + 1`` draws from the fitted family with the fitted *shape*; the gaps are rescaled
  so the arrivals fill the window exactly, so the window keeps its published rate and the gaps keep the
  fitted burstiness (the fitted scale is implied by the count and is not used);
* lengths: a log-normal through the window's p50 and p90 (σ = ln(p90/p50)/1.2816), capped at the p99. Clients
  whose length rows are absent (the largest ones, see the traces README) use the median of the model's other
  clients in the same 6 h window.
"""
from __future__ import annotations

import functools
import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.traces import Trace, TraceError

RATE_WINDOW_S = 600.0
LENGTH_WINDOW_S = 21600.0
TRACE_END_S = 14 * 86400.0
Z90 = 1.2815515655446004
RATE_COLUMNS = ("category", "model", "client_id", "window_start_s", "rate_rps", "iat_cv", "iat_dist",
                "iat_param1", "iat_param2")
INPUT_PARTS = ("text_tokens", "image_tokens", "audio_tokens", "video_tokens")


@dataclass(frozen=True, eq=False)
class RateTable:
    """The rate rows of one model, columnar, sorted by (client, window)."""

    model: str
    client: np.ndarray  # int64
    window_s: np.ndarray  # float64
    rate: np.ndarray
    weibull: np.ndarray  # bool; False = Gamma
    shape: np.ndarray

    def clients(self) -> list[int]:
        return sorted(set(self.client.tolist()))


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise TraceError(path, "(file)", "file not found")
    try:
        return gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
        raise TraceError(path, "(file)", f"cannot read gzip CSV: {e}") from None


def read_rates(path: str | Path, model: str) -> RateTable:
    """Rows of ``model`` from ``servegen_client_rates_600s.csv.gz`` (one regex pass over the text: ~0.5 s)."""
    path = Path(path)
    text = _read_text(path)
    header = text[:text.find("\n")].strip().split(",")
    if tuple(header) != RATE_COLUMNS:
        raise TraceError(path, "line 1", f"expected header {','.join(RATE_COLUMNS)}")
    rows = re.findall(rf"^[^,\n]*,{re.escape(model)},([^\n]*?)\r?$", text, re.M)
    if not rows:
        models = sorted(set(re.findall(r"^[^,\n]*,([^,\n]*),", text[:2_000_000], re.M)) - {"model"})
        raise TraceError(path, "model", f"no rows for model {model!r}; models include {', '.join(models)}")
    width = len(RATE_COLUMNS) - 2
    flat = ",".join(rows).split(",")
    try:
        if len(flat) != width * len(rows):
            raise ValueError
        client = np.array(flat[0::width], dtype=np.int64)
        window = np.array(flat[1::width], dtype=np.float64)
        rate = np.array(flat[2::width], dtype=np.float64)
        dist = np.array(flat[4::width])
        shape = np.array(flat[5::width], dtype=np.float64)
    except ValueError:
        _locate_bad(path, text, model)
        raise TraceError(path, "(rows)", "malformed rows") from None
    weibull = dist == "Weibull"
    bad = ~(weibull | (dist == "Gamma"))
    if bad.any():
        _raise_at(path, text, model, int(np.argmax(bad)), "iat_dist",
                  f"expected Gamma or Weibull, got {dist[bad][0]!r}")
    for name, v in (("rate_rps", rate), ("iat_param1", shape)):
        bad = ~(np.isfinite(v) & (v >= 0))
        if bad.any():
            k = int(np.argmax(bad))
            _raise_at(path, text, model, k, name, f"expected a finite non-negative number, got {v[k]}")
    order = np.lexsort((window, client))
    return RateTable(model=model, client=client[order], window_s=window[order], rate=rate[order],
                     weibull=weibull[order], shape=shape[order])


def _model_line_numbers(text: str, model: str) -> list[int]:
    key = f",{model},"
    return [n for n, ln in enumerate(text.splitlines(), start=1) if n > 1 and ln[ln.find(","):].startswith(key)]


def _raise_at(path: Path, text: str, model: str, k: int, column: str, problem: str) -> None:
    raise TraceError(path, f"line {_model_line_numbers(text, model)[k]}, column {column}", problem)


def _locate_bad(path: Path, text: str, model: str) -> None:
    """Slow path, only on error: find the first malformed row of ``model`` and name its line and column."""
    lines = text.splitlines()
    for lineno in _model_line_numbers(text, model):
        parts = lines[lineno - 1].split(",")
        if len(parts) != len(RATE_COLUMNS):
            raise TraceError(path, f"line {lineno}", f"expected {len(RATE_COLUMNS)} columns, got {len(parts)}")
        for j, conv in ((2, int), (3, float), (4, float), (7, float)):
            try:
                conv(parts[j])
            except ValueError:
                raise TraceError(path, f"line {lineno}, column {RATE_COLUMNS[j]}",
                                 f"expected a number, got {parts[j]!r}") from None


def mean_rates(table: RateTable, start_s: float, span_s: float) -> dict[int, float]:
    """Mean rate of every client over [start_s, start_s + span_s) (windows weighted by their overlap)."""
    lo = np.maximum(table.window_s, start_s)
    hi = np.minimum(table.window_s + RATE_WINDOW_S, start_s + span_s)
    overlap = np.clip(hi - lo, 0.0, None)
    req = table.rate * overlap
    out: dict[int, float] = {}
    for c, r in zip(table.client.tolist(), req.tolist()):
        out[c] = out.get(c, 0.0) + r
    return {c: v / span_s for c, v in out.items()}


def select_clients(table: RateTable, start_s: float, span_s: float, top: int | None = None,
                   ids: list[int] | None = None, where: str = "clients") -> list[int]:
    """Explicit ``ids`` (kept in order) or the ``top`` clients by mean rate in the span, busiest first."""
    rates = mean_rates(table, start_s, span_s)
    src = f"servegen {table.model}"
    if ids is not None:
        for c in ids:
            if rates.get(c, 0.0) <= 0:
                raise TraceError(src, where, f"client {c} has no requests in [{start_s}, {start_s + span_s}) s")
        return list(ids)
    active = sorted((c for c, r in rates.items() if r > 0), key=lambda c: (-rates[c], c))
    if top is None or top <= 0:
        raise TraceError(src, where, "give a positive number of top clients or a list of client ids")
    if len(active) < top:
        raise TraceError(src, where, f"only {len(active)} clients have requests in the span, asked for {top}")
    return active[:top]


def _rng(seed: int, model: str, client: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(model.encode()), client, stream])


def client_arrivals(table: RateTable, client: int, start_s: float, span_s: float, seed: int) -> np.ndarray:
    """Arrival times (s from ``start_s``) of one client in the span, per the rules in the module docstring."""
    m = table.client == client
    win, rate, wb, shape = table.window_s[m], table.rate[m], table.weibull[m], table.shape[m]
    keep = (win + RATE_WINDOW_S > start_s) & (win < start_s + span_s)
    win, rate, wb, shape = win[keep], rate[keep], wb[keep], shape[keep]
    rng = _rng(seed, table.model, client, 0)
    expected = rate * RATE_WINDOW_S
    counts = np.floor(expected).astype(np.int64)
    counts += rng.random(counts.size) < (expected - counts)
    if counts.sum() == 0:
        return np.zeros(0)
    draws = counts + 1
    shapes = np.maximum(np.repeat(shape, draws), 1e-3)
    is_wb = np.repeat(wb, draws)
    gaps = np.empty(shapes.size)
    gaps[~is_wb] = rng.gamma(shapes[~is_wb])
    gaps[is_wb] = rng.weibull(shapes[is_wb])
    gaps = np.maximum(gaps, 0.0) + 1e-300  # a window of all-zero gaps still spreads over the window
    seg = np.repeat(np.arange(draws.size), draws)
    csum = np.cumsum(gaps)
    seg_start = np.concatenate(([0.0], csum[np.cumsum(draws)[:-1] - 1]))
    local = csum - seg_start[seg]
    totals = local[np.cumsum(draws) - 1]
    frac = local / totals[seg]
    last = np.zeros(gaps.size, dtype=bool)
    last[np.cumsum(draws) - 1] = True
    t = win[seg] + RATE_WINDOW_S * frac - start_s
    t = t[~last]
    t = t[(t >= 0) & (t < span_s)]
    return np.sort(t)


@dataclass(frozen=True, eq=False)
class LengthStats:
    """p50/p90/p99 per 6 h window and field for one model; ``pool`` holds the per-window medians over clients."""

    model: str
    per_client: dict[int, dict[str, np.ndarray]]  # client -> {"window": ..., "<field>_p50": ...}
    pool: dict[str, np.ndarray]
    fields: tuple[str, ...]


def read_lengths(path: str | Path, model: str) -> LengthStats:
    """Rows of ``model`` from ``servegen_client_lengths_6h.csv.gz``."""
    path = Path(path)
    lines = _read_text(path).splitlines()
    header = lines[0].split(",") if lines else []
    for need in ("model", "client_id", "window_start_s", "output_tokens_p50"):
        if need not in header:
            raise TraceError(path, f"line 1, column {need}", "missing column")
    oi = header.index("output_tokens_p50")
    rows = [(n, parts) for n, ln in enumerate(lines[1:], start=2)
            if ln.split(",", 2)[1:2] == [model] and (parts := ln.split(","))[oi]]  # empty stats = no data that window
    if not rows:
        raise TraceError(path, "model", f"no length rows for model {model!r}")
    inputs = ("input_tokens",) if rows[0][1][header.index("input_tokens_p50")] else INPUT_PARTS
    fields = inputs + ("output_tokens",)
    cols = [(f"{f}_{q}", header.index(f"{f}_{q}")) for f in fields for q in ("p50", "p90", "p99")]
    ci, wi = header.index("client_id"), header.index("window_start_s")
    per_client: dict[int, dict[str, list]] = {}
    for lineno, parts in rows:
        try:
            d = per_client.setdefault(int(parts[ci]), {"window": []})
            d["window"].append(float(parts[wi]))
            for col, j in cols:
                d.setdefault(col, []).append(float(parts[j]) if parts[j] else 0.0)
        except ValueError:
            raise TraceError(path, f"line {lineno}",
                             "expected numbers in client_id, window_start_s and the stats") from None
    out = {c: {k: np.array(v) for k, v in d.items()} for c, d in per_client.items()}
    windows = np.unique(np.concatenate([d["window"] for d in out.values()]))
    pool: dict[str, np.ndarray] = {"window": windows}
    for key in next(iter(out.values())):
        if key == "window":
            continue
        vals = []
        for w in windows:
            xs = [d[key][d["window"] == w] for d in out.values()]
            xs = np.concatenate(xs)
            vals.append(float(np.median(xs)) if xs.size else 0.0)
        pool[key] = np.array(vals)
    return LengthStats(model=model, per_client=out, pool=pool, fields=fields)


def _lognormal(rng: np.random.Generator, p50: np.ndarray, p90: np.ndarray, p99: np.ndarray) -> np.ndarray:
    p50 = np.maximum(p50, 1.0)
    p90 = np.maximum(p90, p50)
    sigma = np.maximum(np.log(p90 / p50) / Z90, 0.01)
    x = np.exp(np.log(p50) + sigma * rng.standard_normal(p50.size))
    return np.clip(np.rint(np.minimum(x, np.maximum(p99, p50))), 1, None)


def sample_lengths(stats: LengthStats, client: int, abs_times_s: np.ndarray,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Input and output token counts for arrivals at absolute trace times (s from the ServeGen start)."""
    src = stats.per_client.get(client, stats.pool)
    win = src["window"]
    want = np.floor(abs_times_s / LENGTH_WINDOW_S) * LENGTH_WINDOW_S
    idx = np.clip(np.searchsorted(win, want), 0, win.size - 1)
    prev = np.clip(idx - 1, 0, win.size - 1)
    idx = np.where(np.abs(win[prev] - want) < np.abs(win[idx] - want), prev, idx)  # nearest window if absent
    rng = _rng(seed, stats.model, client, 1)
    total_in = np.zeros(abs_times_s.size)
    for f in stats.fields[:-1]:
        p50 = src[f"{f}_p50"][idx]
        if not np.any(p50 > 0):
            continue
        part = _lognormal(rng, p50, src[f"{f}_p90"][idx], src[f"{f}_p99"][idx])
        total_in += np.where(p50 > 0, part, 0.0)
    out = _lognormal(rng, src["output_tokens_p50"][idx], src["output_tokens_p90"][idx], src["output_tokens_p99"][idx])
    return np.maximum(total_in, 1).astype(np.int64), out.astype(np.int64)


def _mtime(path: str | Path) -> float:
    p = Path(path)
    return p.stat().st_mtime if p.is_file() else 0.0


@functools.lru_cache(maxsize=8)
def _tables(rates_path: str, lengths_path: str, model: str, _m1: float, _m2: float) -> tuple[RateTable, LengthStats]:
    """Parsed tables, kept per process (keyed by file modification times) so rate sweeps read the files once."""
    return read_rates(rates_path, model), read_lengths(lengths_path, model)


def servegen_traces(rates_path: str | Path, lengths_path: str | Path, model: str, start_s: float, span_s: float,
                    seed: int, top: int | None = None, ids: list[int] | None = None) -> list[Trace]:
    """One :class:`Trace` per selected client (busiest first for ``top``), covering [start_s, start_s + span_s)."""
    if not (0 <= start_s < TRACE_END_S) or span_s <= 0:
        raise TraceError(f"servegen {model}", "start_s",
                         f"the span must start inside the 14-day trace (0 … {TRACE_END_S:.0f} s) and be positive")
    table, stats = _tables(str(rates_path), str(lengths_path), model, _mtime(rates_path), _mtime(lengths_path))
    traces = []
    for c in select_clients(table, start_s, span_s, top=top, ids=ids):
        t = client_arrivals(table, c, start_s, span_s, seed)
        inp, out = sample_lengths(stats, c, t + start_s, seed)
        traces.append(Trace(name=f"servegen:{model}:{c}", source=str(rates_path), arrival_s=t, input_tokens=inp,
                            output_tokens=out, period_s=float(span_s)))
    return traces
