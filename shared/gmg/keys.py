"""Key names of the GMG in Redis. Keys that one Lua script touches together share the ``{gmg}`` hash tag so the
atomic memory check stays in one Redis Cluster slot."""
from __future__ import annotations


class GMGKeys:
    def __init__(self, prefix: str) -> None:
        self.p = prefix
        self.base = f"{prefix}{{gmg}}:"

    def device(self, device: str) -> str:  # hash: kind, backend, host, capacity, limit, used, reserved, home_tenant, state, heartbeat_ts
        return f"{self.base}device:{device}"

    @property
    def devices(self) -> str:  # set of device ids
        return f"{self.base}devices"

    def reservations(self, device: str) -> str:  # hash: owner -> "kind|tenant|bytes|ts"
        return f"{self.base}reservations:{device}"

    def resident(self, device: str) -> str:  # hash: "tenant|segment" -> bytes  (weights resident on the device)
        return f"{self.base}resident:{device}"

    def tenant(self, name: str) -> str:  # hash: model, sla_ttft_ms, sla_tpot_ms, home_devices, queued, running
        return f"{self.base}tenant:{name}"

    @property
    def tenants(self) -> str:
        return f"{self.base}tenants"

    def model_graph(self, tenant: str) -> str:  # msgpack of ModelGraph.to_dict()
        return f"{self.base}model:{tenant}:graph"

    def lease(self, lease_id: str) -> str:
        return f"{self.base}lease:{lease_id}"

    def leases(self, device: str) -> str:  # zset lease_id by end_ts
        return f"{self.base}leases:{device}"

    @property
    def epoch(self) -> str:
        return f"{self.base}epoch"

    @property
    def changes(self) -> str:  # stream of GMG changes for followers
        return f"{self.base}changes"

    def exec_state(self, device: str) -> str:  # hash: running, queued, busy_ratio, last_step_ts, ...
        return f"{self.base}exec:{device}"
