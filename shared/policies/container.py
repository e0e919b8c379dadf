"""``container``: static containers, a tenant's work runs only on its own devices (the main baseline).

The containers are the tenants' home devices: the tenants file's, or a partition planned for the workload under
the SLA (``slicesched plan containers``; ``bench compare`` plans one per workload and gives it to every policy). A
request goes to the device of its container with the fewest outstanding requests. Every engine uses the same
continuous batching and cost model as all policies.

``container-avgwork`` is the same policy on containers sized in proportion to each tenant's average offered work
(device-seconds of its requests, decode costed at a reference batch of 32), at least one device each: a weak
strawman kept for comparison, since it under-sizes prefill-heavy and bursty tenants.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, least_loaded
from shared.policies.sizing import assign_contiguous, device_counts, offered_work
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class ContainerConfig(PolicyConfig):
    """``resize``: size containers from average offered work (``container-avgwork``); False (the default) keeps the
    tenants' home devices."""

    resize: bool = False
    min_devices: int = 1


def container_placement(snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad], resize: bool,
                        min_devices: int = 1) -> dict[str, list[str]]:
    """tenant -> devices of its container (sized from offered work when ``resize`` and work is known)."""
    work = offered_work(offered, snapshot)
    if not resize or sum(work.values()) <= 0:
        return {t.name: list(t.home_devices) for t in snapshot.tenants.values()}
    counts = device_counts(work, len(snapshot.devices), min_devices)
    return assign_contiguous(counts, snapshot)


@POLICIES.register("container")
class ContainerPolicy(Policy):
    """Static containers; least-outstanding-requests routing inside a tenant's container."""

    config_cls = ContainerConfig

    def __init__(self, config: ContainerConfig | None = None) -> None:
        super().__init__(config)
        self.devices_of: dict[str, list[str]] = {}

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        cfg: ContainerConfig = self.config  # type: ignore[assignment]
        self.devices_of = container_placement(snapshot, offered, cfg.resize, cfg.min_devices)
        return Placement({d: (t,) for t, ds in self.devices_of.items() for d in ds})

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        devs = self.devices_of.get(tenant)
        if devs is None:
            devs = self.devices_of[tenant] = [d.id for d in snapshot.tenant_devices(tenant)]
        return least_loaded(devs, snapshot, self.config.max_queue_per_device)


@dataclass(frozen=True)
class ContainerAvgWorkConfig(ContainerConfig):
    resize: bool = True


@POLICIES.register("container-avgwork")
class ContainerAvgWorkPolicy(ContainerPolicy):
    """``container`` on containers sized by average offered work (the weak strawman; see the module docstring)."""
    simulation_only = True
    simulation_only_why = ("the live mesh runs the tenants file's home devices; average-work sizing is an offline "
                           "strawman")

    config_cls = ContainerAvgWorkConfig
