"""``pooled-bound`` (simulation only): the whole cluster as one pool, no transfer or memory limits for weights.

Any device may serve any tenant at once, with no weight loading, staging or switching cost; each device keeps the
KV budget of a container device (its starting tenant's weights stay reserved) so the bound does not come from
extra KV memory. Devices time-slice the engines they hold round-robin, one iteration at a time. A request goes to
the device with the shortest predicted wait for its first token (prompt tokens queued there, plus its own, at the
device's prefill rate), a device busy with other tenants counting ``mix_penalty`` longer per other tenant so that
tenants batch where they already run; but first the tenant's own least-loaded device whenever the predicted wait
there is within ``stay_fraction`` of its TTFT target (spreading a tenant that its own devices serve in time only
slows its decoding where devices alternate between engines: without that rule the bound fell below ``container``
on the ServeGen workload). It is the ceiling ratios are read against, not a real policy.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.costmodel import cost_for
from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig
from shared.policies.container import container_placement
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class PooledBoundConfig(PolicyConfig):
    mix_penalty: float = 1.0
    decode_s_per_seq: float = 0.0005  # wait added per sequence already decoding there
    stay_fraction: float = 0.5  # home device first while its predicted wait is under this fraction of the TTFT target


@POLICIES.register("pooled-bound")
class PooledBoundPolicy(Policy):
    """Every device serves every tenant, for free; the upper bound."""

    config_cls = PooledBoundConfig
    simulation_only = True

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        homes = container_placement(snapshot, offered, False)
        return Placement({d: (t,) for t, ds in homes.items() for d in ds}, sharing="round_robin",
                         dynamic_engines=True, weights_free=True)

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        cfg: PooledBoundConfig = self.config  # type: ignore[assignment]
        model = snapshot.tenants[tenant].model
        best, best_key = None, None
        if cfg.stay_fraction > 0:
            budget = cfg.stay_fraction * snapshot.tenants[tenant].sla.ttft_ms / 1e3
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
