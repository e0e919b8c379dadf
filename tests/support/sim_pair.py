"""The small cluster the simulator-service integration tests share: three CPU devices, tenants a (c0) and b (c1)
on the tiny model, c2 free."""
from __future__ import annotations

from shared.config import parse_cluster, parse_tenants

CLUSTER = parse_cluster({"devices": [{"id": f"c{i}", "backend": "cpu", "memory_bytes": 256 << 20}
                                     for i in range(3)]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["c0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["c1"]}]})
