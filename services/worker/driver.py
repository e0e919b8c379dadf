"""The driver role: send leased segments of the home tenant's steps to guests, and serve the home's weights to
guests that stage them.

:class:`DriverLink` is one lease seen from the home: its connection to the guest and what was measured on it.
:class:`LeaseRemote` is the :class:`~shared.model.pipeline.RemoteSegments` of one step: it submits calls on the
links' connections and collects them within a bound (``timeout_factor`` × the segment's measured round trip,
at least ``timeout_floor_ms``); a timeout, an error reply or a dead connection makes the pipeline run that
segment locally. A link that timed out cools down for ``cooldown_s`` (every segment of it runs at home meanwhile)
and a link whose connection failed is rebuilt by the lease agent.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog
import torch

from services.worker.segment_server import Reply, SegmentClient, TensorMover
from services.worker.segment_wire import FrameError, WeightsQuery, WeightTensor, wire_dtype
from shared.messages import LeaseGranted
from shared.model.llama import LlamaModel
from shared.model.pipeline import MIN_MICRO_BATCH_ROWS as MIN_ROWS

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DriverOptions:
    """Bounds of remote segment calls (``docs/guest-execution.md``)."""

    micro_batches: int = 2
    timeout_factor: float = 8.0
    timeout_floor_ms: float = 25.0
    timeout_cap_ms: float = 2000.0
    cooldown_s: float = 1.0


@dataclass
class DriverLink:
    """One lease as seen by its driver."""

    lease: LeaseGranted
    state: str = "connecting"  # connecting | ready | broken | ended
    client: SegmentClient | None = None
    rtt_ms: dict[tuple[str, int], float] = field(default_factory=dict)  # EWMA per (segment kind, rows)
    cooldown_until: float = 0.0
    calls: int = 0
    fallbacks: int = 0
    timeouts: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    on_broken: Callable[["DriverLink"], None] | None = None

    def usable(self, now: float) -> bool:
        lz = self.lease
        return (self.state == "ready" and self.client is not None and lz.start_ts - 1.0 <= now < lz.end_ts
                and time.monotonic() >= self.cooldown_until)

    def timeout_s(self, key: tuple[str, int], opts: DriverOptions) -> float:
        pred = self.rtt_ms.get(key)
        if pred is None and self.rtt_ms:  # a new batch size: the slowest one measured so far
            pred = max(self.rtt_ms.values())
        ms = opts.timeout_floor_ms if pred is None else max(opts.timeout_floor_ms, opts.timeout_factor * pred)
        return min(ms, opts.timeout_cap_ms) / 1e3

    def warm_up(self, client: SegmentClient, mover: TensorMover, hidden_size: int, dtype: torch.dtype,
                timeout_s: float = 5.0) -> str:
        """One call on a fresh connection (guest thread start-up, first kernels) that also seeds the round-trip
        estimate; returns the guest's error code, or "" when it answered."""
        x = torch.zeros(MIN_ROWS, hidden_size, dtype=dtype)
        t0 = time.monotonic()
        cid = client.call(self.lease.lease_id, self.lease.tenant, self.lease.segments[0], -1, x, mover,
                          self.lease.guest_device, timeout_s)
        res, _ = client.result(cid, t0 + timeout_s)
        if not res.error:
            self.rtt_ms[(self.lease.segments[0].split("[", 1)[0], MIN_ROWS)] = (time.monotonic() - t0) * 1e3
        return res.error

    def broken(self, why: str) -> None:
        if self.state == "ready":
            self.state = "broken"
            log.info("lease_link_broken", lease_id=self.lease.lease_id, guest=self.lease.guest_device, reason=why)
            if self.client is not None:
                self.client.close()
            if self.on_broken is not None:
                self.on_broken(self)


@dataclass
class _Ticket:
    link: DriverLink
    call_id: int
    key: tuple[str, int]
    deadline: float
    t0: float


