"""Worker bookkeeping as plain objects: request tracking, token chunk building, step aggregation."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from shared.costmodel.model_cost import tokens_bucket
from shared.messages import InferenceRequest, SegmentStat, StepReport, TokenChunk

__all__ = ["StepAggregator", "Tracked", "Tracker", "tokens_bucket"]


@dataclass
class Tracked:
    """A request running on this worker."""

    req: InferenceRequest
    entry_id: str
    kv_blocks: int
    started_ts: float
    seq: int = 0
    first_token_ts: float = 0.0
    completion_tokens: int = 0


class Tracker:
    """Requests on this worker keyed by id; builds the token chunks the gateway receives."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.items: dict[str, Tracked] = {}

    def add(self, req: InferenceRequest, entry_id: str, kv_blocks: int) -> Tracked:
        t = Tracked(req, entry_id, kv_blocks, time.time())
        self.items[req.request_id] = t
        return t

    def chunk(self, t: Tracked, token_ids: list[int], text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int, logprobs: list | None = None) -> TokenChunk:
        now = time.time()
        if token_ids and not t.first_token_ts:
            t.first_token_ts = now
        t.completion_tokens = completion_tokens
        c = TokenChunk(msg_id=uuid.uuid4().hex, request_id=t.req.request_id, tenant=t.req.tenant, seq=t.seq,
                       token_ids=token_ids, text=text, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                       completion_tokens=completion_tokens, device=self.device, logprobs=logprobs or [])
        t.seq += 1
        return c


@dataclass
class StepAggregator:
    """Sums per-step measurements into one StepReport per window (not one message per step)."""

    device: str
    tenant: str
    window_start_ts: float = field(default_factory=time.time)
    steps: int = 0
    busy_ms: float = 0.0
    stats: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    guest: list[tuple[str, float, float]] = field(default_factory=list)

    def add_guest_step(self, tenant: str, start_ts: float, end_ts: float) -> None:
        self.steps += 1
        self.busy_ms += (end_ts - start_ts) * 1000.0
        if self.guest and self.guest[-1][0] == tenant and start_ts - self.guest[-1][2] < 0.0005:
            self.guest[-1] = (tenant, self.guest[-1][1], end_ts)
        else:
            self.guest.append((tenant, start_ts, end_ts))

    def add_step(self, start_ts: float, end_ts: float, batch_tokens: int, segment_ms: dict[str, float]) -> None:
        self.steps += 1
        self.busy_ms += (end_ts - start_ts) * 1000.0
        if self.intervals and start_ts - self.intervals[-1][1] < 0.0005:
            self.intervals[-1] = (self.intervals[-1][0], end_ts)
        else:
            self.intervals.append((start_ts, end_ts))
        bucket = tokens_bucket(batch_tokens)
        for seg, ms in segment_ms.items():
            s = self.stats.setdefault((seg, bucket), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += ms
            s[2] += ms * ms

    def add_segment(self, name: str, rows: int, ms: float) -> None:
        """A segment run outside a home step (guest work: ``tenant/segment``); not counted as home busy time."""
        s = self.stats.setdefault((name, tokens_bucket(rows)), [0, 0.0, 0.0])
        s[0] += 1
        s[1] += ms
        s[2] += ms * ms

    def flush(self, kv_used_bytes: int) -> StepReport | None:
        now = time.time()
        if not self.steps and not self.stats:
            self.window_start_ts = now
            return None
        rep = StepReport(msg_id=uuid.uuid4().hex, device=self.device, tenant=self.tenant,
                         window_start_ts=self.window_start_ts, window_end_ts=now, steps=self.steps,
                         busy_ms=self.busy_ms, kv_used_bytes=kv_used_bytes,
                         segments=[SegmentStat(seg, b, int(c), tot, sq) for (seg, b), (c, tot, sq) in self.stats.items()],
                         busy_intervals=self.intervals[-512:], guest_intervals=self.guest[-512:])
        self.window_start_ts, self.steps, self.busy_ms = now, 0, 0.0
        self.stats, self.intervals, self.guest = {}, [], []
        return rep
