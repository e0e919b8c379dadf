"""Decisions a policy returns; the simulator applies them, the live scheduler commits them through the GMG."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trigger:
    """Why ``decide`` is called: ``tick`` (periodic), ``arrival`` (a request was routed), ``lease_end``,
    ``lease_revoked``, ``idle`` (a device ran out of work)."""

    kind: str
    tenant: str | None = None
    device: str | None = None
    lease_id: str | None = None


@dataclass(frozen=True)
class Placement:
    """Initial assignment: which tenants have an engine (full weights resident) on which device.

    ``sharing`` says how a device with several engines divides its time: ``exclusive`` (one engine),
    ``round_robin``, ``weighted`` (``weights[(device, tenant)]`` shares), ``switch`` (one tenant at a time with a
    switch cost) or ``edf`` (the engine with the earliest SLA deadline among its requests goes next). ``dynamic_engines``: routing may open an engine on any device. ``weights_free``: weights cost
    no memory (the simulation-only bound).
    """

    assign: dict[str, tuple[str, ...]]
    sharing: str = "exclusive"
    weights: dict[tuple[str, str], float] = field(default_factory=dict)
    dynamic_engines: bool = False
    weights_free: bool = False
    quantum: int = 8  # switch sharing: iterations one tenant keeps the device before another may take it


@dataclass(frozen=True)
class GrantLease:
    """Run ``segments`` (``mlp[l]`` names) of ``tenant``'s batch on ``guest_device`` for ``duration_s``, taking at
    most ``share`` of the guest's time while its own tenant is busy. Staging missing weights is part of the grant.

    ``mode="sequences"`` (DESIGN §4, second mode): all of the model's segments are staged (``segments`` is
    ``("*",)``) and new sequences of the tenant routed to the guest keep their KV there and run whole iterations
    there; when the lease ends the guest stops admitting them and finishes those it holds."""

    tenant: str
    home_device: str
    guest_device: str
    segments: tuple[str, ...]
    duration_s: float
    share: float
    memory_bytes: int
    predicted_gain_s: float = 0.0
    mode: str = "segments"  # segments: MLP blocks of the home's batch; sequences: new sequences run on the guest
    handback: bool = False  # sequences: each sequence goes home once its prompt is prefilled (lane hand-off)


@dataclass(frozen=True)
class RevokeLease:
    """End a lease early (the home runs the segments itself from the next iteration)."""

    lease_id: str
    reason: str = ""


@dataclass(frozen=True)
class ExtendLease:
    """Move a lease's end to ``now + duration_s``."""

    lease_id: str
    duration_s: float


@dataclass(frozen=True)
class Reassign:
    """Give ``device`` to ``tenant``: the device drains its current engine, reloads weights for ``reload_s``,
    then serves ``tenant``."""

    device: str
    tenant: str
    reload_s: float


Action = GrantLease | RevokeLease | ExtendLease | Reassign