class LeaseRemote:
    """The guests available to one step: segment name → link."""

    def __init__(self, routes: dict[str, DriverLink], mover: TensorMover, device: torch.device,
                 opts: DriverOptions) -> None:
        self.routes, self.mover, self.device, self.opts = routes, mover, device, opts

    def remote(self, name: str) -> bool:
        link = self.routes.get(name)
        return link is not None and link.state == "ready" and time.monotonic() >= link.cooldown_until

    def submit(self, name: str, micro_batch: int, hidden: torch.Tensor) -> _Ticket | None:
        link = self.routes[name]
        key = (name.split("[", 1)[0], int(hidden.shape[0]))
        timeout = link.timeout_s(key, self.opts)
        t0 = time.monotonic()
        try:
            cid = link.client.call(link.lease.lease_id, link.lease.tenant, name, micro_batch, hidden, self.mover,
                                   link.lease.guest_device, timeout)  # type: ignore[union-attr]
        except (OSError, FrameError, TimeoutError) as e:
            link.fallbacks += 1
            link.broken(repr(e))
            return None
        link.calls += 1
        return _Ticket(link, cid, key, t0 + timeout, t0)

    def collect(self, ticket: _Ticket) -> torch.Tensor | None:
        link = ticket.link
        try:
            res, payload = link.client.result(ticket.call_id, ticket.deadline)  # type: ignore[union-attr]
            if res.error:
                link.errors[res.error] = link.errors.get(res.error, 0) + 1
                link.fallbacks += 1
                if res.error == "lease_inactive":
                    link.state = "ended"
                elif res.error == "busy":  # the guest's own work holds its device: it will for a while
                    link.cooldown_until = time.monotonic() + self.opts.cooldown_s
                return None
            out = self.mover.unpack(res.shape, res.dtype, res.handle, payload, self.device)
        except TimeoutError:
            link.timeouts += 1
            link.fallbacks += 1
            link.cooldown_until = time.monotonic() + self.opts.cooldown_s
            log.info("remote_segment_timeout", lease_id=link.lease.lease_id, guest=link.lease.guest_device,
                     timeout_ms=round((ticket.deadline - ticket.t0) * 1e3, 1))
            return None
        except (OSError, FrameError) as e:
            link.fallbacks += 1
            link.broken(repr(e))
            return None
        rtt = (time.monotonic() - ticket.t0) * 1e3
        prev = link.rtt_ms.get(ticket.key)
        link.rtt_ms[ticket.key] = rtt if prev is None else 0.8 * prev + 0.2 * rtt
        return out


class HomeWeights:
    """Serves the home tenant's segment weights to guests holding a lease of it (bit-identical staging)."""

    def __init__(self, tenant: str, model: LlamaModel, mover: TensorMover, keep_s: float = 30.0) -> None:
        self.tenant, self.model, self.mover, self.keep_s = tenant, model, mover, keep_s
        self._leases: dict[str, tuple[str, frozenset[str], float]] = {}  # id -> (guest, segments, end_ts)
        self._lock = threading.Lock()

    def allow(self, lease: LeaseGranted) -> None:
        """Let the lease's guest fetch its segments (until ``keep_s`` after the window)."""
        with self._lock:
            self._leases[lease.lease_id] = (lease.guest_device, frozenset(lease.segments), lease.end_ts)
            now = time.time()
            for lid in [k for k, v in self._leases.items() if v[2] + self.keep_s < now]:
                del self._leases[lid]

    def handle(self, q: WeightsQuery) -> Reply:
        """One frame per tensor of the segment, or one refusal."""
        with self._lock:
            known = self._leases.get(q.lease_id)
        if q.tenant != self.tenant:
            return [(WeightTensor(segment=q.segment, error="not_home"), b"")]
        if known is None or known[0] != q.guest_device or q.segment not in known[1]:
            return [(WeightTensor(segment=q.segment, error="unknown_lease"), b"")]
        state = self.model.segment_state_dict(q.segment)
        out: Reply = []
        for i, (name, t) in enumerate(state.items()):
            t = t.contiguous()
            handle, body = self.mover.pack(t, q.guest_device)
            out.append((WeightTensor(segment=q.segment, name=name, shape=list(t.shape), dtype=wire_dtype(t),
                                     handle=handle, last=i == len(state) - 1), body))
        return out


def fetch_weights(client: SegmentClient, mover: TensorMover, q: WeightsQuery,
                  timeout_s: float = 30.0) -> dict[str, torch.Tensor]:
    """Ask a home worker for one segment's tensors (Hugging Face names); ``RuntimeError`` if it refuses."""
    # an inline tensor shares its frame's buffer, which nothing else uses
    return {msg.name: mover.unpack(msg.shape, msg.dtype, msg.handle, payload, "cpu", timeout_s=timeout_s)
            for msg, payload in client.tensor_replies(q, WeightTensor, lambda m: m.segment == q.segment,
                                                      f"weights of {q.segment}", timeout_s)}
