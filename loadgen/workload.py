"""Declarative workload files (YAML) → :class:`shared.workload.Workload`.

A workload file names the tenants file, the traces, popularity α, seed, duration, rate scale, offsets and
length caps; :func:`load_workload` turns it into the same requests every time. The format and the semantics
are documented in ``docs/loadgen.md``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadgen.mix import SCALE_MODES, TenantPlan, auto_offset, build_requests, popularity_weights
from loadgen.servegen import servegen_traces
from loadgen.traces import FORMATS, TIME_UNITS, Trace, TraceError, expand_path, guess_format, read_trace
from shared.config import ConfigError, load_cluster, load_tenants
from shared.workload import Workload


@dataclass(frozen=True)
class TraceSpec:
    """One ``traces:`` entry; a ServeGen entry expands to one trace per selected client."""

    path: str  # as written (may hold ${SLICESCHED_TRACES})
    format: str
    columns: dict[str, str] | None = None
    time_unit: str = "s"
    lengths: str | None = None  # servegen
    model: str | None = None
    clients: int | tuple[int, ...] | None = None
    start_s: float = 0.0
    span_s: float | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed workload file (paths still relative to ``source``'s folder)."""

    source: Path
    name: str
    tenants: str
    traces: tuple[TraceSpec, ...]
    seed: int
    duration_s: float
    alpha: float | None = None  # None = "native": every tenant keeps its trace's own rate
    rate_scale: float = 1.0
    scale_mode: str = "superpose"
    cluster: str | None = None
    base_rate_rps: float | None = None
    offsets: str | dict[str, float] = "auto"
    replica_jitter_s: float | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    extra: dict = field(default_factory=dict)


def _get(d: dict, key: str, file: Path, path: str, types: type | tuple, default: Any = ...) -> Any:
    fp = f"{path}.{key}" if path else key
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(file, fp, "required field is missing")
        return default
    v = d[key]
    ts = types if isinstance(types, tuple) else (types,)
    if (isinstance(v, bool) and bool not in ts) or not isinstance(v, ts):
        raise ConfigError(file, fp, f"expected {' or '.join(t.__name__ for t in ts)}, got {v!r}")
    return v


def _positive(v: float, file: Path, fp: str) -> float:
    if not v > 0:
        raise ConfigError(file, fp, f"must be positive, got {v!r}")
    return float(v)


