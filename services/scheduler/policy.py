"""The live scheduler's policy: the same registered objects the offline simulator drives."""
from __future__ import annotations

import json

from shared.policies import POLICIES, Policy, make_policy, policy_params


def load_live_policy(name: str, params_json: str = "", base: dict | None = None) -> Policy:
    """Instantiate policy ``name`` (unknown names raise with the valid ones; simulation-only ones are refused)
    with ``base`` (the cluster file's ``policies.<name>``) overridden key by key by ``params_json``."""
    cls = POLICIES.get(name)
    if getattr(cls, "simulation_only", False):
        why = getattr(cls, "simulation_only_why", "") or "a bound, not a real policy"
        raise ValueError(f"policy {name!r} is simulation-only ({why})")
    try:
        override = json.loads(params_json) if params_json else {}
    except ValueError as e:
        raise ValueError(f"SLICESCHED_POLICY_PARAMS is not valid JSON: {e}") from None
    if not isinstance(override, dict):
        raise ValueError("SLICESCHED_POLICY_PARAMS must be a JSON object of parameter -> value")
    return make_policy(name, policy_params(name, base, override))
