"""Transfer time over a link: latency + bytes / bandwidth, per link kind (nvlink, pcie, shm, tcp, cuda_ipc, nccl)."""
from __future__ import annotations

from shared.costmodel.profiles import DeviceProfile


def transfer_time(profile: DeviceProfile, link_kind: str, nbytes: float) -> float:
    """Seconds to move ``nbytes`` over ``link_kind`` as described by the sending device's profile."""
    if nbytes <= 0:
        return 0.0
    link = profile.link(link_kind)
    return link.latency_s + nbytes / link.bandwidth


def link_bandwidth(profile: DeviceProfile, link_kind: str) -> float:
    """Per-direction bandwidth in bytes/s of ``link_kind`` for this device kind."""
    return profile.link(link_kind).bandwidth
