"""Writing workload files from command-line choices (``loadgen workload build``)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadgen.traces import default_traces_dir, guess_format
from shared.config import ConfigError


@dataclass(frozen=True)
class TraceChoice:
    """A ``--trace`` with its format and options as given on the command line."""

    path: str
    format: str | None = None
    columns: dict[str, str] | None = None
    time_unit: str = "s"
    servegen_model: str = "m-large"
    servegen_clients: int = 16
    servegen_start_s: float = 0.0
    servegen_span_s: float | None = None


def portable_path(path: str | Path, out_dir: Path, env: dict[str, str] | None = None) -> str:
    """``${SLICESCHED_TRACES}/…`` for files in the traces folder, else a path relative to the workload file."""
    e = os.environ if env is None else env
    p = Path(path).resolve()
    traces = Path(e.get("SLICESCHED_TRACES") or default_traces_dir()).resolve()
    try:
        return "${SLICESCHED_TRACES}/" + p.relative_to(traces).as_posix()
    except ValueError:
        return os.path.relpath(p, out_dir.resolve())


def workload_document(out: Path, traces: list[TraceChoice], tenants: str | Path, alpha: float | None, seed: int,
                      duration_s: float, rate_scale: float = 1.0, cluster: str | Path | None = None,
                      base_rate_rps: float | None = None, max_input_tokens: int | None = None,
                      max_output_tokens: int | None = None, name: str | None = None) -> dict[str, Any]:
    """The YAML document for a workload file at ``out`` (paths made relative to it)."""
    if not traces:
        raise ConfigError("--trace", "(arguments)", "give at least one --trace")
    out_dir = out.parent
    entries = []
    for t in traces:
        if not Path(t.path).is_file():
            raise ConfigError(t.path, "(file)", "file not found")
        fmt = t.format or guess_format(t.path)
        e: dict[str, Any] = {"path": portable_path(t.path, out_dir), "format": fmt}
        if fmt == "csv":
            if not t.columns:
                raise ConfigError(t.path, "--columns", "format csv needs --columns time=C,input=C,output=C")
            e["columns"] = dict(t.columns)
            e["time_unit"] = t.time_unit
        if fmt == "servegen":
            e.update(model=t.servegen_model, clients=t.servegen_clients, start_s=t.servegen_start_s)
            if t.servegen_span_s:
                e["span_s"] = t.servegen_span_s
        entries.append(e)
    doc: dict[str, Any] = {"name": name or out.name.removesuffix(".yaml").removesuffix(".yml"),
                           "tenants": os.path.relpath(Path(tenants).resolve(), out_dir.resolve())}
    if cluster:
        doc["cluster"] = os.path.relpath(Path(cluster).resolve(), out_dir.resolve())
    doc.update(traces=entries, alpha="native" if alpha is None else alpha, seed=seed, duration_s=duration_s,
               rate_scale=rate_scale, offsets="auto")
    if base_rate_rps is not None:
        doc["base_rate_rps"] = base_rate_rps
    caps = {k: v for k, v in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)) if v}
    if caps:
        doc["caps"] = caps
    return doc


def write_workload_file(out: Path, doc: dict[str, Any]) -> None:
    """Write the document with a header saying how to read it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ("# SliceScheduler workload file (format: docs/loadgen.md). Written by `loadgen workload build`.\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110))
    out.write_text(text)
