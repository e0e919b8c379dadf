"""``container-realloc``: containers re-assigned between tenants every interval from recent load.

Starts from the same containers as ``container`` (the tenants' home devices: the planned partition). Every
``interval_s`` it re-apportions the devices in proportion to each tenant's container scaled by its recent load
relative to its average (measured arrival rate × mean lengths, costed on the device kind, over the same at
placement), so at average load the target is the planned partition and a tenant in a burst is owed more, and moves
at most ``max_moves`` devices from the most over-provisioned tenants to the most under-provisioned ones. A moved device stops admitting, hands its queued requests to the donor's other devices,
finishes its running requests, and then pays the weight reload time (``weights / load_bandwidth + init_s``)
before it serves the new tenant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.costmodel import cost_for
from shared.policies.actions import Action, Placement, Reassign, Trigger
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, least_loaded
from shared.policies.container import container_placement
from shared.policies.sizing import device_counts
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class ContainerReallocConfig(PolicyConfig):
    interval_s: float = 60.0
    max_moves: int = 2  # devices moved per interval
    min_deficit: float = 0.75  # recipient must be short by this many devices, donor over by as many
    load_bandwidth: float = 2.0e9  # bytes/s reading a checkpoint (local NVMe)
    init_s: float = 5.0  # engine start-up: allocator, CUDA graphs, warm-up


@POLICIES.register("container-realloc")
class ContainerReallocPolicy(Policy):
    """Work-proportional containers, periodically resized from recent load at a reload cost."""
    simulation_only = True
    simulation_only_why = "the live scheduler applies no reassignment: workers never reload another tenant's weights"

    config_cls = ContainerReallocConfig

    def __init__(self, config: ContainerReallocConfig | None = None) -> None:
        super().__init__(config)
        self.tick_s = self.config.interval_s  # type: ignore[attr-defined]
        self.devices_of: dict[str, list[str]] = {}
        self.moves = 0
        self.planned: dict[str, int] = {}  # devices per tenant at placement
        self.avg_work: dict[str, float] = {}  # average offered work per second at placement

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        self.devices_of = container_placement(snapshot, offered, False)
        self.planned = {t: len(ds) for t, ds in self.devices_of.items()}
        self.avg_work = {t: o.work_s / o.duration_s for t, o in offered.items() if o.duration_s > 0}
        return Placement({d: (t,) for t, ds in self.devices_of.items() for d in ds})

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        return least_loaded(self.devices_of.get(tenant, []), snapshot, self.config.max_queue_per_device)

    def decide(self, trigger: Trigger, snapshot: ClusterSnapshot, whatif: Any = None) -> list[Action]:
        if trigger.kind != "tick":
            return []
        cfg: ContainerReallocConfig = self.config  # type: ignore[assignment]
        kind = next(iter(snapshot.devices.values())).kind
        work = {}
        for t in snapshot.tenants.values():
            if t.rate_rps <= 0:
                work[t.name] = 0.0
                continue
            recent = t.rate_rps * cost_for(t.model, kind).request_work(int(t.mean_input), int(t.mean_output))
            avg = self.avg_work.get(t.name, 0.0)
            work[t.name] = self.planned.get(t.name, 1) * recent / avg if avg > 0 else recent
        if sum(work.values()) <= 0:
            return []
        target = device_counts(work, len(snapshot.devices), 1)
        have = {t: len(ds) for t, ds in self.devices_of.items()}
        out: list[Action] = []
        for _ in range(cfg.max_moves):
            short = max(target, key=lambda t: target[t] - have.get(t, 0))
            over = max(target, key=lambda t: have.get(t, 0) - target[t])
            if target[short] - have.get(short, 0) < cfg.min_deficit \
                    or have.get(over, 0) - target[over] < cfg.min_deficit \
                    or have.get(over, 0) <= 1:
                break
            movable = [d for d in self.devices_of[over] if not snapshot.devices[d].draining]
            if len(movable) <= 1:
                break
            dev = min(movable, key=lambda d: (snapshot.devices[d].outstanding, d))
            self.devices_of[over].remove(dev)
            self.devices_of.setdefault(short, []).append(dev)
            have[over] -= 1
            have[short] = have.get(short, 0) + 1
            wb = cost_for(snapshot.tenants[short].model, snapshot.devices[dev].kind).weight_bytes
            out.append(Reassign(dev, short, wb / cfg.load_bandwidth + cfg.init_s))
            self.moves += 1
        return out
