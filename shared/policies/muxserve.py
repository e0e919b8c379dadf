"""``muxserve``: MuxServe-style placement from average rates, tenants co-located on shared devices.

Each tenant's demand is its share of the offered work in device units (n_devices × work_t / Σ work). Whole
units become dedicated replicas; the fractional remainders (all of a small tenant's demand) are packed first-fit
decreasing onto shared devices, within a memory budget for co-located weights so KV keeps room. A device's time
is divided between its co-located tenants in proportion to their demand (weighted sharing at iteration
granularity: an idle tenant's share goes to the others), which is how MuxServe's compute shares and
prefill/decode multiplexing let a popular model use what a cold one leaves. A request goes to the replica of its
tenant with the fewest outstanding requests per unit of share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.costmodel import cost_for
from shared.policies.actions import Placement
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, PolicyConfigError
from shared.policies.sizing import offered_work
from shared.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class MuxServeConfig(PolicyConfig):
    weights_budget: float = 0.5  # co-located weights may use at most this fraction of a device's memory
    min_fraction: float = 0.05  # smaller fractional remainders are folded into the whole units


@POLICIES.register("muxserve")
class MuxServePolicy(Policy):
    """Rate-based co-location with compute shares."""
    simulation_only = True
    simulation_only_why = ("its co-located placement needs workers holding several tenants' weights, which the live "
                           "mesh does not start")

    config_cls = MuxServeConfig

    def __init__(self, config: MuxServeConfig | None = None) -> None:
        super().__init__(config)
        self.replicas: dict[str, list[tuple[str, float]]] = {}  # tenant -> [(device, share weight)]

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        cfg: MuxServeConfig = self.config  # type: ignore[assignment]
        devs = list(snapshot.devices.values())
        n = len(devs)
        work = offered_work(offered, snapshot)
        total = sum(work.values())
        demand = {t: (n * w / total if total > 0 else n / len(work)) for t, w in work.items()}
        units: list[tuple[float, str]] = []
        for t, dmd in demand.items():
            whole = int(math.floor(dmd))
            frac = dmd - whole
            if whole and frac < cfg.min_fraction:
                frac = 0.0
            units += [(1.0, t)] * whole
            if frac > 0 or whole == 0:
                units.append((max(frac, 1e-3), t))
        units.sort(key=lambda u: (-u[0], u[1]))
        cap, most = 1.0, sum(w for w, _ in units)
        while (placed := self._pack(units, devs, snapshot, cap, cfg.weights_budget)) is None:
            if cap > most:  # load no longer limits the packing: the co-located weights cannot fit the budget
                raise PolicyConfigError(
                    f"muxserve: weights_budget {cfg.weights_budget} leaves no device room for the co-located "
                    f"weights of {len(units)} replicas on {n} devices; raise it")
            cap *= 1.05
        assign: dict[str, tuple[str, ...]] = {}
        weights: dict[tuple[str, str], float] = {}
        self.replicas = {}
        for did, items in placed.items():
            assign[did] = tuple(t for _, t in items)
            for w, t in items:
                weights[(did, t)] = w
                self.replicas.setdefault(t, []).append((did, w))
        return Placement(assign, sharing="weighted", weights=weights)

    @staticmethod
    def _pack(units, devs, snapshot, cap, budget):
        load = {d.id: 0.0 for d in devs}
        mem = {d.id: 0 for d in devs}
        out: dict[str, list[tuple[float, str]]] = {d.id: [] for d in devs}
        for w, t in units:
            wb = cost_for(snapshot.tenants[t].model, devs[0].kind).weight_bytes
            for d in devs:
                if any(x == t for _, x in out[d.id]):
                    continue  # one replica of a tenant per device
                if load[d.id] + w <= cap + 1e-9 and (not out[d.id] or mem[d.id] + wb <= budget * d.capacity_bytes):
                    out[d.id].append((w, t))
                    load[d.id] += w
                    mem[d.id] += wb
                    break
            else:
                return None
        return {d: items for d, items in out.items() if items}

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        best, best_key = None, None
        for did, w in self.replicas.get(tenant, []):
            d = snapshot.devices[did]
            if d.queued >= self.config.max_queue_per_device:
                continue
            key = ((d.outstanding_by_tenant.get(tenant, 0) + 1) / w, d.outstanding, did)
            if best_key is None or key < best_key:
                best, best_key = did, key
        return best
