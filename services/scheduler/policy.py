"""The live scheduler's policy: the same registered objects the offline simulator drives."""
from __future__ import annotations

import json

from shared.policies import POLICIES, Policy, make_policy


def load_live_policy(name: str, params_json: str = "") -> Policy:
    """Instantiate policy ``name`` (unknown names raise with the valid ones; simulation-only ones are refused)."""
    cls = POLICIES.get(name)
    if getattr(cls, "simulation_only", False):
        raise ValueError(f"policy {name!r} is simulation-only (a bound, not a real policy)")
    params = json.loads(params_json) if params_json else {}
    params.setdefault("resize", False) if "resize" in {f for f in getattr(cls.config_cls, "__dataclass_fields__", {})} else None
    return make_policy(name, params)
