"""The guest role: stage another tenant's segment weights, serve its driver's segment calls under a lease.

Staged weights live in per-tenant partial models (:meth:`LlamaModel.partial`) and stay cached after a lease ends,
in LRU order, until the device's own tenant needs the memory (:meth:`StagedWeights.evictable`). A call runs only
for an active, staged lease, under :class:`DeviceLock` (home work first, the lease's share bounds guest time).
A revoked lease stops being served: a call already running finishes, later calls are refused.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import structlog
import torch

from services.worker.device_lock import DeviceBusy, DeviceLock
from services.worker.segment_server import Reply, TensorMover
from services.worker.segment_wire import (LeaseStatusQuery, LeaseStatusReply, SegmentCall, SegmentResult,
                                          wire_dtype)
from shared.model.config import ModelConfig
from shared.model.graph import segment_names
from shared.model.llama import LlamaModel

log = structlog.get_logger(__name__)
WeightSource = Callable[["GuestLease", str], dict[str, torch.Tensor]]


@dataclass
class GuestLease:
    """A lease this device serves as guest."""

    lease_id: str
    tenant: str
    home_device: str
    segments: tuple[str, ...]
    end_ts: float
    share: float
    state: str = "staging"  # staging | ready | ended | failed
    detail: str = ""
    served: int = 0
    busy_s: float = 0.0
    staged: list[str] = field(default_factory=list)


class StagedWeights:
    """Other tenants' segments held on this device, LRU ordered; thread-safe."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.models: dict[str, LlamaModel] = {}
        self._lru: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def has(self, tenant: str, segment: str) -> bool:
        with self._lock:
            return (tenant, segment) in self._lru

    def put(self, tenant: str, cfg: ModelConfig, segment: str, tensors: dict[str, torch.Tensor]) -> int:
        """Install a segment (checked names/shapes); returns its bytes."""
        with self._lock:
            model = self.models.get(tenant)
            if model is None or model.cfg != cfg:
                model = self.models[tenant] = LlamaModel.partial(cfg, [], self.device)
        model.load_segment(segment, {n: t.to(model.dtype) for n, t in tensors.items()})
        nbytes = model.segment_weight_bytes(segment)
        with self._lock:
            self._lru[(tenant, segment)] = nbytes
        return nbytes

    def get(self, tenant: str, segment: str) -> LlamaModel:
        with self._lock:
            self._lru.move_to_end((tenant, segment))
            return self.models[tenant]

    def drop(self, tenant: str, segment: str) -> int:
        with self._lock:
            nbytes = self._lru.pop((tenant, segment), 0)
            model = self.models.get(tenant)
        if model is not None:
            model.drop_segment(segment)
        return nbytes

    def evictable(self, pinned: set[tuple[str, str]]) -> list[tuple[str, str, int]]:
        """Unpinned staged segments, least recently used first."""
        with self._lock:
            return [(t, s, n) for (t, s), n in self._lru.items() if (t, s) not in pinned]

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._lru.values())

    def entries(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._lru)


