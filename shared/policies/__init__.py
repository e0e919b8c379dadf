"""Scheduling policies and baselines, all in one registry (:data:`POLICIES`).

The live scheduler and the offline simulator use the same objects; see docs/policies.md.
"""
from shared.policies import container, container_realloc, muxserve, pooled_bound, slice, token_pool  # noqa: F401
from shared.policies.actions import ExtendLease, GrantLease, Placement, Reassign, RevokeLease, Trigger
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, PolicyConfigError
from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, TenantState


CONTAINERS = ("sized", "homes")


def make_policy(name: str, params: dict | None = None) -> Policy:
    """Instantiate a registered policy by name (unknown names raise and list the valid ones)."""
    return POLICIES.get(name).from_params(params)


def policy_params(name: str, base: dict | None = None, override: dict | None = None,
                  containers: str = "sized") -> dict:
    """Parameters for policy ``name``: the cluster file's ``policies.<name>`` (``base``) overridden key by key by
    ``override``. ``containers="homes"`` keeps the tenants file's home devices as containers (``resize`` false
    unless given), as the live mesh runs; ``"sized"`` sizes them from offered work (the offline default)."""
    if containers not in CONTAINERS:
        raise ValueError(f"containers must be one of {', '.join(CONTAINERS)}, not {containers!r}")
    params = {**(base or {}), **(override or {})}
    if containers == "homes" and "resize" in getattr(POLICIES.get(name).config_cls, "__dataclass_fields__", {}):
        params.setdefault("resize", False)
    return params


__all__ = ["POLICIES", "ClusterSnapshot", "DeviceState", "ExtendLease", "GrantLease", "LeaseState", "OfferedLoad",
           "Placement", "Policy", "PolicyConfig", "PolicyConfigError", "Reassign", "RevokeLease", "TenantState",
           "Trigger", "make_policy", "policy_params", "CONTAINERS"]