def _trace_spec(t: Any, file: Path, path: str) -> TraceSpec:
    if isinstance(t, str):
        t = {"path": t}
    if not isinstance(t, dict):
        raise ConfigError(file, path, "expected a mapping with path and format")
    raw = _get(t, "path", file, path, str)
    fmt = _get(t, "format", file, path, str, default="")
    if not fmt:
        fmt = guess_format(expand_path(raw, file.parent))
    if fmt not in FORMATS:
        raise ConfigError(file, f"{path}.format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    unit = _get(t, "time_unit", file, path, str, default="s")
    if unit not in TIME_UNITS:
        raise ConfigError(file, f"{path}.time_unit", f"must be one of {', '.join(TIME_UNITS)}, got {unit!r}")
    columns = _get(t, "columns", file, path, dict, default=None)
    if fmt == "csv":
        if not columns or any(k not in columns or not isinstance(columns[k], str) for k in ("time", "input", "output")):
            raise ConfigError(file, f"{path}.columns", "format csv needs columns: {time: C, input: C, output: C}")
    spec = TraceSpec(path=raw, format=fmt, columns=dict(columns) if columns else None, time_unit=unit)
    if fmt != "servegen":
        return spec
    clients = _get(t, "clients", file, path, (int, list), default=16)
    if isinstance(clients, list):
        if not clients or not all(isinstance(c, int) and not isinstance(c, bool) for c in clients):
            raise ConfigError(file, f"{path}.clients", "expected a number of top clients or a list of client ids")
        clients = tuple(clients)
    elif clients <= 0:
        raise ConfigError(file, f"{path}.clients", "must be positive")
    span = _get(t, "span_s", file, path, (int, float), default=None)
    return TraceSpec(path=raw, format=fmt, lengths=_get(t, "lengths", file, path, str, default=None),
                     model=_get(t, "model", file, path, str, default="m-large"), clients=clients,
                     start_s=float(_get(t, "start_s", file, path, (int, float), default=0.0)),
                     span_s=None if span is None else _positive(span, file, f"{path}.span_s"))


def _scale_mode(v: str, file: Path) -> str:
    if v not in SCALE_MODES:
        raise ConfigError(file, "scale_mode", f"must be one of {', '.join(SCALE_MODES)}, got {v!r}")
    return v


def parse_workload(data: Any, file: str | Path) -> WorkloadSpec:
    """Validate a workload file's contents; every problem names the file and field."""
    file = Path(file)
    if not isinstance(data, dict):
        raise ConfigError(file, "(top level)", "expected a mapping with tenants, traces, seed, duration_s")
    traces_raw = _get(data, "traces", file, "", list)
    if not traces_raw:
        raise ConfigError(file, "traces", "at least one trace is required")
    traces = tuple(_trace_spec(t, file, f"traces[{i}]") for i, t in enumerate(traces_raw))
    alpha = data.get("alpha", "native")
    if alpha is None or alpha == "native":
        alpha = None
    elif isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise ConfigError(file, "alpha", f"expected a non-negative number or 'native', got {alpha!r}")
    offsets = data.get("offsets", "auto")
    if isinstance(offsets, dict):
        for k, v in offsets.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(file, f"offsets.{k}", f"expected seconds ≥ 0, got {v!r}")
        offsets = {str(k): float(v) for k, v in offsets.items()}
    elif offsets not in ("auto", "none"):
        raise ConfigError(file, "offsets", f"expected auto, none or a mapping tenant → seconds, got {offsets!r}")
    caps = _get(data, "caps", file, "", dict, default={})
    for k in caps:
        if k not in ("max_input_tokens", "max_output_tokens"):
            raise ConfigError(file, f"caps.{k}", "unknown cap (valid: max_input_tokens, max_output_tokens)")
    max_in = _get(caps, "max_input_tokens", file, "caps", int, default=None)
    max_out = _get(caps, "max_output_tokens", file, "caps", int, default=None)
    for k, v in (("max_input_tokens", max_in), ("max_output_tokens", max_out)):
        if v is not None and v < (2 if k == "max_input_tokens" else 1):
            raise ConfigError(file, f"caps.{k}", f"too small: {v}")
    base = _get(data, "base_rate_rps", file, "", (int, float), default=None)
    jitter = _get(data, "replica_jitter_s", file, "", (int, float), default=None)
    if jitter is not None and jitter < 0:
        raise ConfigError(file, "replica_jitter_s", "must be ≥ 0")
    known = {"name", "tenants", "cluster", "traces", "alpha", "seed", "duration_s", "rate_scale", "scale_mode",
             "base_rate_rps", "offsets", "replica_jitter_s", "caps", "description"}
    for k in data:
        if k not in known:
            raise ConfigError(file, str(k), f"unknown field (valid: {', '.join(sorted(known))})")
    return WorkloadSpec(
        source=file, name=str(_get(data, "name", file, "", str, default=file.stem.removesuffix(".workload"))),
        tenants=_get(data, "tenants", file, "", str), traces=traces, seed=_get(data, "seed", file, "", int),
        duration_s=_positive(_get(data, "duration_s", file, "", (int, float)), file, "duration_s"),
        alpha=None if alpha is None else float(alpha),
        rate_scale=_positive(_get(data, "rate_scale", file, "", (int, float), default=1.0), file, "rate_scale"),
        scale_mode=_scale_mode(_get(data, "scale_mode", file, "", str, default="superpose"), file),
        cluster=_get(data, "cluster", file, "", str, default=None),
        base_rate_rps=None if base is None else _positive(base, file, "base_rate_rps"),
        offsets=offsets, replica_jitter_s=None if jitter is None else float(jitter),
        max_input_tokens=max_in, max_output_tokens=max_out,
        extra={"description": data["description"]} if "description" in data else {})


def read_workload_spec(path: str | Path) -> WorkloadSpec:
    """Read and validate a workload file (does not read traces)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(p, "(file)", "file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        raise ConfigError(p, where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
    return parse_workload(data, p)


@functools.lru_cache(maxsize=32)
def _cached_traces(key: tuple, resolved: str, lengths: str | None, mtime: float) -> tuple[Trace, ...]:
    fmt, columns, unit, model, clients, start_s, span_s, seed = key
    if fmt == "servegen":
        top = clients if isinstance(clients, int) else None
        ids = list(clients) if isinstance(clients, tuple) else None
        out = servegen_traces(resolved, lengths, model, start_s, span_s, seed, top=top, ids=ids)
    else:
        out = [read_trace(resolved, fmt, dict(columns) if columns else None, unit)]
    for t in out:
        for a in (t.arrival_s, t.input_tokens, t.output_tokens):
            a.setflags(write=False)
    return tuple(out)


def resolve_traces(spec: WorkloadSpec) -> list[Trace]:
    """Read every trace of the workload (kept in memory per process, keyed by file and modification time)."""
    out: list[Trace] = []
    base = spec.source.parent
    for i, ts in enumerate(spec.traces):
        p = expand_path(ts.path, base)
        if not p.is_file():
            raise ConfigError(spec.source, f"traces[{i}].path", f"file not found: {p}")
        lengths = None
        if ts.format == "servegen":
            lp = expand_path(ts.lengths, base) if ts.lengths else p.with_name("servegen_client_lengths_6h.csv.gz")
            if not lp.is_file():
                raise ConfigError(spec.source, f"traces[{i}].lengths", f"file not found: {lp}")
            lengths = str(lp)
        key = (ts.format, tuple(sorted(ts.columns.items())) if ts.columns else None, ts.time_unit, ts.model,
               ts.clients, ts.start_s, ts.span_s if ts.span_s else spec.duration_s, spec.seed)
        try:
            out.extend(_cached_traces(key, str(p), lengths, p.stat().st_mtime))
        except TraceError as e:
            if e.file in (str(p), lengths):
                raise  # a problem inside a trace file: its own file, line and column
            raise ConfigError(spec.source, f"traces[{i}].{e.field_path}", e.problem) from None
    for t in out:
        if len(t) == 0:
            raise ConfigError(spec.source, "traces", f"trace {t.name} has no requests")
    return out


def plan_tenants(spec: WorkloadSpec, names: list[str], contexts: list[int], traces: list[Trace]) -> list[TenantPlan]:
    """Tenant k takes trace k mod T; its rate is its popularity share of the total base rate (or native)."""
    natives = np.array([t.rate_rps for t in traces])
    total = float(natives.sum())
    base = spec.base_rate_rps if spec.base_rate_rps is not None else total
    weights = popularity_weights(len(names), spec.alpha) if spec.alpha is not None else None
    if isinstance(spec.offsets, dict):
        for k in spec.offsets:
            if k not in names:
                raise ConfigError(spec.source, f"offsets.{k}", f"unknown tenant (tenants: {', '.join(names)})")
    plans = []
    for k, (name, ctx) in enumerate(zip(names, contexts)):
        tr = traces[k % len(traces)]
        target = float(weights[k] * base) if weights is not None else tr.rate_rps * base / total
        if isinstance(spec.offsets, dict) and name in spec.offsets:
            offset = spec.offsets[name] % tr.period_s
        elif spec.offsets == "none":
            offset = 0.0
        else:
            offset = auto_offset(spec.seed, k, tr.period_s)
        plans.append(TenantPlan(tenant=name, trace=tr, target_rate_rps=target, offset_s=offset, context=ctx,
                                max_input_tokens=spec.max_input_tokens, max_output_tokens=spec.max_output_tokens,
                                jitter_s=spec.replica_jitter_s))
    return plans


def load_workload(path: str | Path, rate_scale: float | None = None) -> Workload:
    """Build the workload a file describes; deterministic for a file and seed (ids are ``<tenant>-<n>``)."""
    spec = read_workload_spec(path)
    return workload_from_spec(spec, rate_scale)


def workload_from_spec(spec: WorkloadSpec, rate_scale: float | None = None) -> Workload:
    """As :func:`load_workload`, from an already parsed spec."""
    scale = spec.rate_scale if rate_scale is None else float(rate_scale)
    if not scale > 0:
        raise ConfigError(spec.source, "rate_scale", f"must be positive, got {scale!r}")
    base = spec.source.parent
    cluster = load_cluster(expand_path(spec.cluster, base)) if spec.cluster else None
    tenants = load_tenants(expand_path(spec.tenants, base), cluster)
    names = tenants.names()
    contexts = [t.model.config.max_position_embeddings for t in tenants.tenants]
    traces = resolve_traces(spec)
    plans = plan_tenants(spec, names, contexts, traces)
    requests = build_requests(plans, scale, spec.duration_s, spec.seed, spec.scale_mode)
    meta = {
        "alpha": "native" if spec.alpha is None else spec.alpha, "scale_mode": spec.scale_mode,
        "traces": [{"name": t.name, "rate_rps": t.rate_rps, "period_s": t.period_s, "rows": len(t)} for t in traces],
        "tenants": {p.tenant: {"trace": p.trace.name, "target_rate_rps": p.target_rate_rps * scale,
                               "offset_s": p.offset_s, "factor": p.factor, "context": p.context} for p in plans},
        **spec.extra,
    }
    return Workload(name=spec.name, requests=requests, tenants=tenants, duration_s=spec.duration_s, seed=spec.seed,
                    rate_scale=scale, source=str(spec.source), cluster=cluster, meta=meta)
