"""What the simulator service has learned, as a versioned copy the live scheduler's what-if applies.

The simulator service fits online correction factors of the cost model (measured / predicted segment time per
device and segment kind, :class:`~shared.costmodel.CorrectionTable`) and forecasts each device's busy time over the
next seconds. It publishes both as one plain hash, ``sim:steering`` (docs/redis-schema.md), replaced whole in one
``MULTI`` with a new ``version`` each time. The scheduler polls the version, reads the copy when it changed, and
applies it between decisions: :class:`CorrectedWhatIf` prices every iteration with the factors (per device kind:
the mean over the devices of that kind, as the simulator's own what-if does) and :func:`steer_snapshot` marks
devices the forecast predicts busy over its horizon. A copy that stops changing for ``stale_after_s`` is dropped:
the what-if falls back to the uncorrected cost model and the snapshot to what the scheduler observes itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from shared.costmodel import CorrectionTable, ModelCost, cost_for
from shared.policies.snapshot import ClusterSnapshot, TenantState
from shared.sim.whatif import WhatIf

STALE_AFTER_S = 5.0  # the simulator publishes every 0.5 s; a copy unchanged this long is not used
BUSY_RATIO = 0.5  # a device predicted busy at least this fraction of the horizon counts as busy for decisions


def kind_factors(table: CorrectionTable, kinds: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Device kind -> segment kind (or ``kind@bucket``) -> the mean factor over the devices of that device kind,
    rounded to 0.01 (a cost model is rebuilt only when a factor moves by that much)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for dev, kind in kinds.items():
        for op, f in table.factors_for(dev).items():
            sums.setdefault(kind, {}).setdefault(op, []).append(f)
    return {kind: {op: round(sum(v) / len(v), 2) for op, v in sorted(ops.items())} for kind, ops in sums.items()}


@dataclass(frozen=True)
class SteeringCopy:
    """One published copy: correction factors per device kind and the forecast per device (simulated)."""

    version: int
    ts: float  # the simulator's wall clock when it published the copy
    epoch: int = -1  # GMG epoch of the twin the forecast was computed on
    horizon_s: float = 2.0
    factors: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # device kind -> op -> factor
    busy: Mapping[str, float] = field(default_factory=dict)  # device -> predicted busy ratio over the horizon
    next_idle_s: Mapping[str, float] = field(default_factory=dict)  # device -> seconds to its next idle slice

    def to_fields(self) -> dict[str, str]:
        """The ``sim:steering`` hash (plain fields; see docs/redis-schema.md)."""
        out = {"version": str(self.version), "ts": f"{self.ts:.3f}", "epoch": str(self.epoch),
               "horizon_s": f"{self.horizon_s:g}", "label": "simulated"}
        for kind, ops in sorted(self.factors.items()):
            for op, f in sorted(ops.items()):
                out[f"factor:{kind}/{op}"] = f"{f:.4f}"
        for d, r in sorted(self.busy.items()):
            out[f"busy:{d}"] = f"{r:.3f}"
        for d, s in sorted(self.next_idle_s.items()):
            out[f"next_idle:{d}"] = f"{s:.4f}"
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> "SteeringCopy":
        """Parse a ``sim:steering`` hash; ``ValueError`` naming the field for a malformed one."""
        def num(name: str, raw: str, kind=float):
            try:
                v = kind(raw)
            except (TypeError, ValueError):
                raise ValueError(f"sim:steering field {name!r}: not a number: {raw!r}") from None
            if not math.isfinite(v):
                raise ValueError(f"sim:steering field {name!r}: not finite: {raw!r}")
            return v

        if "version" not in fields or "ts" not in fields:
            raise ValueError("sim:steering lacks 'version' or 'ts'")
        factors: dict[str, dict[str, float]] = {}
        busy, idle = {}, {}
        for k, raw in fields.items():
            if k.startswith("factor:"):
                kind, sep, op = k[len("factor:"):].partition("/")
                if not sep or not kind or not op:
                    raise ValueError(f"sim:steering field {k!r}: expected factor:<device kind>/<segment kind>")
                f = num(k, raw)
                if f <= 0:
                    raise ValueError(f"sim:steering field {k!r}: factor must be > 0, got {raw!r}")
                factors.setdefault(kind, {})[op] = f
            elif k.startswith("busy:"):
                busy[k[len("busy:"):]] = num(k, raw)
            elif k.startswith("next_idle:"):
                idle[k[len("next_idle:"):]] = num(k, raw)
        return cls(version=num("version", fields["version"], int), ts=num("ts", fields["ts"]),
                   epoch=num("epoch", fields.get("epoch", "-1"), int),
                   horizon_s=num("horizon_s", fields.get("horizon_s", "2")), factors=factors, busy=busy,
                   next_idle_s=idle)


class CorrectedWhatIf(WhatIf):
    """The library's what-if with multiplicative correction factors per device kind (:meth:`set_factors`); with
    none set it is the plain, uncorrected :class:`WhatIf`."""

    def __init__(self, links: dict[str, dict[str, object]] | None = None, params=None) -> None:
        super().__init__(links, params)
        self._corr: dict[str, tuple[tuple[str, float], ...]] = {}
        self._cache: dict[tuple, tuple[tuple, ModelCost]] = {}

    def set_factors(self, factors: Mapping[str, Mapping[str, float]]) -> None:
        """Use these factors (device kind -> segment kind or ``kind@bucket`` -> factor) from now on; ``{}`` goes
        back to the uncorrected cost model. Call between decisions, not inside one."""
        self._corr = {kind: tuple(sorted((op, round(float(f), 2)) for op, f in ops.items()))
                      for kind, ops in factors.items() if ops}

    @property
    def factors(self) -> dict[str, dict[str, float]]:
        """The factors in use (empty: uncorrected)."""
        return {kind: dict(ops) for kind, ops in self._corr.items()}

    def cost(self, tenant: TenantState, kind: str) -> ModelCost:
        corr = self._corr.get(kind)
        if not corr:
            return super().cost(tenant, kind)
        key = (tenant.model, kind)
        hit = self._cache.get(key)
        if hit is None or hit[0] != corr:  # rebuilt only when a factor moved
            hit = self._cache[key] = (corr, cost_for(tenant.model, kind).with_correction(dict(corr)))
        return hit[1]


def steer_snapshot(snap: ClusterSnapshot, copy: SteeringCopy, busy_ratio: float = BUSY_RATIO) -> list[str]:
    """Mark the devices the copy's forecast predicts busy for at least ``busy_ratio`` of its horizon as busy (a
    device the scheduler already sees busy stays so: the forecast only adds what is coming), with ``busy_until_s``
    at the forecast's next idle slice; returns the devices it marked."""
    marked = []
    for d, ratio in copy.busy.items():
        dev = snap.devices.get(d)
        if dev is None or ratio < busy_ratio:
            continue
        dev.busy_until_s = max(dev.busy_until_s, copy.ts + copy.next_idle_s.get(d, copy.horizon_s))
        if not dev.busy:
            dev.busy = True
            marked.append(d)
    return marked
