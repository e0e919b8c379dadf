"""Decisions of the GMG state service as a plain object: worker events in, GMG mutation batches out.

No Redis here: :class:`GMGCore` turns each event into a :class:`~shared.gmg.mutations.MutationBatch` (or nothing,
for duplicates, stale or out-of-order events) and keeps the little state it needs to stay idempotent: the newest
heartbeat and step window per device and the requests it has seen start and finish.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shared.gmg.keys import GMGKeys
from shared.gmg.mutations import MutationBatch
from shared.messages import DeviceDown, RequestFinished, RequestMoved, RequestStarted, StepReport, WorkerHeartbeat

HEARTBEAT_TIMEOUT_S = 3.0
BUSY_KEEP_S = 10.0  # busy intervals kept per device (what forecasts look back on)
FINISHED_KEEP_S = 60.0  # recently finished requests kept per device
SEEN_FINISHED_MAX = 20_000


@dataclass
class DeviceLive:
    """What the GMG service knows of one device's live state (loaded from Redis at start)."""

    state: str = "down"
    heartbeat_ts: float = 0.0
    seen_ts: float = 0.0  # GMG clock when the newest heartbeat arrived (staleness ignores worker clock skew)
    worker_id: str = ""
    last_step_ts: float = 0.0
    steps_total: int = 0
    busy_ms_total: float = 0.0
    running: set[str] = field(default_factory=set)


def _f(v: str | None) -> float:
    try:
        return float(v or 0)
    except ValueError:
        return 0.0


