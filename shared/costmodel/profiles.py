"""Device profiles: peak FLOP/s, memory bandwidth, memory, links and efficiencies per operator class and size.

Profiles live as YAML files in ``shared/costmodel/profiles/`` (one per device kind). The H100 and A100 profiles
are fitted to measured operator timings (``slicesched bench costmodel --fit-out``, see docs/profiling.md), the
H200 one is derived from the H100 fit; ``slicesched profile`` replaces a profile with values measured on the
local device. Efficiency rows are per operator class (``gemm``, ``attention``, ``elementwise``, ``embedding``:
all required) and optionally per operator kind of :mod:`shared.model.graph` (e.g. ``rmsnorm``, ``rope``), which
then overrides its class's row for that kind. Every problem in a profile file raises
:class:`shared.config_error.ConfigError` naming the file and field.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from shared.config_error import ConfigError
from shared.model.graph import OPERATOR_KINDS

LINK_KINDS = ("shm", "tcp", "cuda_ipc", "nccl", "nvlink", "pcie")  # tensor transports between devices

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
OP_CLASSES = ("gemm", "attention", "elementwise", "embedding")
# Memory efficiency is relative to the DRAM datasheet bandwidth; an operator whose operands the previous kernel
# left in the on-chip cache (e.g. a residual add on a GPU's 40-50 MB L2) measures above it.
MAX_MEMORY_EFF = 1.5


@dataclass(frozen=True)
class LinkSpec:
    """One link kind as seen from a device: per-direction bandwidth (bytes/s) and one-way latency (s)."""

    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class DeviceProfile:
    """Performance model of one device kind.

    ``compute_eff[row][bucket]`` and ``memory_eff[row][bucket]`` are fractions of peak, where a row is an
    operator class or (optional, overriding its class) an operator kind; buckets are chosen by the number of
    token rows entering the operator (``buckets`` holds the upper bounds, a last bucket covers everything above).
    """

    kind: str
    source: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    launch_overhead_s: float
    links: dict[str, LinkSpec]
    buckets: tuple[int, ...]
    compute_eff: dict[str, tuple[float, ...]]
    memory_eff: dict[str, tuple[float, ...]]
    file: str = "<memory>"
    launch_overhead_by_class: dict[str, float] = field(default_factory=dict)  # optional, per class or kind
    step_overhead_s: float = 0.0  # per iteration, outside the operators (batch layout, sampling, bookkeeping)
    _eff_cache: dict = field(default_factory=dict, compare=False, repr=False)

    def bucket(self, tokens: int) -> int:
        """Index of the size bucket for an operator over ``tokens`` rows."""
        return bisect.bisect_left(self.buckets, tokens)

    def rates(self, op_class: str, tokens: int, kind: str | None = None) -> tuple[float, float]:
        """Effective (FLOP/s, bytes/s) for an operator at this size: peak × efficiency of the operator kind's
        row if the profile has one, else of its class's."""
        key = (op_class, kind, self.bucket(tokens))
        r = self._eff_cache.get(key)
        if r is None:
            row, b = (kind if kind in self.compute_eff else op_class), key[2]
            r = (self.peak_flops * self.compute_eff[row][b], self.mem_bandwidth * self.memory_eff[row][b])
            self._eff_cache[key] = r
        return r

    def launch_s(self, op_class: str, kind: str | None = None) -> float:
        """Fixed cost (s) of one operator: its kind's overhead, else its class's, else ``launch_overhead_s``."""
        by = self.launch_overhead_by_class
        if kind is not None and kind in by:
            return by[kind]
        return by.get(op_class, self.launch_overhead_s)

    def link(self, kind: str) -> LinkSpec:
        """The link spec for ``kind`` (one of LINK_KINDS)."""
        try:
            return self.links[kind]
        except KeyError:
            raise KeyError(f"profile {self.kind!r} has no link {kind!r}; has {', '.join(sorted(self.links))}") \
                from None

    @property
    def calibrated(self) -> bool:
        return "uncalibrated" not in self.source

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (the YAML file's layout)."""
        return {"kind": self.kind, "source": self.source, "peak_flops": self.peak_flops,
                "mem_bandwidth": self.mem_bandwidth, "memory_bytes": self.memory_bytes,
                "launch_overhead_s": self.launch_overhead_s,
                "links": {k: {"bandwidth": v.bandwidth, "latency_s": v.latency_s} for k, v in self.links.items()},
                "efficiency": {"buckets": list(self.buckets),
                               "compute": {k: list(v) for k, v in self.compute_eff.items()},
                               "memory": {k: list(v) for k, v in self.memory_eff.items()}},
                **({"launch_overhead_by_class": dict(self.launch_overhead_by_class)}
                   if self.launch_overhead_by_class else {}),
                **({"step_overhead_s": self.step_overhead_s} if self.step_overhead_s else {})}


def _num(d: dict, key: str, file: str, path: str, positive: bool = True) -> float:
    if key not in d:
        raise ConfigError(file, f"{path}{key}", "required field is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(file, f"{path}{key}", f"expected a number, got {v!r}")
    if positive and v <= 0:
        raise ConfigError(file, f"{path}{key}", f"must be positive, got {v!r}")
    return float(v)


def parse_profile(data: Any, file: str | Path = "<memory>") -> DeviceProfile:
    """Validate a profile mapping (as loaded from YAML) and build a :class:`DeviceProfile`."""
    file = str(file)
    if not isinstance(data, dict):
        raise ConfigError(file, "(top level)", "expected a mapping")
    kind = data.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(file, "kind", "required string field is missing")
    source = data.get("source")
    if not isinstance(source, str) or not source:
        raise ConfigError(file, "source", "required (e.g. \"datasheet, uncalibrated\" or \"measured ...\")")
    links_raw = data.get("links") or {}
    if not isinstance(links_raw, dict):
        raise ConfigError(file, "links", "expected a mapping of link kind -> {bandwidth, latency_s}")
    links = {}
    for k, v in links_raw.items():
        if k not in LINK_KINDS:
            raise ConfigError(file, f"links.{k}", f"unknown link kind; valid: {', '.join(LINK_KINDS)}")
        if not isinstance(v, dict):
            raise ConfigError(file, f"links.{k}", "expected {bandwidth, latency_s}")
        links[k] = LinkSpec(_num(v, "bandwidth", file, f"links.{k}."),
                            _num(v, "latency_s", file, f"links.{k}.", positive=False))
    eff = data.get("efficiency")
    if not isinstance(eff, dict):
        raise ConfigError(file, "efficiency", "required mapping with buckets, compute, memory")
    buckets = eff.get("buckets")
    if not isinstance(buckets, list) or not all(isinstance(b, int) and b > 0 for b in buckets) \
            or buckets != sorted(buckets):
        raise ConfigError(file, "efficiency.buckets", "expected an increasing list of positive integers")
    tables = {part: _efficiency_table(eff, part, len(buckets) + 1, file) for part in ("compute", "memory")}
    extra = set(tables["compute"]) ^ set(tables["memory"])
    if extra:
        k = sorted(extra)[0]
        part = "memory" if k in tables["compute"] else "compute"
        raise ConfigError(file, f"efficiency.{part}.{k}", "an operator kind's row needs both a compute and a memory row")
    by_class = data.get("launch_overhead_by_class") or {}
    if not isinstance(by_class, dict):
        raise ConfigError(file, "launch_overhead_by_class", "expected a mapping of operator class -> seconds")
    for cls in by_class:
        if cls not in OP_CLASSES and cls not in OPERATOR_KINDS:
            raise ConfigError(file, f"launch_overhead_by_class.{cls}",
                              f"unknown operator class or kind; valid: {', '.join(OP_CLASSES)} or an operator "
                              f"kind ({', '.join(OPERATOR_KINDS)})")
    launch_by_class = {cls: _num(by_class, cls, file, "launch_overhead_by_class.", positive=False)
                       for cls in by_class}
    step_overhead = _num(data, "step_overhead_s", file, "", positive=False) if "step_overhead_s" in data else 0.0
    if min([step_overhead, *launch_by_class.values()]) < 0:
        raise ConfigError(file, "step_overhead_s" if step_overhead < 0 else "launch_overhead_by_class",
                          "overheads must be >= 0")
    return DeviceProfile(kind=kind, source=source, peak_flops=_num(data, "peak_flops", file, ""),
                         mem_bandwidth=_num(data, "mem_bandwidth", file, ""),
                         memory_bytes=int(_num(data, "memory_bytes", file, "")),
                         launch_overhead_s=_num(data, "launch_overhead_s", file, "", positive=False),
                         links=links, buckets=tuple(buckets), compute_eff=tables["compute"],
                         memory_eff=tables["memory"], file=file, launch_overhead_by_class=launch_by_class,
                         step_overhead_s=step_overhead)


def _efficiency_table(eff: dict, part: str, n: int, file: str) -> dict[str, tuple[float, ...]]:
    """``efficiency.compute`` or ``efficiency.memory``: every class row (required) and any operator kind rows."""
    t = eff.get(part)
    if not isinstance(t, dict):
        raise ConfigError(file, f"efficiency.{part}", "required mapping of operator class -> list")
    hi = 1.0 if part == "compute" else MAX_MEMORY_EFF
    out = {}
    for key in (*OP_CLASSES, *(k for k in t if k not in OP_CLASSES)):
        row, path = t.get(key), f"efficiency.{part}.{key}"
        if key not in OP_CLASSES and key not in OPERATOR_KINDS:
            raise ConfigError(file, path, f"unknown row; valid: the classes {', '.join(OP_CLASSES)} or an operator "
                                          f"kind ({', '.join(OPERATOR_KINDS)})")
        if not isinstance(row, list) or len(row) != n:
            raise ConfigError(file, path, f"expected a list of {n} fractions (one per bucket)")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= hi for x in row):
            raise ConfigError(file, path, f"every efficiency must be a number in (0, {hi:g}]")
        out[key] = tuple(float(x) for x in row)
    return out


def load_profile_file(path: str | Path) -> DeviceProfile:
    """Load and validate one profile YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(p, "(file)", "profile file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(p, "(yaml)", f"invalid YAML: {getattr(e, 'problem', e)}") from None
    return parse_profile(data, p)


@lru_cache(maxsize=None)
def load_profile(kind: str) -> DeviceProfile:
    """The shipped profile for a device kind (``cpu``, ``a100-80gb``, ``h100-80gb``, ``h200``), cached."""
    path = PROFILE_DIR / f"{kind}.yaml"
    if not path.is_file():
        valid = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ConfigError(path, "kind", f"no profile for device kind {kind!r}; valid: {valid}")
    return load_profile_file(path)
