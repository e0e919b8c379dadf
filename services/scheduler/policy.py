"""Live routing through the shared policy registry.

The live scheduler asks a policy for the order in which to try devices for a request. Policies in
``shared.policies`` are the same objects the offline simulator drives; this adapter builds the live view they need.
"""
from __future__ import annotations

from services.scheduler.core import DeviceView


class LeastLoadedHome:
    """Container routing: only the tenant's home devices, least-loaded first (fewest assigned, most free KV)."""

    registry_name = "container"

    def route_live(self, tenant: str, home: tuple[str, ...], devices: dict[str, DeviceView], kv_bytes: int) -> list[str]:
        ups = [devices[d] for d in home if d in devices and devices[d].up and devices[d].free >= kv_bytes]
        ups.sort(key=lambda v: (v.assigned, -v.free, v.id))
        return [v.id for v in ups]


def load_live_policy(name: str):
    """Return the live policy object registered as ``name`` (container only until leases are wired in)."""
    try:
        from shared.policies import registry as _reg  # noqa: F401  (ensures the registry exists)
        from shared.policies.registry import POLICIES
    except ImportError:
        POLICIES = None
    if POLICIES is not None:
        cls = POLICIES.get(name)  # raises with the valid names for an unknown policy
        obj = cls()
        if hasattr(obj, "route_live"):
            return obj
    if name != "container":
        raise ValueError(f"policy {name!r} has no live routing yet; use 'container'")
    return LeastLoadedHome()
