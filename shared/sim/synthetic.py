"""Small synthetic clusters, tenants and workloads (for tests, examples and the what-if benchmark).

Everything is built in memory from an injected ``random.Random``; nothing reads files.
"""
from __future__ import annotations

import random

from shared.config import GIB, SLA, ClusterConfig, DeviceConfig, ModelSpec, TenantConfig, TenantsConfig
from shared.costmodel import cost_for
from shared.model.config import PRESETS
from shared.workload import Workload, WorkloadRequest


def small_cluster(n_devices: int = 4, per_host: int = 2, kind: str = "h100-80gb", memory_gb: float = 80,
                  headroom_fraction: float = 0.05) -> ClusterConfig:
    """``n_devices`` emulated devices of ``kind``, ``per_host`` per host (NVLink inside, NCCL across)."""
    devs = tuple(DeviceConfig(id=f"d{i}", backend="emulated", kind=kind, memory_bytes=int(memory_gb * GIB),
                              host=f"h{i // per_host}") for i in range(n_devices))
    return ClusterConfig(devices=devs, name="synthetic", headroom_fraction=headroom_fraction,
                         intra_host_link="nvlink", inter_host_link="nccl")


def sla_for(preset: str, kind: str = "h100-80gb", k: float = 5.0, typical: tuple[int, int] = (1046, 90)) -> SLA:
    """k × the isolated (TTFT, TPOT) of a typical request, in ms."""
    ttft, tpot = cost_for(PRESETS[preset], kind).isolated_latency(*typical)
    return SLA(ttft_ms=k * ttft * 1000, tpot_ms=k * tpot * 1000)


def small_tenants(cluster: ClusterConfig, presets: list[str], per_tenant: int = 1, k: float = 5.0) -> TenantsConfig:
    """One tenant per preset, ``per_tenant`` home devices each in cluster order, SLA k × isolated latency."""
    ids = [d.id for d in cluster.devices]
    out = []
    for i, p in enumerate(presets):
        homes = tuple(ids[(i * per_tenant + j) % len(ids)] for j in range(per_tenant))
        out.append(TenantConfig(name=f"t{i}", model=ModelSpec(config=PRESETS[p], preset=p),
                                sla=sla_for(p, cluster.devices[0].kind, k), home_devices=homes, max_queue=512))
    return TenantsConfig(tenants=tuple(out))


def bursty_workload(tenants: TenantsConfig, rates_rps: list[float], duration_s: float, rng: random.Random,
                    burst_factor: float = 4.0, burst_period_s: float = 20.0, mean_input: int = 800,
                    mean_output: int = 120, max_context: int = 4096, name: str = "synthetic") -> Workload:
    """Poisson arrivals per tenant whose rate alternates between high (×``burst_factor``) and low phases, with
    per-tenant phase offsets; lengths are exponential around the given means, capped at ``max_context``."""
    reqs: list[WorkloadRequest] = []
    for i, (t, rate) in enumerate(zip(tenants.tenants, rates_rps)):
        if rate <= 0:
            continue
        offset = rng.uniform(0, burst_period_s)
        hi, lo = rate * 2 * burst_factor / (burst_factor + 1), rate * 2 / (burst_factor + 1)
        now, n = 0.0, 0
        while True:
            phase = ((now + offset) % burst_period_s) < burst_period_s / 2
            now += rng.expovariate(hi if phase else lo)
            if now >= duration_s:
                break
            inp = min(max_context - 16, max(8, int(rng.expovariate(1 / mean_input))))
            out = min(max_context - inp, max(1, int(rng.expovariate(1 / mean_output))))
            n += 1
            reqs.append(WorkloadRequest(f"{t.name}-{n}", now, t.name, inp, out))
    reqs.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Workload(name=name, requests=tuple(reqs), tenants=tenants, duration_s=duration_s, seed=0)


def synthetic_snapshot(cluster: ClusterConfig, tenants: TenantsConfig, rng: random.Random,
                       load: float = 0.5) -> "ClusterSnapshot":
    """A snapshot with plausible random device state (queues, batches, memory) for what-if checks/benchmarks:
    each tenant at home on its configured devices, ``load`` the chance a device has a queue."""
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, TenantState
    devices = {}
    home = {h: t.name for t in tenants.tenants for h in t.home_devices}
    for d in cluster.devices:
        headroom = int(d.memory_bytes * cluster.headroom_fraction)
        st = DeviceState(d.id, d.kind, d.host, d.memory_bytes, headroom, home_tenant=home.get(d.id))
        if st.home_tenant:
            t = tenants.get(st.home_tenant)
            cost = cost_for(t.model.config, d.kind)
            st.tenants = [t.name]
            st.running = rng.randint(0, 64)
            st.decode_kv_tokens = st.running * rng.randint(200, 2500)
            busy = rng.random() < load
            st.queued = rng.randint(1, 12) if busy else 0
            st.queued_prefill_tokens = st.queued * rng.randint(300, 3000)
            st.oldest_pending_s = 100.0 - rng.uniform(0, 0.2) if st.queued else float("inf")
            st.busy = busy or st.running > 0
            st.kv_bytes = (st.decode_kv_tokens + st.queued_prefill_tokens) * cost.kv_bytes_per_token
            st.used_bytes = min(st.limit_bytes, cost.weight_bytes + st.kv_bytes)
        devices[d.id] = st
    ts = {}
    for t in tenants.tenants:
        ts[t.name] = TenantState(t.name, t.model.config, t.sla, list(t.home_devices), rate_rps=rng.uniform(0.1, 20),
                                 mean_input=rng.uniform(500, 2000), mean_output=rng.uniform(20, 250))
    return ClusterSnapshot(now=100.0, devices=devices, tenants=ts, intra_host_link=cluster.intra_host_link,
                           inter_host_link=cluster.inter_host_link)
