"""The measured side of ``slicesched bench accuracy``: run the real CPU mesh on arrivals and collect what the
simulator is compared against.

The mesh (private Redis, every service, real torch compute on the CPU workers) is started with the
:class:`~services.launcher.Launcher`; each phase's arrivals are replayed open loop through the gateway
(:mod:`loadgen.replay`: TTFT/TPOT measured at the client). Afterwards the events stream is read with XRANGE
(an idle consumer group keeps the consumers' periodic trimming from dropping it): ``StepReport`` (per-segment
timings per (segment, tokens bucket), busy time per step), ``WorkerHeartbeat`` (KV and weight bytes per device
every 0.5 s) and ``RequestFinished`` (the worker's view of each request). Everything is plain data
(:class:`MeshMeasurement`), so a run can be saved and analysed again without the mesh.
"""
from __future__ import annotations

from services.launcher import MEASURE_ENV

import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from shared.config import load_cluster, load_tenants
from shared.workload import WorkloadRequest

log = structlog.get_logger(__name__)
HOLD_GROUP = "accuracy-bench"
SETTLE_S = 1.5  # idle time after a phase: its last step reports (flushed with each heartbeat) land in the stream


@dataclass
class SegmentBucket:
    """Measured executions of one segment name in one batch-tokens bucket, summed over a phase."""

    device: str
    tenant: str
    segment: str
    tokens_bucket: int
    count: int = 0
    total_ms: float = 0.0
    sumsq_ms: float = 0.0


@dataclass
class MeshMeasurement:
    """What one phase measured. Times are seconds relative to the phase's arrival 0 (``t0_ts``)."""

    t0_ts: float
    requests: list[dict[str, Any]]  # loadgen RequestRecord.to_dict() per request
    segments: list[SegmentBucket]
    memory: dict[str, list[tuple[float, int]]]  # device -> [(t, weight + KV bytes)] from heartbeats
    capacity_bytes: dict[str, int]
    reports: list[dict[str, Any]]  # per StepReport: device, start, end, steps, busy_ms, segment_ms, segments
    worker_requests: list[dict[str, Any]]  # per RequestFinished: device, tenant, tokens, started/first/finish
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
                   reports=list(d.get("reports", [])), worker_requests=list(d.get("worker_requests", [])),
                   meta=dict(d.get("meta", {})))


def read_events(redis_url: str, prefix: str) -> list:
    """Every decodable message on the events stream, in order."""
    import redis as syncredis

    from shared.codec import DecodeError, decode
    from shared.messages import EventsMsg, events_stream
    from shared.streams import entry_payload

    r = syncredis.Redis.from_url(redis_url, socket_timeout=10)
    out, start = [], "-"
    try:
        while True:
            batch = r.xrange(events_stream(prefix), min=start, max="+", count=2000)
            if not batch:
                return out
            for _, fields in batch:
                payload = entry_payload(fields)
                if payload is None:
                    continue
                try:
                    out.append(decode(payload, EventsMsg))
                except DecodeError:
                    continue
            last = batch[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else last)
    finally:
        r.close()


def split_phase(events: list, t0_ts: float, since_ts: float, until_ts: float) -> dict[str, Any]:
    """The events stamped in [since_ts, until_ts), as MeshMeasurement fields relative to ``t0_ts``."""
    from shared.messages import RequestFinished, StepReport, WorkerHeartbeat

    buckets: dict[tuple[str, str, int], SegmentBucket] = {}
    memory: dict[str, list[tuple[float, int]]] = {}
    capacity: dict[str, int] = {}
    reports, finished = [], []
    for msg in events:
        if isinstance(msg, WorkerHeartbeat) and since_ts <= msg.ts < until_ts:
            memory.setdefault(msg.device, []).append((msg.ts - t0_ts, msg.weight_bytes + msg.kv_used_bytes))
            capacity[msg.device] = msg.capacity_bytes
        elif isinstance(msg, StepReport) and since_ts <= msg.window_end_ts < until_ts:
            seg_ms, segs = 0.0, []
            for st in msg.segments:
                segs.append([st.segment, st.tokens_bucket, st.count, st.total_ms])
                key = (msg.device, st.segment, st.tokens_bucket)
                b = buckets.get(key)
                if b is None:
                    b = buckets[key] = SegmentBucket(msg.device, msg.tenant, st.segment, st.tokens_bucket)
                b.count += st.count
                b.total_ms += st.total_ms
                b.sumsq_ms += st.sumsq_ms
                seg_ms += st.total_ms
            reports.append({"device": msg.device, "start": msg.window_start_ts - t0_ts,
                            "end": msg.window_end_ts - t0_ts, "steps": msg.steps, "busy_ms": msg.busy_ms,
                            "segment_ms": seg_ms, "segments": segs})
        elif isinstance(msg, RequestFinished) and since_ts <= msg.ts < until_ts:
            started = msg.ts - msg.e2e_ms / 1e3
            finished.append({"device": msg.device, "tenant": msg.tenant, "outcome": msg.outcome,
                             "prompt_tokens": msg.prompt_tokens, "completion_tokens": msg.completion_tokens,
                             "started": started - t0_ts, "first_token": started + msg.ttft_ms / 1e3 - t0_ts,
                             "finish": msg.ts - t0_ts})
    for pts in memory.values():
        pts.sort()
    return {"segments": list(buckets.values()), "memory": memory, "capacity_bytes": capacity,
            "reports": reports, "worker_requests": finished}


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


