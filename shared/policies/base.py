"""Policy base class, its typed config and the one registry every policy (and baseline) lives in.

A policy is a plain object: it never touches the clock, Redis or files. The simulator and the live scheduler
call the same methods with a :class:`~shared.policies.snapshot.ClusterSnapshot`:

* ``initial_placement(snapshot, offered)`` -> :class:`Placement` (which tenant's weights/engine go where);
* ``route(tenant, input_tokens, output_tokens, snapshot)`` -> device id, or None to reject;
* ``decide(trigger, snapshot, whatif)`` -> list of actions (leases, revocations, reassignments).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from shared.costmodel.sla import RequestTargets
from shared.policies.actions import Action, Placement, Trigger
from shared.policies.snapshot import ClusterSnapshot, TenantState
from shared.registry import Registry


@dataclass(frozen=True)
class OfferedLoad:
    """Average load of one tenant (from a workload offline, from measured rates live)."""

    tenant: str
    requests: int
    duration_s: float
    mean_input: float
    mean_output: float
    work_s: float  # device-seconds on its home device kind (prefill + decode at a reference batch)

    @property
    def rate_rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class PolicyConfig:
    """Parameters shared by every policy; subclasses add their own fields."""

    max_queue_per_device: int = 1024  # route() rejects when every candidate device has this many queued


class PolicyConfigError(ValueError):
    """A bad policy parameter (name and reason)."""


class Policy:
    """Base class. Subclasses set ``config_cls`` and override the decision methods they need."""

    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig
    registry_name: ClassVar[str] = "?"
    simulation_only: ClassVar[bool] = False
    simulation_only_why: ClassVar[str] = ""  # what the live mesh lacks for it (shown when `up` refuses it)
    wants_arrival: ClassVar[bool] = False  # call decide() after every routed arrival
    tick_s: float | None = None  # call decide() periodically

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config if config is not None else self.config_cls()
        if not isinstance(self.config, self.config_cls):
            raise PolicyConfigError(f"{self.registry_name}: expected {self.config_cls.__name__}")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None = None) -> "Policy":
        """Build with config fields overridden from a plain mapping; unknown or mistyped fields raise."""
        params = dict(params or {})
        names = {f.name: f for f in dataclasses.fields(cls.config_cls)}
        for k, v in params.items():
            if k not in names:
                raise PolicyConfigError(f"{cls.registry_name}: unknown parameter {k!r}; valid: {', '.join(names)}")
            default = getattr(cls.config_cls(), k)
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                try:
                    params[k] = type(default)(v)
                except (TypeError, ValueError):
                    raise PolicyConfigError(f"{cls.registry_name}: parameter {k!r} must be a number") from None
        return cls(cls.config_cls(**params))

    # ---------------------------------------------------------------- decisions
    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        """Where each tenant's engines start. Default: the tenants' configured home devices."""
        assign: dict[str, list[str]] = {}
        for t in snapshot.tenants.values():
            for d in t.home_devices:
                assign.setdefault(d, []).append(t.name)
        return Placement({d: tuple(ts) for d, ts in assign.items()})

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        """Device for a new request of ``tenant``; None rejects it."""
        raise NotImplementedError

    def decide(self, trigger: Trigger, snapshot: ClusterSnapshot, whatif: Any = None) -> list[Action]:
        """Actions in response to ``trigger``. Default: none."""
        return []

    def request_targets(self, tenant: TenantState) -> RequestTargets:
        """The (TTFT, TPOT) targets of ``tenant``'s requests by their lengths (priced per request under a
        ``slowdown`` SLA, the fixed ones otherwise); built once per tenant SLA and model."""
        cache = self.__dict__.setdefault("_request_targets", {})
        key = (tenant.name, tenant.sla, id(tenant.model))
        tg = cache.get(key)
        if tg is None:
            tg = cache[key] = RequestTargets(tenant.sla, tenant.model)
        return tg

    def switch_cost_s(self, device_kind: str, tenant: str, resident: bool) -> float:
        """Seconds a ``switch``-sharing device pays to change tenant (only token-pool uses it)."""
        return 0.0

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for result files."""
        return {"name": self.registry_name, "params": dataclasses.asdict(self.config)}


POLICIES: Registry[Policy] = Registry("policy")


def least_loaded(devices: list, snapshot: ClusterSnapshot, cap: int) -> str | None:
    """The device id with the fewest outstanding requests (ties: fewer queued prompt tokens, then order);
    None when every one already queues ``cap`` requests."""
    best, best_key = None, None
    for did in devices:
        d = snapshot.devices[did]
        if d.queued >= cap or d.draining:
            continue
        key = (d.queued + d.running, d.queued_prefill_tokens)
        if best_key is None or key < best_key:
            best, best_key = did, key
    return best
