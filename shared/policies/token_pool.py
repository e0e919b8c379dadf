"""``token-pool``: Aegaeon-style pooling, any device can switch to any tenant between tokens.

Every device starts with one tenant's weights (the container placement) and may open engines of other tenants
on demand, keeping their weights cached while memory allows (idle engines' weights are evicted first when it
does not). A device serves one tenant at a time for up to ``quantum`` iterations, then switches to the tenant
whose oldest request has waited longest; a switch costs ``switch_s`` when the weights are cached and adds the
host-to-device weight load (``weights / load_bandwidth``) when they are not. A request goes to the device where
its tenant is already active with the fewest outstanding requests, unless another device is ``spill_at``
requests less loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.costmodel import cost_for
from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig
from shared.policies.container import container_placement
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class TokenPoolConfig(PolicyConfig):
    switch_s: float = 0.02  # engine/KV context switch with weights already on the device
    load_bandwidth: float = 64.0e9  # host DRAM -> device over PCIe Gen5 (weights kept in host memory)
    spill_at: int = 8  # go to another device when it is this many requests less loaded
    quantum: int = 8  # iterations served before the device may switch tenant


@POLICIES.register("token-pool")
class TokenPoolPolicy(Policy):
    """Per-token switching of devices between tenants, with switch and load costs."""
    simulation_only = True
    simulation_only_why = ("switching a device to another tenant needs workers that load any tenant's weights, which "
                           "the live mesh does not start")

    config_cls = TokenPoolConfig

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        homes = container_placement(snapshot, offered, False)
        return Placement({d: (t,) for t, ds in homes.items() for d in ds}, sharing="switch",
                         dynamic_engines=True, quantum=self.config.quantum)  # type: ignore[attr-defined]

    def switch_cost_s(self, device_kind: str, tenant: str, resident: bool) -> float:
        cfg: TokenPoolConfig = self.config  # type: ignore[assignment]
        self._models = getattr(self, "_models", {})
        return cfg.switch_s if resident else cfg.switch_s + self._weights(device_kind, tenant) / cfg.load_bandwidth

    def _weights(self, kind: str, tenant: str) -> int:
        return self._models.get((kind, tenant), 0)

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        cfg: TokenPoolConfig = self.config  # type: ignore[assignment]
        if not hasattr(self, "_models") or not self._models:
            self._models = {(d.kind, t.name): cost_for(t.model, d.kind).weight_bytes
                            for d in snapshot.devices.values() for t in snapshot.tenants.values()}
        active, anyd = None, None
        for d in snapshot.devices.values():
            key = (d.outstanding, d.queued_prefill_tokens, d.id)
            if (d.outstanding_by_tenant.get(tenant) or tenant in d.tenants) and (active is None or key < active[0]):
                active = (key, d.id)
            if anyd is None or key < anyd[0]:
                anyd = (key, d.id)
        if active is None or anyd[0][0] + cfg.spill_at <= active[0][0]:  # type: ignore[index]
            return anyd[1]  # type: ignore[index]
        return active[1]
