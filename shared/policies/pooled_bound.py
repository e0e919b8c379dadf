"""``pooled-bound`` (simulation only): the whole cluster as one pool, no transfer or memory limits for weights.

Any device may serve any tenant at once, with no weight loading, staging or switching cost; each device keeps the
KV budget of a container device (its starting tenant's weights stay reserved) so the bound does not come from
extra KV memory. Devices time-slice the engines they hold round-robin, one iteration at a time. A request goes to
the device with the fewest outstanding requests, preferring devices already running its tenant (to batch) unless
they are ``affinity_slack`` requests busier. It is the ceiling ratios are read against, not a real policy.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig
from shared.policies.container import container_placement
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class PooledBoundConfig(PolicyConfig):
    affinity_slack: int = 4


@POLICIES.register("pooled-bound")
class PooledBoundPolicy(Policy):
    """Every device serves every tenant, for free; the upper bound."""

    config_cls = PooledBoundConfig
    simulation_only = True

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        homes = container_placement(snapshot, offered, True)
        return Placement({d: (t,) for t, ds in homes.items() for d in ds}, sharing="round_robin",
                         dynamic_engines=True, weights_free=True)

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        slack = self.config.affinity_slack  # type: ignore[attr-defined]
        best, best_key = None, None
        for d in snapshot.devices.values():
            load = d.queued + d.running
            if not d.outstanding_by_tenant.get(tenant):
                load += slack
            key = (load, d.queued_prefill_tokens)
            if best_key is None or key < best_key:
                best, best_key = d.id, key
        return best
