"""Synthetic live state for a modelled cluster (what-if benchmark, tests): every home device ready, with its
tenant's weights and a batch of running requests reserved in the GMG. Written through the GMG store and the GMG
service's core, exactly as live workers' events would be; no workers needed. It lives in ``bench`` (which may import
any service) because the simulator service may not import the GMG service's core."""
from __future__ import annotations

import random
import time
import uuid

from shared.config import ClusterConfig, TenantsConfig
from shared.gmg import GMGStore, Reservation
from shared.gmg.lease_store import LeaseStore
from shared.messages import InferenceRequest, RequestStarted, WorkerHeartbeat
from services.gmg.core import GMGCore


async def write_synthetic_state(store: GMGStore, cluster: ClusterConfig, tenants: TenantsConfig,
                                rng: random.Random, *, running: tuple[int, int] = (8, 48),
                                mean_input: int = 1046, max_tokens: int = 256,
                                stage_guests: int = 4) -> list[InferenceRequest]:
    """Register the cluster and fill it; returns the synthetic requests (for the requests stream)."""
    await store.register_cluster(cluster, tenants)
    core, now = GMGCore(store.keys, [d.id for d in cluster.devices]), time.time()
    homes = {d: t for t in tenants.tenants for d in t.home_devices}
    reqs: list[InferenceRequest] = []
    for d in cluster.devices:
        t = homes.get(d.id)
        n = rng.randint(*running) if t else 0
        kvpt = t.model.config.kv_bytes_per_token() if t else 0
        wb = t.model.config.weight_bytes() if t else 0
        if t:
            await store.reserve([Reservation(d.id, f"weights:{t.name}:home", "weights", t.name, wb)])
        kv_used = 0
        for i in range(n):
            inp = max(16, int(rng.expovariate(1 / mean_input)))
            rid = f"syn-{d.id}-{i}-{uuid.uuid4().hex[:6]}"
            res = await store.reserve([Reservation(d.id, f"kv:{rid}", "kv", t.name, (inp + max_tokens) * kvpt)])
            if not isinstance(res, int):
                break
            kv_used += (inp + max_tokens) * kvpt
            reqs.append(InferenceRequest(msg_id=uuid.uuid4().hex, request_id=rid, tenant=t.name, gateway="bench",
                                         prompt_ids=[1] * inp, max_tokens=max_tokens, arrival_ts=now - rng.random()))
            started = RequestStarted(msg_id=uuid.uuid4().hex, request_id=rid, tenant=t.name, device=d.id,
                                     ts=now - rng.random() * 0.5)
            op, b = core.on_event(started, now)
            await store.apply(op, b)
        hb = WorkerHeartbeat(msg_id=uuid.uuid4().hex, device=d.id, worker_id="synthetic", backend=d.backend,
                             home_tenant=t.name if t else "", ts=now, capacity_bytes=d.memory_bytes,
                             weight_bytes=wb, kv_used_bytes=kv_used, running=n, queued=rng.randint(0, 3),
                             busy_ratio=rng.uniform(0.3, 1.0))
        op, b = core.on_event(hb, now)
        await store.apply(op, b)
    # a few guests already hold some MLP segments of another tenant
    leases, ids = LeaseStore(store), [d.id for d in cluster.devices]
    for i in range(min(stage_guests, len(tenants.tenants))):
        t = tenants.tenants[i]
        guest = ids[(ids.index(t.home_devices[0]) + len(ids) // 2) % len(ids)]
        seg_bytes = t.model.config.param_counts()["mlp"] * t.model.config.dtype_bytes
        await leases.stage(guest, t.name, {f"mlp[{layer}]": seg_bytes for layer in range(4)})
    return reqs
