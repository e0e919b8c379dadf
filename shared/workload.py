"""Workload data types shared by the offline simulator, the live benchmarks and the load generator.

A workload *file* (YAML) is declarative: which traces, how they map to tenants, popularity alpha, seed, duration.
``loadgen.workload`` turns the file into a :class:`Workload` (a sorted list of arrivals) deterministically;
the simulator and ``loadgen replay`` consume only these types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ClusterConfig, TenantsConfig


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One arrival: at ``arrival_s`` seconds from the start, ``tenant`` asks for ``output_tokens`` after a prompt."""

    request_id: str
    arrival_s: float
    tenant: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Arrivals sorted by time, plus the tenants they are for and where they came from."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    tenants: TenantsConfig
    duration_s: float
    seed: int
    rate_scale: float = 1.0
    source: str = "<memory>"
    cluster: ClusterConfig | None = None  # a workload file may name its cluster; CLIs may override
    meta: dict = field(default_factory=dict)

    def for_tenant(self, name: str) -> list[WorkloadRequest]:
        return [r for r in self.requests if r.tenant == name]

    def offered_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)
