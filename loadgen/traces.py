"""Per-request trace readers: Azure LLM 2023 CSV, JSONL and generic CSV with a column mapping.

Every reader returns a :class:`Trace` (arrival times in seconds from the first row, sorted, plus input/output
token counts). A malformed file raises :class:`TraceError` naming the file, the line and the column; it never
escapes as a traceback from the command line.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from shared.config import ConfigError

FORMATS = ("azure", "jsonl", "csv", "servegen")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "iso": 1.0}
COLUMN_KEYS = ("time", "input", "output")


class TraceError(ConfigError):
    """A problem in a trace file: ``file: line N, column C: what is wrong``."""


@dataclass(frozen=True, eq=False)
class Trace:
    """Arrivals of one request stream: times in seconds from the first arrival, sorted, with token counts.

    ``period_s`` is the length after which the trace repeats when it is tiled or shifted circularly: the span
    from the first to the last arrival plus one mean inter-arrival gap (so the last and the first arrival do
    not coincide at the seam).
    """

    name: str
    source: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    period_s: float

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def rate_rps(self) -> float:
        """Native mean arrival rate over one period."""
        return len(self) / self.period_s if self.period_s > 0 else 0.0


def make_trace(name: str, source: str, times: np.ndarray, inp: np.ndarray, out: np.ndarray,
               period_s: float | None = None) -> Trace:
    """Sort by time (stable), shift so the first arrival is at 0, and derive the period."""
    times = np.asarray(times, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    times, inp, out = times[order], np.asarray(inp, np.int64)[order], np.asarray(out, np.int64)[order]
    if times.size:
        times = times - times[0]
    if period_s is None:
        span = float(times[-1]) if times.size else 0.0
        gap = span / (times.size - 1) if times.size > 1 else 1.0
        period_s = span + (gap if gap > 0 else 1.0)
    return Trace(name=name, source=source, arrival_s=times, input_tokens=inp, output_tokens=out,
                 period_s=float(period_s))


def expand_path(raw: str, base_dir: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """Expand ``${SLICESCHED_TRACES}`` (default ``<repo>/../shared/traces``) and resolve relative paths."""
    e = os.environ if env is None else env
    traces_dir = e.get("SLICESCHED_TRACES") or str(default_traces_dir())
    s = raw.replace("${SLICESCHED_TRACES}", traces_dir).replace("$SLICESCHED_TRACES", traces_dir)
    p = Path(os.path.expanduser(s))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p


def default_traces_dir() -> Path:
    """``<repo>/../shared/traces``: the traces live beside the repository, never inside it."""
    return (Path(__file__).resolve().parent.parent.parent / "shared" / "traces").resolve()


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise TraceError(path, "(file)", "file not found")


def _positive_int(text: str, path: Path, line: int, col: str, *, allow_zero: bool = False) -> int:
    where = f"line {line}, column {col}"
    try:
        v = int(text)
    except (TypeError, ValueError):
        try:
            f = float(text)
        except (TypeError, ValueError):
            raise TraceError(path, where, f"expected an integer token count, got {text!r}") from None
        if not f.is_integer():
            raise TraceError(path, where, f"expected an integer token count, got {text!r}") from None
        v = int(f)
    if v < 0 or (v == 0 and not allow_zero):
        raise TraceError(path, f"line {line}, column {col}", f"token count must be positive, got {text!r}")
    return v


def _number(text: str, path: Path, line: int, col: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise TraceError(path, f"line {line}, column {col}", f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")) or v < 0:
        raise TraceError(path, f"line {line}, column {col}", f"expected a finite non-negative number, got {text!r}")
    return v


_DAY_CACHE: dict[str, int] = {}


def parse_wallclock(text: str, path: Path, line: int, col: str) -> float:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` (any number of fraction digits) to seconds since 1970-01-01 (naive)."""
    try:
        d, _, clock = text.strip().replace("T", " ").partition(" ")
        day = _DAY_CACHE.get(d)
        if day is None:
            day = _DAY_CACHE.setdefault(d, date.fromisoformat(d).toordinal() - 719163)
        hh, mm, ss = clock.split(":")
        h, m, sec = int(hh), int(mm), float(ss)
        if not (0 <= h < 24 and 0 <= m < 60 and 0 <= sec < 61):
            raise ValueError
    except (ValueError, TypeError):
        raise TraceError(path, f"line {line}, column {col}",
                         f"expected a wall-clock time 'YYYY-MM-DD HH:MM:SS.fffffff', got {text!r}") from None
    return day * 86400.0 + h * 3600.0 + m * 60.0 + sec