class GuestHost:
    """Leases served by this device and the execution of their segment calls."""

    def __init__(self, device_id: str, configs: dict[str, ModelConfig], lock: DeviceLock, weights: StagedWeights,
                 source: WeightSource, mover: TensorMover, *, on_segment: Callable[[str, int, float], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.device_id, self.configs, self.lock, self.weights = device_id, configs, lock, weights
        self.source, self.mover, self.on_segment, self.clock = source, mover, on_segment, clock
        self.leases: dict[str, GuestLease] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- lease lifecycle
    def grant(self, lease_id: str, tenant: str, home_device: str, segments: list[str], end_ts: float,
              share: float) -> GuestLease:
        """Start serving a lease: stage its missing segments in the background (idempotent on ``lease_id``; a
        re-sent grant of a lease still served moves its end and share: the scheduler extended it)."""
        with self._lock:
            known = self.leases.get(lease_id)
            if known is not None:
                if known.state in ("staging", "ready"):
                    known.end_ts, known.share = max(known.end_ts, end_ts), share
                    self.lock.set_share(lease_id, share)
                return known
            lease = GuestLease(lease_id, tenant, home_device, tuple(segments), end_ts, share)
            self.leases[lease_id] = lease
        cfg = self.configs.get(tenant)
        valid = set(segment_names(cfg.num_hidden_layers)) if cfg else set()
        bad = [s for s in segments if s not in valid or s in ("embed", "head") or s.startswith("attn")]
        if cfg is None or bad:
            lease.state, lease.detail = "failed", f"unknown tenant {tenant!r}" if cfg is None else f"segments {bad}"
            log.warning("guest_lease_refused", lease_id=lease_id, tenant=tenant, detail=lease.detail)
            return lease
        self.lock.set_share(lease_id, share)
        threading.Thread(target=self._stage, args=(lease, cfg), name=f"stage-{lease_id}", daemon=True).start()
        return lease

    def revoke(self, lease_id: str, reason: str = "") -> None:
        """Stop serving a lease: a running call finishes, later ones are refused."""
        with self._lock:
            lease = self.leases.get(lease_id)
            if lease is None or lease.state == "ended":
                return
            lease.state, lease.detail = "ended", reason
        self.lock.drop(lease_id)
        if lease.served or reason != "worker_stopping":
            log.info("guest_lease_ended", lease_id=lease_id, tenant=lease.tenant, reason=reason,
                     served=lease.served, busy_ms=round(lease.busy_s * 1e3, 1))

    def close(self) -> None:
        """End every lease (staging threads stop at their next step)."""
        for lid in list(self.leases):
            self.revoke(lid, "worker_stopping")

    def expire(self) -> None:
        """End leases whose window is over."""
        now = self.clock()
        for lease in list(self.leases.values()):
            if lease.state in ("staging", "ready") and now >= lease.end_ts:
                self.revoke(lease.lease_id, "window_ended")

    def forget_ended(self, keep_s: float = 60.0) -> None:
        now = self.clock()
        with self._lock:
            for lid in [lid for lid, x in self.leases.items()
                        if x.state in ("ended", "failed") and now > x.end_ts + keep_s]:
                del self.leases[lid]

    def pinned(self) -> set[tuple[str, str]]:
        """Segments used by leases that are not over: never evicted."""
        return {(x.tenant, s) for x in list(self.leases.values()) if x.state in ("staging", "ready") for s in x.segments}

    def _stage(self, lease: GuestLease, cfg: ModelConfig) -> None:
        t0 = time.perf_counter()
        delay = 0.05
        for seg in lease.segments:
            while lease.state == "staging" and not self.weights.has(lease.tenant, seg):
                try:
                    tensors = self.source(lease, seg)
                    with self.lock.guest(None):  # copies run in the device's idle time
                        self.weights.put(lease.tenant, cfg, seg, tensors)
                except (ValueError, KeyError) as e:
                    lease.state, lease.detail = "failed", f"{seg}: {e}"
                    log.warning("guest_staging_failed", lease_id=lease.lease_id, segment=seg, error=str(e))
                    return
                except Exception as e:  # the home is unreachable or not yet aware of the lease: retry
                    if self.clock() >= lease.end_ts:
                        return
                    log.info("guest_staging_retry", lease_id=lease.lease_id, segment=seg, error=repr(e))
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            if lease.state != "staging":
                return
            lease.staged.append(seg)
        with self._lock:  # a revoke may have come in meanwhile
            if lease.state != "staging":
                return
            lease.state = "ready"
        log.info("guest_lease_ready", lease_id=lease.lease_id, tenant=lease.tenant, segments=len(lease.segments),
                 staging_ms=round((time.perf_counter() - t0) * 1e3, 1), staged_bytes=self.weights.nbytes)

    # ---------------------------------------------------------------- requests
    def handle(self, msg, payload: bytearray) -> Reply:
        """Segment calls and lease status queries (the segment server's handler)."""
        if isinstance(msg, SegmentCall):
            return [self._call(msg, payload)]
        if isinstance(msg, LeaseStatusQuery):
            lease = self.leases.get(msg.lease_id)
            if lease is None:
                return [(LeaseStatusReply(lease_id=msg.lease_id, state="unknown"), b"")]
            return [(LeaseStatusReply(lease_id=lease.lease_id, state=lease.state, staged=list(lease.staged),
                                      detail=lease.detail), b"")]
        return []

    def _call(self, call: SegmentCall, payload: bytearray):
        t_in = time.perf_counter()
        lease = self.leases.get(call.lease_id)

        def refuse(code: str):
            return SegmentResult(call_id=call.call_id, error=code), b""

        if lease is None or lease.state in ("ended", "failed") or self.clock() >= lease.end_ts:
            return refuse("lease_inactive")
        if call.tenant != lease.tenant or call.segment not in lease.segments:
            return refuse("bad_request")
        if lease.state != "ready":
            return refuse("not_staged")
        model = self.weights.get(lease.tenant, call.segment)
        if len(call.shape) != 2 or call.shape[1] != model.cfg.hidden_size or call.dtype != wire_dtype(
                torch.empty(0, dtype=model.dtype)):
            return refuse("bad_request")
        deadline = t_in + call.timeout_ms / 1e3 if call.timeout_ms > 0 else None
        try:
            hidden = self.mover.unpack(call.shape, call.dtype, call.handle, payload, model.device,
                                       timeout_s=call.timeout_ms / 1e3 or None)
        except Exception as e:  # a bad frame or a transport failure fails this call only
            log.info("guest_call_input_failed", lease_id=lease.lease_id, error=repr(e))
            return refuse("bad_request")
        try:
            with self.lock.guest(lease.lease_id, deadline) as waited:
                if lease.state != "ready":  # revoked while waiting for the device
                    return refuse("lease_inactive")
                tc = time.perf_counter()
                out = model.run_segment(call.segment, hidden)
                ms = (time.perf_counter() - tc) * 1e3
        except DeviceBusy:
            return refuse("busy")
        lease.served += 1
        lease.busy_s += ms / 1e3
        if self.on_segment is not None:
            self.on_segment(f"{lease.tenant}/{call.segment}", call.shape[0], ms)
        handle, body = self.mover.pack(out, lease.home_device)
        return SegmentResult(call_id=call.call_id, shape=list(out.shape), dtype=wire_dtype(out), handle=handle,
                             guest_ms=ms, queue_ms=waited * 1e3), body
