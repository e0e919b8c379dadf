"""Container files: which devices each tenant's container holds (the static partition every policy starts from).

Format (what ``slicesched plan containers`` writes)::

    containers:            # tenant -> list of device ids, or tenant -> a device count
      t00: [g00, g01, g02]
      t01: 2
    plan: {...}            # optional: how the partition was planned (informational)

Counts are turned into device ids in cluster order, biggest tenants first, after the devices named explicitly;
every tenant of the tenants file must appear, no device may be in two containers, and every container's device
must hold its tenant's weights. :func:`with_homes` then gives a tenants config whose ``home_devices`` are the
containers, which is how the simulator, the meshes and every policy receive them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml

from shared.config import ClusterConfig, ConfigError, TenantsConfig


def read_containers(path: str | Path, cluster: ClusterConfig, tenants: TenantsConfig) -> dict[str, tuple[str, ...]]:
    """Parse and validate a containers file against ``cluster`` and ``tenants`` (errors name the file and field)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(p, "(file)", "containers file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(p, "(yaml)", f"not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("containers"), dict):
        raise ConfigError(p, "containers", "expected a mapping 'containers:' of tenant -> device count or device ids")
    return parse_containers(data["containers"], p, cluster, tenants)


def parse_containers(raw: Mapping[str, Any], file: str | Path, cluster: ClusterConfig,
                     tenants: TenantsConfig) -> dict[str, tuple[str, ...]]:
    """Validate a mapping tenant -> count | [device ids] and resolve it to device ids per tenant."""
    names = tenants.names()
    ids = [d.id for d in cluster.devices]
    known = set(ids)
    for t in raw:
        if t not in names:
            raise ConfigError(file, f"containers.{t}", f"unknown tenant (tenants: {', '.join(names)})")
    out: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    taken: dict[str, str] = {}
    for t in names:
        if t not in raw:
            raise ConfigError(file, f"containers.{t}", "missing: every tenant needs a container")
        v = raw[t]
        if isinstance(v, bool) or not isinstance(v, (int, list)):
            raise ConfigError(file, f"containers.{t}", f"expected a device count or a list of device ids, got {v!r}")
        if isinstance(v, int):
            if v < 1:
                raise ConfigError(file, f"containers.{t}", f"a container needs at least one device, got {v}")
            counts[t] = v
            continue
        if not v or not all(isinstance(d, str) for d in v):
            raise ConfigError(file, f"containers.{t}", "expected a non-empty list of device ids")
        for d in v:
            if d not in known:
                raise ConfigError(file, f"containers.{t}", f"unknown device {d!r} (not in {cluster.source})")
            if d in taken:
                raise ConfigError(file, f"containers.{t}", f"device {d!r} is already in {taken[d]}'s container")
            taken[d] = t
        out[t] = list(v)
    free = [d for d in ids if d not in taken]
    need = sum(counts.values())
    if need > len(free):
        raise ConfigError(file, "containers", f"the counts ask for {need} devices; {len(free)} are left in "
                                              f"{cluster.source}")
    for t in sorted(counts, key=lambda t: (-counts[t], names.index(t))):
        out[t], free = free[:counts[t]], free[counts[t]:]
    _check_fit(out, file, cluster, tenants)
    return {t: tuple(out[t]) for t in names}


def _check_fit(homes: Mapping[str, list[str]], file: str | Path, cluster: ClusterConfig,
               tenants: TenantsConfig) -> None:
    """Every container device must hold its tenant's weights below its capacity minus the headroom."""
    from shared.costmodel import cost_for
    for t in tenants.tenants:
        for d in homes[t.name]:
            dev = cluster.device(d)
            limit = dev.memory_bytes * (1.0 - cluster.headroom_fraction)
            w = cost_for(t.model.config, dev.kind).weight_bytes
            if w >= limit:
                raise ConfigError(file, f"containers.{t.name}", f"{t.name}'s weights ({w / 2**30:.1f} GiB) do not fit "
                                  f"on {d} ({limit / 2**30:.1f} GiB usable)")


def with_homes(tenants: TenantsConfig, homes: Mapping[str, tuple[str, ...] | list[str]]) -> TenantsConfig:
    """``tenants`` with each tenant's ``home_devices`` replaced by its container."""
    return dataclasses.replace(tenants, tenants=tuple(
        dataclasses.replace(t, home_devices=tuple(homes[t.name])) for t in tenants.tenants))


def write_containers(path: str | Path, homes: Mapping[str, tuple[str, ...] | list[str]],
                     plan: Mapping[str, Any] | None = None, header: str = "") -> None:
    """Write a containers file (device ids per tenant, plus the ``plan`` block); ``header`` lines are written as
    YAML comments."""
    body: dict[str, Any] = {"containers": {t: list(ds) for t, ds in homes.items()}}
    if plan:
        body["plan"] = dict(plan)
    text = yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"{ln}\n" if ln.startswith("#") else f"# {ln}".rstrip() + "\n" for ln in header.splitlines())
    Path(path).write_text(comment + text)
