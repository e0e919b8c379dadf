"""Key names of the GMG in Redis. Every GMG key carries the ``{gmg}`` hash tag, so any Lua script or MULTI over
GMG keys stays in one Redis Cluster slot (atomic memory checks, consistent snapshots).

The field layout of each key is documented in ``docs/redis-schema.md``.
"""
from __future__ import annotations

# key kinds a follower recognises, by the first component after ``{gmg}:``
KEY_KINDS = ("device", "devices", "reservations", "resident", "tenant", "tenants", "model", "lease", "leases",
             "epoch", "changes", "exec", "reqs", "finished", "busy", "pins")


class GMGKeys:
    """Builds (and parses) the names of GMG keys under one namespace prefix."""

    def __init__(self, prefix: str) -> None:
        self.p = prefix
        self.base = f"{prefix}{{gmg}}:"

    def device(self, device: str) -> str:  # hash: kind, backend, host, capacity, limit, used, reserved, state, ...
        return f"{self.base}device:{device}"

    @property
    def devices(self) -> str:  # set of device ids
        return f"{self.base}devices"

    def reservations(self, device: str) -> str:  # hash: owner -> "kind|tenant|bytes|ts"
        return f"{self.base}reservations:{device}"

    def resident(self, device: str) -> str:  # hash: "tenant|segment" -> bytes  (weights resident on the device)
        return f"{self.base}resident:{device}"

    def tenant(self, name: str) -> str:  # hash: model, sla_ttft_ms, sla_tpot_ms, home_devices, ...
        return f"{self.base}tenant:{name}"

    @property
    def tenants(self) -> str:
        return f"{self.base}tenants"

    def model_graph(self, tenant: str) -> str:  # msgpack of ModelGraph.to_dict()
        return f"{self.base}model:{tenant}:graph"

    def pins(self, device: str) -> str:  # hash: "tenant|segment" -> active leases using those staged weights
        return f"{self.base}pins:{device}"

    def lease(self, lease_id: str) -> str:  # hash: tenant, guest, segments, start_ts, end_ts, nbytes, state, ...
        return f"{self.base}lease:{lease_id}"

    def leases(self, device: str) -> str:  # zset lease_id by end_ts (active leases on a guest device)
        return f"{self.base}leases:{device}"

    @property
    def epoch(self) -> str:
        return f"{self.base}epoch"

    @property
    def changes(self) -> str:  # stream of GMG changes for followers
        return f"{self.base}changes"

    def exec_state(self, device: str) -> str:  # hash: running, queued, busy_ratio, last_step_ts, ...
        return f"{self.base}exec:{device}"

    def requests(self, device: str) -> str:  # hash: request_id -> "tenant|state|ts" (requests on the device)
        return f"{self.base}reqs:{device}"

    def finished(self, device: str) -> str:  # zset: "request_id|tenant|outcome" by finish ts (recent only)
        return f"{self.base}finished:{device}"

    def busy(self, device: str) -> str:  # zset: "start_ts:end_ts" by end_ts (recent busy intervals)
        return f"{self.base}busy:{device}"

    def parse(self, key: str) -> tuple[str, str]:
        """Split a GMG key into (kind, id): ``…{gmg}:device:d0`` -> ("device", "d0"); ("", "") if not a GMG key."""
        if not key.startswith(self.base):
            return "", ""
        rest = key[len(self.base):]
        kind, _, ident = rest.partition(":")
        if kind == "model":
            ident = ident.rsplit(":", 1)[0]
        return kind, ident
