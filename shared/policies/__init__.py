"""Scheduling policies and baselines, all in one registry (:data:`POLICIES`).

The live scheduler and the offline simulator use the same objects; see docs/policies.md.
"""
from shared.policies import container, container_realloc, muxserve, pooled, slice, token_pool  # noqa: F401
from shared.policies.actions import ExtendLease, GrantLease, Placement, Reassign, RevokeLease, Trigger
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, PolicyConfigError
from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, TenantState


def make_policy(name: str, params: dict | None = None) -> Policy:
    """Instantiate a registered policy by name (unknown names raise and list the valid ones)."""
    return POLICIES.get(name).from_params(params)


def policy_params(name: str, base: dict | None = None, override: dict | None = None) -> dict:
    """Parameters for policy ``name``: the cluster file's ``policies.<name>`` (``base``) overridden key by key by
    ``override``. Every policy starts from the tenants' home devices (its containers); see
    :mod:`shared.containers` for how a planned partition becomes those."""
    return {**(base or {}), **(override or {})}


__all__ = ["POLICIES", "ClusterSnapshot", "DeviceState", "ExtendLease", "GrantLease", "LeaseState", "OfferedLoad",
           "Placement", "Policy", "PolicyConfig", "PolicyConfigError", "Reassign", "RevokeLease", "TenantState",
           "Trigger", "make_policy", "policy_params"]