class GMGCore:
    """Turns worker events into GMG mutations; the service applies them atomically with an epoch bump."""

    def __init__(self, keys: GMGKeys, device_ids: list[str], *, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 busy_keep_s: float = BUSY_KEEP_S, finished_keep_s: float = FINISHED_KEEP_S) -> None:
        self.keys = keys
        self.timeout_s, self.busy_keep_s, self.finished_keep_s = heartbeat_timeout_s, busy_keep_s, finished_keep_s
        self.devices: dict[str, DeviceLive] = {d: DeviceLive() for d in device_ids}
        self._finished: OrderedDict[str, None] = OrderedDict()

    def load(self, device_rows: dict[str, dict[str, str]], exec_rows: dict[str, dict[str, str]],
             running: dict[str, list[str]], now: float) -> None:
        """Restore from Redis after a restart (device hashes, exec hashes, requests running per device)."""
        for did, live in self.devices.items():
            h, e = device_rows.get(did, {}), exec_rows.get(did, {})
            live.state = h.get("state", "down")
            live.heartbeat_ts = _f(h.get("heartbeat_ts"))
            live.seen_ts = now if live.state != "down" else 0.0  # give a live-looking device one full timeout
            live.worker_id = h.get("worker_id", "")
            live.last_step_ts = _f(e.get("last_step_ts"))
            live.steps_total = int(_f(e.get("steps_total")))
            live.busy_ms_total = _f(e.get("busy_ms_total"))
            live.running = set(running.get(did, []))

    def batch(self) -> MutationBatch:
        return MutationBatch(self.keys.epoch, self.keys.changes)

    # ------------------------------------------------------------ events
    def on_event(self, msg, now: float) -> tuple[str, MutationBatch] | None:
        """The change an event makes, as (op, batch); ``None`` when it changes nothing (duplicate, stale, unknown)."""
        dev = self.devices.get(getattr(msg, "device", ""))
        if dev is None:
            return None
        if isinstance(msg, WorkerHeartbeat):
            return self._heartbeat(msg, dev, now)
        if isinstance(msg, StepReport):
            return self._step(msg, dev)
        if isinstance(msg, RequestStarted):
            return self._started(msg, dev)
        if isinstance(msg, RequestFinished):
            return self._finished_req(msg, dev)
        if isinstance(msg, RequestMoved):
            return self._moved(msg, dev)
        if isinstance(msg, DeviceDown):
            return self._down(msg, dev)
        return None

    def _heartbeat(self, hb: WorkerHeartbeat, dev: DeviceLive, now: float) -> tuple[str, MutationBatch] | None:
        if hb.ts <= dev.heartbeat_ts:
            return None  # duplicate or out of order
        dev.heartbeat_ts, dev.seen_ts, dev.state, dev.worker_id = hb.ts, now, hb.state, hb.worker_id
        fields = {"state": hb.state, "heartbeat_ts": f"{hb.ts:.6f}", "worker_id": hb.worker_id,
                  "used": hb.weight_bytes + hb.kv_used_bytes, "weight_used": hb.weight_bytes,
                  "kv_used": hb.kv_used_bytes, "kv_total": hb.kv_total_bytes, "running": hb.running,
                  "queued": hb.queued, "prefill_tokens": hb.queued_prefill_tokens,
                  "busy_ratio": f"{hb.busy_ratio:.4f}", "down_reason": ""}
        if hb.capacity_bytes:
            fields["worker_capacity"] = hb.capacity_bytes
        b = self.batch().hset(self.keys.device(hb.device), fields)
        b.hset(self.keys.exec_state(hb.device), {"running": hb.running, "queued": hb.queued,
                                                  "prefill_tokens": hb.queued_prefill_tokens,
                                                  "busy_ratio": f"{hb.busy_ratio:.4f}", "worker_id": hb.worker_id})
        return "heartbeat", b

    def _step(self, sr: StepReport, dev: DeviceLive) -> tuple[str, MutationBatch] | None:
        if sr.window_end_ts <= dev.last_step_ts:
            return None
        dev.last_step_ts = sr.window_end_ts
        dev.steps_total += sr.steps
        dev.busy_ms_total += sr.busy_ms
        b = self.batch()
        b.hset(self.keys.exec_state(sr.device), {
            "tenant": sr.tenant, "window_start_ts": f"{sr.window_start_ts:.6f}",
            "last_step_ts": f"{sr.window_end_ts:.6f}", "steps": sr.steps, "busy_ms": f"{sr.busy_ms:.3f}",
            "steps_total": dev.steps_total, "busy_ms_total": f"{dev.busy_ms_total:.3f}",
            "kv_used": sr.kv_used_bytes})
        if sr.busy_intervals:
            flat: list = []
            for start, end in sr.busy_intervals:
                flat += [f"{end:.6f}", f"{start:.6f}:{end:.6f}"]
            b.add("zadd", self.keys.busy(sr.device), *flat)
            b.add("zremrangebyscore", self.keys.busy(sr.device), "-inf", f"{sr.window_end_ts - self.busy_keep_s:.6f}")
        return "step", b

    def _started(self, m: RequestStarted, dev: DeviceLive) -> tuple[str, MutationBatch] | None:
        if m.request_id in dev.running or m.request_id in self._finished:
            return None
        dev.running.add(m.request_id)
        b = self.batch().hset(self.keys.requests(m.device), {m.request_id: f"{m.tenant}|running|{m.ts:.6f}"})
        b.hset(self.keys.exec_state(m.device), {"last_started_ts": f"{m.ts:.6f}"})
        b.hset(self.keys.device(m.device), {"requests": len(dev.running)})
        b.add("hincrby", self.keys.exec_state(m.device), "started_total", 1)
        return "request_started", b

    def _finished_req(self, m: RequestFinished, dev: DeviceLive) -> tuple[str, MutationBatch] | None:
        if m.request_id in self._finished:
            return None
        self._finished[m.request_id] = None
        while len(self._finished) > SEEN_FINISHED_MAX:
            self._finished.popitem(last=False)
        dev.running.discard(m.request_id)
        b = self.batch().add("hdel", self.keys.requests(m.device), m.request_id)
        b.hset(self.keys.device(m.device), {"requests": len(dev.running)})
        b.add("zadd", self.keys.finished(m.device), f"{m.ts:.6f}", f"{m.request_id}|{m.tenant}|{m.outcome}")
        b.add("zremrangebyscore", self.keys.finished(m.device), "-inf", f"{m.ts - self.finished_keep_s:.6f}")
        b.hset(self.keys.exec_state(m.device), {"last_finished_ts": f"{m.ts:.6f}"})
        b.add("hincrby", self.keys.exec_state(m.device), "finished_total", 1)
        return "request_finished", b

    def _moved(self, m: RequestMoved, dev: DeviceLive) -> tuple[str, MutationBatch] | None:
        """A guest lane's hand-off: the request runs on ``device`` now, no longer on ``from_device``."""
        if m.request_id in self._finished or m.request_id in dev.running:
            return None
        src = self.devices.get(m.from_device)
        if src is not None:
            src.running.discard(m.request_id)
        dev.running.add(m.request_id)
        b = self.batch().add("hdel", self.keys.requests(m.from_device), m.request_id)
        b.hset(self.keys.device(m.device), {"requests": len(dev.running)})
        if src is not None:
            b.hset(self.keys.device(m.from_device), {"requests": len(src.running)})
        b.hset(self.keys.requests(m.device), {m.request_id: f"{m.tenant}|running|{m.ts:.6f}"})
        b.add("hincrby", self.keys.exec_state(m.device), "moved_in_total", 1)
        return "request_moved", b

    def _down(self, m: DeviceDown, dev: DeviceLive) -> tuple[str, MutationBatch] | None:
        if dev.state == "down":
            return None
        if m.worker_id and dev.worker_id and m.worker_id != dev.worker_id and dev.heartbeat_ts > m.ts:
            return None  # an old worker's notice after its replacement already reported in
        return self._mark_down(m.device, dev, m.reason or "device_down", m.ts)

    # ------------------------------------------------------------ sweep
    def sweep(self, now: float) -> list[tuple[str, MutationBatch]]:
        """Devices whose newest heartbeat is older than the timeout (on the GMG's clock) go ``down``."""
        out = []
        for did, dev in self.devices.items():
            if dev.state != "down" and now - dev.seen_ts > self.timeout_s:
                out.append(self._mark_down(did, dev, "heartbeat_timeout", now))
        return out

    def _mark_down(self, device: str, dev: DeviceLive, reason: str, ts: float) -> tuple[str, MutationBatch]:
        dev.state = "down"
        b = self.batch().hset(self.keys.device(device), {"state": "down", "down_reason": reason,
                                                          "down_ts": f"{ts:.6f}"})
        return "device_down", b
