"""The measured side of ``slicesched bench accuracy``: run the real CPU mesh on a workload and collect what the
simulator is compared against.

The mesh (private Redis, every service, real torch compute on the CPU workers) is started with the
:class:`~services.launcher.Launcher`; the workload's arrivals are replayed open loop through the gateway
(:mod:`loadgen.replay`: TTFT/TPOT measured at the client). Afterwards the whole events stream is read with XRANGE:
``StepReport`` (per-segment timings aggregated per (segment, tokens bucket)) and ``WorkerHeartbeat`` (KV and
weight bytes per device every 0.5 s). Everything is returned as plain data (:class:`MeshMeasurement`) so a run
can be saved and analysed again without the mesh.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from shared.config import ClusterConfig, TenantsConfig, load_cluster, load_tenants
from shared.workload import Workload, WorkloadRequest

log = structlog.get_logger(__name__)
HOLD_GROUP = "accuracy-bench"


@dataclass
class SegmentBucket:
    """Measured executions of one segment name in one batch-tokens bucket, summed over a run."""

    device: str
    tenant: str
    segment: str
    tokens_bucket: int
    count: int = 0
    total_ms: float = 0.0
    sumsq_ms: float = 0.0

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.count if self.count else 0.0

    @property
    def std_ms(self) -> float:
        """Per-execution standard deviation (from the sum of squares)."""
        if self.count < 2:
            return 0.0
        var = max(0.0, self.sumsq_ms / self.count - self.mean_ms ** 2)
        return var ** 0.5 * (self.count / (self.count - 1)) ** 0.5


@dataclass
class MeshMeasurement:
    """Everything measured in one mesh run (times relative to the replay start, ``t0_ts``)."""

    t0_ts: float
    requests: list[dict[str, Any]]  # loadgen RequestRecord.to_dict() plus nothing else
    segments: list[SegmentBucket]
    memory: dict[str, list[tuple[float, int]]]  # device -> [(t_s, weight + KV bytes)]
    capacity_bytes: dict[str, int]
    busy_s: dict[str, float]
    steps: dict[str, int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"] = {k: [list(p) for p in v] for k, v in self.memory.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeshMeasurement":
        return cls(t0_ts=d["t0_ts"], requests=list(d["requests"]),
                   segments=[SegmentBucket(**s) for s in d["segments"]],
                   memory={k: [(float(t), int(b)) for t, b in v] for k, v in d["memory"].items()},
                   capacity_bytes={k: int(v) for k, v in d["capacity_bytes"].items()},
                   busy_s=dict(d["busy_s"]), steps=dict(d["steps"]), meta=dict(d.get("meta", {})))


def read_events(redis_url: str, prefix: str, t0_ts: float,
                since_ts: float = 0.0) -> tuple[list[SegmentBucket], dict, dict, dict, dict]:
    """XRANGE over the events stream: per-(device, segment, bucket) sums, memory timeline per device,
    device capacities, busy seconds and step counts (events stamped before ``since_ts`` are skipped)."""
    import redis as syncredis

    from shared.codec import DecodeError, decode
    from shared.messages import EventsMsg, StepReport, WorkerHeartbeat, events_stream
    from shared.streams import entry_payload

    r = syncredis.Redis.from_url(redis_url, socket_timeout=10)
    buckets: dict[tuple[str, str, int], SegmentBucket] = {}
    memory: dict[str, list[tuple[float, int]]] = {}
    capacity: dict[str, int] = {}
    busy: dict[str, float] = {}
    steps: dict[str, int] = {}
    try:
        start = "-"
        while True:
            batch = r.xrange(events_stream(prefix), min=start, max="+", count=2000)
            if not batch:
                break
            for entry_id, fields in batch:
                payload = entry_payload(fields)
                if payload is None:
                    continue
                try:
                    msg = decode(payload, EventsMsg)
                except DecodeError:
                    continue
                if isinstance(msg, WorkerHeartbeat):
                    if msg.ts < since_ts:
                        continue
                    memory.setdefault(msg.device, []).append((msg.ts - t0_ts, msg.weight_bytes + msg.kv_used_bytes))
                    capacity[msg.device] = msg.capacity_bytes
                elif isinstance(msg, StepReport):
                    if msg.window_end_ts < since_ts:
                        continue
                    busy[msg.device] = busy.get(msg.device, 0.0) + msg.busy_ms / 1e3
                    steps[msg.device] = steps.get(msg.device, 0) + msg.steps
                    for st in msg.segments:
                        key = (msg.device, st.segment, st.tokens_bucket)
                        b = buckets.get(key)
                        if b is None:
                            b = buckets[key] = SegmentBucket(msg.device, msg.tenant, st.segment, st.tokens_bucket)
                        b.count += st.count
                        b.total_ms += st.total_ms
                        b.sumsq_ms += st.sumsq_ms
            last = batch[-1][0].decode() if isinstance(batch[-1][0], bytes) else batch[-1][0]
            start = "(" + last
    finally:
        r.close()
    for pts in memory.values():
        pts.sort()
    return list(buckets.values()), memory, capacity, busy, steps


def hold_events(redis_url: str, prefix: str) -> None:
    """Create an idle consumer group on the events stream: consumers trim only below every group's last
    delivered id (``shared.streams.safe_trim``), so the whole run stays readable with XRANGE afterwards."""
    import redis as syncredis

    from shared.messages import events_stream

    r = syncredis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        r.xgroup_create(events_stream(prefix), HOLD_GROUP, id="0", mkstream=True)
    except syncredis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    finally:
        r.close()


def _replay(gateway_url: str, requests: list[WorkloadRequest], tenants: TenantsConfig, tenants_file: str,
            timeout_s: float) -> tuple[list, float]:
    from loadgen.prompts import synthesizer_for
    from loadgen.replay import ReplayOptions, replay
    from loadgen.runner import load_keys

    keys = load_keys(tenants, None, tenants_file)
    synths = {t.name: synthesizer_for(t) for t in tenants.tenants}
    opts = ReplayOptions(url=gateway_url, keys=keys, synthesizers=synths, timeout_s=timeout_s, progress=False)
    result = asyncio.run(replay(requests, opts))
    # replay() schedules arrival 0 at its start + 50 ms (see loadgen.replay)
    return result.records, result.started_ts + 0.05


def _warm_up(gateway_url: str, tenants: TenantsConfig, tenants_file: str) -> None:
    """One short request per tenant so first-request costs (allocation, lazy imports) stay out of the run."""
    reqs = [WorkloadRequest(f"warmup-{t.name}", 0.0, t.name, 16, 4) for t in tenants.tenants]
    _replay(gateway_url, reqs, tenants, tenants_file, 60.0)


def run_mesh(cluster_file: str, tenants_file: str, workload: Workload, *, settle_s: float = 1.5,
             timeout_s: float = 120.0) -> MeshMeasurement:
    """Start the mesh, replay ``workload``'s requests, read the events stream, stop; returns the measurement."""
    from services.launcher import Launcher

    cluster: ClusterConfig = load_cluster(cluster_file)
    tenants = load_tenants(tenants_file, cluster)
    prefix = "acc:"
    with tempfile.TemporaryDirectory(prefix="slicesched-accuracy-") as tmp:
        launcher = Launcher(cluster, cluster_file=str(Path(cluster_file).resolve()),
                            tenants_file=str(Path(tenants_file).resolve()), data_dir=Path(tmp), gateway_port=0,
                            prefix=prefix)
        t_start = time.perf_counter()
        launcher.start()
        log.info("accuracy_mesh_up", gateway=launcher.gateway_url, start_s=round(time.perf_counter() - t_start, 2))
        try:
            hold_events(launcher.redis_url, prefix)
            _warm_up(launcher.gateway_url, tenants, tenants_file)
            time.sleep(settle_s)  # heartbeats and step reports of the warm-up land before t0
            warm_end = time.time()
            records, t0_ts = _replay(launcher.gateway_url, list(workload.requests), tenants, tenants_file, timeout_s)
            time.sleep(settle_s)  # the last step reports (flushed with each heartbeat) reach the stream
            segs, memory, capacity, busy, steps = read_events(launcher.redis_url, prefix, t0_ts, warm_end)
        finally:
            launcher.stop(drain_s=10)
    return MeshMeasurement(t0_ts=t0_ts, requests=[r.to_dict() for r in records], segments=segs, memory=memory,
                           capacity_bytes=capacity, busy_s=busy, steps=steps,
                           meta={"warm_end_s": warm_end - t0_ts, "cluster": cluster_file, "tenants": tenants_file})