def read_csv_trace(path: str | Path, columns: dict[str, str], time_unit: str = "s", name: str | None = None) -> Trace:
    """Generic CSV with a header row; ``columns`` maps time/input/output to header names."""
    path = Path(path)
    _check_file(path)
    missing = [k for k in COLUMN_KEYS if k not in columns]
    if missing:
        raise TraceError(path, "columns", f"column mapping lacks {', '.join(missing)} (give time=,input=,output=)")
    if time_unit not in TIME_UNITS:
        raise TraceError(path, "time_unit", f"must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")
    times: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise TraceError(path, "line 1", "empty file (expected a header row)")
        header = [h.strip().lstrip("\ufeff") for h in header]
        idx = {}
        for key in COLUMN_KEYS:
            col = columns[key]
            if col not in header:
                raise TraceError(path, f"line 1, column {col}", f"no such column (header: {', '.join(header)})")
            idx[key] = header.index(col)
        ti, ii, oi = idx["time"], idx["input"], idx["output"]
        tcol, icol, ocol = columns["time"], columns["input"], columns["output"]
        need = max(ti, ii, oi)
        scale = TIME_UNITS[time_unit]
        for lineno, row in enumerate(reader, start=2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) <= need:
                raise TraceError(path, f"line {lineno}", f"expected {len(header)} columns, got {len(row)}")
            if time_unit == "iso":
                times.append(parse_wallclock(row[ti], path, lineno, tcol))
            else:
                times.append(_number(row[ti], path, lineno, tcol) * scale)
            inp.append(_positive_int(row[ii], path, lineno, icol))
            out.append(_positive_int(row[oi], path, lineno, ocol, allow_zero=True))
    if not times:
        raise TraceError(path, "line 2", "no data rows")
    return make_trace(name or path.stem, str(path), np.array(times), np.array(inp), np.array(out))


AZURE_COLUMNS = {"time": "TIMESTAMP", "input": "ContextTokens", "output": "GeneratedTokens"}


def read_azure(path: str | Path, name: str | None = None) -> Trace:
    """Azure LLM inference trace 2023: ``TIMESTAMP`` (wall clock, 7 fraction digits), ContextTokens, GeneratedTokens."""
    return read_csv_trace(path, AZURE_COLUMNS, time_unit="iso", name=name)


def read_jsonl(path: str | Path, name: str | None = None) -> Trace:
    """JSON lines with ``timestamp`` (ms), ``input_length`` and ``output_length``."""
    path = Path(path)
    _check_file(path)
    times: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(path, f"line {lineno}, column {e.colno}", f"invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise TraceError(path, f"line {lineno}", "expected a JSON object per line")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise TraceError(path, f"line {lineno}, column {key}", "required field is missing")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                raise TraceError(path, f"line {lineno}, column timestamp", f"expected a number of ms, got {ts!r}")
            times.append(_number(str(ts), path, lineno, "timestamp") * 1e-3)
            inp.append(_positive_int(str(obj["input_length"]), path, lineno, "input_length"))
            out.append(_positive_int(str(obj["output_length"]), path, lineno, "output_length", allow_zero=True))
    if not times:
        raise TraceError(path, "line 1", "no data rows")
    return make_trace(name or path.stem, str(path), np.array(times), np.array(inp), np.array(out))


def parse_columns(text: str, where: str = "--columns") -> dict[str, str]:
    """``time=ts_s,input=prompt,output=completion`` to a mapping; unknown keys are an error."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, col = part.partition("=")
        if not sep or key.strip() not in COLUMN_KEYS or not col.strip():
            raise ConfigError(where, part, f"expected KEY=COLUMN with KEY one of {', '.join(COLUMN_KEYS)}")
        out[key.strip()] = col.strip()
    return out


def read_trace(path: str | Path, fmt: str, columns: dict[str, str] | None = None, time_unit: str = "s",
               name: str | None = None) -> Trace:
    """Read a per-request trace in one of the formats ``azure``, ``jsonl`` or ``csv``."""
    if fmt == "azure":
        return read_azure(path, name)
    if fmt == "jsonl":
        return read_jsonl(path, name)
    if fmt == "csv":
        if not columns:
            raise TraceError(path, "columns", "format csv needs a column mapping (time=,input=,output=)")
        return read_csv_trace(path, columns, time_unit, name)
    raise TraceError(path, "format", f"unknown trace format {fmt!r}; valid: azure, jsonl, csv, servegen")


def guess_format(path: str | Path) -> str:
    """Best guess from the file name: ``*.jsonl`` → jsonl, ``servegen_*`` → servegen, Azure header → azure."""
    p = Path(path)
    if p.name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if "servegen" in p.name:
        return "servegen"
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            head = f.readline()
    except OSError:
        return "csv"
    return "azure" if head.lstrip("\ufeff").startswith("TIMESTAMP,") else "csv"