def replay_requests(gateway_url: str, requests: list[WorkloadRequest], tenants, tenants_file: str,
                    timeout_s: float) -> tuple[list, float]:
    """Open-loop replay through the gateway; returns the client records and the epoch time of arrival 0."""
    from loadgen.prompts import synthesizer_for
    from loadgen.replay import ReplayOptions, replay
    from loadgen.runner import load_keys

    keys = load_keys(tenants, None, tenants_file)
    synths = {t.name: synthesizer_for(t) for t in tenants.tenants}
    opts = ReplayOptions(url=gateway_url, keys=keys, synthesizers=synths, timeout_s=timeout_s, progress=False)
    result = asyncio.run(replay(requests, opts))
    # replay() schedules arrival 0 at its start + 50 ms (loadgen.replay); the clock skew is < 1 ms
    return result.records, result.started_ts + 0.05


def run_mesh(cluster_file: str, tenants_file: str, phases: list[tuple[str, list[WorkloadRequest]]], *,
             timeout_s: float = 120.0) -> dict[str, MeshMeasurement]:
    """Start the mesh, replay each phase's arrivals in turn (idle in between), read the events stream, stop."""
    from services.launcher import Launcher

    cluster = load_cluster(cluster_file)
    tenants = load_tenants(tenants_file, cluster)
    prefix = "acc:"
    windows = []
    with tempfile.TemporaryDirectory(prefix="slicesched-accuracy-") as tmp:
        launcher = Launcher(cluster, cluster_file=str(Path(cluster_file).resolve()),
                            tenants_file=str(Path(tenants_file).resolve()), data_dir=Path(tmp), gateway_port=0,
                            prefix=prefix, extra_env=MEASURE_ENV,
                            policy="container")  # what the simulator replays it with (home devices, no leases)
        t_start = time.perf_counter()
        launcher.start()
        log.info("accuracy_mesh_up", gateway=launcher.gateway_url, start_s=round(time.perf_counter() - t_start, 2))
        try:
            hold_events(launcher.redis_url, prefix)
            warm = [WorkloadRequest(f"warmup-{t.name}", 0.0, t.name, 16, 4) for t in tenants.tenants]
            replay_requests(launcher.gateway_url, warm, tenants, tenants_file, 60.0)
            time.sleep(SETTLE_S)
            for name, reqs in phases:
                since, cpu0 = time.time(), _cpu_times()
                records, t0 = replay_requests(launcher.gateway_url, reqs, tenants, tenants_file, timeout_s)
                time.sleep(SETTLE_S)
                load = {"loadavg_1m": os.getloadavg()[0], "machine_busy": _busy(cpu0, _cpu_times())}
                windows.append((name, records, t0, since, time.time(), load))
                log.info("accuracy_phase_done", phase=name, requests=len(records))
            events = read_events(launcher.redis_url, prefix)
        finally:
            launcher.stop(drain_s=10)
    return {name: MeshMeasurement(t0_ts=t0, requests=[r.to_dict() for r in records],
                                  meta={"cluster": cluster_file, "tenants": tenants_file, **load},
                                  **split_phase(events, t0, since, until))
            for name, records, t0, since, until, load in windows}


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat ((0, 0) where it is not readable)."""
    try:
        vals = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _busy(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """Fraction of all cores busy between two :func:`_cpu_times` readings (every process, ours included)."""
    return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else None
