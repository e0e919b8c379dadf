"""``pooled`` (simulation only): the whole cluster as one pool, no transfer or memory limits for weights.

An optimistic reference, not a bound (``pooled-bound`` is the analytic ceiling, :mod:`shared.sim.ceiling`): with
per-request SLA targets its mixing of tenants on one device can stall their decodes, and ``slice`` sustains more on
some workloads.


Any device may serve any tenant at once, with no weight loading, staging or switching cost; each device keeps the
KV budget of a container device (its starting tenant's weights stay reserved) so the bound does not come from
extra KV memory. Devices time-slice the engines they hold round-robin, one iteration at a time. A request goes to
the device with the shortest predicted wait for its first token (prompt tokens queued there, plus its own, at the
device's prefill rate), a device busy with other tenants counting ``mix_penalty`` longer per other tenant so that
tenants batch where they already run; but first the tenant's own least-loaded device whenever the predicted wait
there is within ``stay_fraction`` of its TTFT target (spreading a tenant that its own devices serve in time only
slows its decoding where devices alternate between engines: without that rule the bound fell below ``container``
on the ServeGen workload). ``order`` chooses how a device orders the engines it holds: earliest SLA deadline first
(``edf``, the default) or round robin.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.costmodel import cost_for
from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, PolicyConfigError
from shared.policies.container import container_placement
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class PooledConfig(PolicyConfig):
    mix_penalty: float = 1.0
    decode_s_per_seq: float = 0.0005  # wait added per sequence already decoding there
    stay_fraction: float = 0.5  # home device first while its predicted wait is under this fraction of the TTFT target
    order: str = "edf"  # how a device orders the engines it holds: edf (earliest SLA deadline) or round_robin


@POLICIES.register("pooled")
class PooledPolicy(Policy):
    """Every device serves every tenant, for free (an optimistic reference, not a bound)."""

    config_cls = PooledConfig
    simulation_only = True
    simulation_only_why = "weights free on every device"

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        cfg: PooledConfig = self.config  # type: ignore[assignment]
        if cfg.order not in ("edf", "round_robin"):
            raise PolicyConfigError(f"pooled: order must be edf or round_robin, not {cfg.order!r}")
        homes = container_placement(snapshot, offered, False)
        return Placement({d: (t,) for t, ds in homes.items() for d in ds}, sharing=cfg.order,
                         dynamic_engines=True, weights_free=True)

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        cfg: PooledConfig = self.config  # type: ignore[assignment]
        ten = snapshot.tenants[tenant]
        model = ten.model
        best, best_key = None, None
        if cfg.stay_fraction > 0:
            budget = cfg.stay_fraction * self.request_targets(ten)(input_tokens, output_tokens)[0]
            for d in snapshot.devices.values():
                if d.home_tenant != tenant:
                    continue
                wait = (d.queued_prefill_tokens + input_tokens) * self._per_token(model, d.kind) \
                    + d.running * cfg.decode_s_per_seq
                if wait <= budget and (best_key is None or (wait, d.id) < best_key):
                    best, best_key = d.id, (wait, d.id)
            if best is not None:
                return best
        for d in snapshot.devices.values():
            per_token = self._per_token(model, d.kind)
            others = sum(1 for t, n in d.outstanding_by_tenant.items() if n and t != tenant)
            wait = ((d.queued_prefill_tokens + input_tokens) * per_token + d.running * cfg.decode_s_per_seq) \
                * (1.0 + cfg.mix_penalty * others)
            key = (wait, d.id)
            if best_key is None or key < best_key:
                best, best_key = d.id, key
        return best

    def _per_token(self, model, kind: str) -> float:
        cache = self.__dict__.setdefault("_pt", {})
        key = (id(model), kind)
        if key not in cache:
            cache[key] = cost_for(model, kind).prefill_time(2048) / 2048
        return cache[key]


@POLICIES.register("pooled-bound")
class PooledBound(Policy):
    """The analytic ceiling (:mod:`shared.sim.ceiling`): computed from the workload, never simulated or run live.
    ``slicesched simulate`` and ``bench compare`` evaluate it by name."""

    simulation_only = True
    simulation_only_why = "an analytic bound computed from a workload"
    analytic = True

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        raise PolicyConfigError("pooled-bound is an analytic bound: evaluate it with shared.sim.ceiling, not the "
                                "simulator")
