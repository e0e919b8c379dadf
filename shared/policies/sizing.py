"""Container sizing: devices per tenant in proportion to average offered work, at least one each."""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.policies.base import OfferedLoad, PolicyConfigError
from shared.policies.snapshot import ClusterSnapshot

if TYPE_CHECKING:
    from shared.config import ClusterConfig
    from shared.workload import Workload


def device_counts(work: dict[str, float], n_devices: int, minimum: int = 1) -> dict[str, int]:
    """Largest-remainder apportionment of ``n_devices`` by ``work``, each tenant getting at least ``minimum``.

    Tenants that would get less than the minimum are pinned to it and the rest is re-apportioned among the others.
    """
    names = list(work)
    if len(names) * minimum > n_devices:
        raise PolicyConfigError(f"{len(names)} tenants need at least {len(names) * minimum} devices; "
                                f"the cluster has {n_devices}")
    pinned: dict[str, int] = {}
    while True:
        free = [t for t in names if t not in pinned]
        left = n_devices - sum(pinned.values())
        total = sum(max(work[t], 0.0) for t in free)
        if not free:
            return pinned
        quota = {t: (left * max(work[t], 0.0) / total if total > 0 else left / len(free)) for t in free}
        small = [t for t in free if quota[t] < minimum]
        if not small:
            break
        for t in small:
            pinned[t] = minimum
    counts = {t: int(quota[t]) for t in free}
    rest = left - sum(counts.values())
    for t in sorted(free, key=lambda t: (-(quota[t] - counts[t]), names.index(t)))[:rest]:
        counts[t] += 1
    counts.update(pinned)
    return {t: counts[t] for t in names}


def offered_work(offered: dict[str, OfferedLoad], snapshot: ClusterSnapshot) -> dict[str, float]:
    """Work per tenant (device-seconds); tenants absent from the workload get their configured share of zero."""
    return {t: (offered[t].work_s if t in offered else 0.0) for t in snapshot.tenants}


def offered_loads(workload: "Workload", kind: str) -> dict[str, OfferedLoad]:
    """Average offered load per tenant of ``workload``, its work costed on device kind ``kind``."""
    from shared.costmodel import cost_for
    acc: dict[str, list[int]] = {}
    for r in workload.requests:
        a = acc.setdefault(r.tenant, [0, 0, 0])
        a[0] += 1
        a[1] += r.input_tokens
        a[2] += r.output_tokens
    dur = workload.duration_s or (workload.requests[-1].arrival_s if workload.requests else 0.0)
    models = {t.name: t.model.config for t in workload.tenants.tenants}
    out = {}
    for t, (n, inp, outp) in acc.items():
        if t not in models:
            continue
        mi, mo = inp / n, outp / n
        out[t] = OfferedLoad(t, n, dur, mi, mo, n * cost_for(models[t], kind).request_work(int(mi), int(mo)))
    return out


def avgwork_homes(cluster: "ClusterConfig", workload: "Workload", minimum: int = 1) -> dict[str, list[str]]:
    """Containers sized in proportion to average offered work (``container-avgwork``'s sizing) on ``cluster``."""
    offered = offered_loads(workload, cluster.devices[0].kind)
    work = {t.name: (offered[t.name].work_s if t.name in offered else 0.0) for t in workload.tenants.tenants}
    if sum(work.values()) <= 0:
        return {t.name: list(t.home_devices) for t in workload.tenants.tenants}
    return _contiguous(device_counts(work, len(cluster.devices), minimum), [(d.id, d.host) for d in cluster.devices])


def assign_contiguous(counts: dict[str, int], snapshot: ClusterSnapshot) -> dict[str, list[str]]:
    """Give each tenant ``counts[t]`` devices, biggest tenants first, filling hosts in order so that a
    tenant's devices share hosts where possible."""
    return _contiguous(counts, [(d.id, d.host) for d in snapshot.devices.values()])


def _contiguous(counts: dict[str, int], devices: list[tuple[str, str]]) -> dict[str, list[str]]:
    by_host: dict[str, list[str]] = {}
    for did, host in devices:
        by_host.setdefault(host, []).append(did)
    order = [d for host in by_host for d in by_host[host]]
    out: dict[str, list[str]] = {}
    i = 0
    for t in sorted(counts, key=lambda t: -counts[t]):
        out[t] = order[i:i + counts[t]]
        i += counts[t]
    return out
