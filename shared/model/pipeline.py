"""One engine step split into micro-batches and pipelined, with some segments run elsewhere (a guest device).

The step plans exactly as :meth:`Engine.step` does (same ``_plan()``, same sampling and stop rules) and cuts the
planned chunks into up to ``micro_batches`` groups of whole chunks. Each micro-batch runs the model's segments in
order; a segment that :class:`RemoteSegments` takes is *submitted* and the home moves on to the next
micro-batch, so while the guest runs ``mlp[l]`` of micro-batch 0 the home runs ``attn[l]`` of micro-batch 1
(DESIGN §4). When no micro-batch can advance, the home waits for the oldest submitted result. A remote segment
that fails or times out is run locally from the same input, so a guest can delay a step but never change it.

Bit-identical results: a micro-batch's attention context is a slice of the whole batch's context (same padding
of the decode group, same per-chunk masks), the head runs once over every sampled row as in ``Engine.step``, and
every micro-batch holds at least :data:`MIN_MICRO_BATCH_ROWS` rows. That last rule comes from measurement: with
fp32 CPU GEMMs (MKL/oneDNN, one thread) row ``i`` of ``x @ w`` is bit-identical for any ``M >= 4`` rows but not
for ``M <= 3`` (a different kernel). Under these rules the split step gives the same logits, bit for bit, as the
unsplit one (``tests/unit/model/test_pipeline.py``); on other kernels DESIGN §4's tolerance rule applies.
"""
from __future__ import annotations

import time
from collections import deque
from functools import partial
from typing import Protocol

import torch

from shared.model.batch import BatchContext, PrefillGroup, SeqChunk, build_context
from shared.model.engine import Engine, StepResult, TokenEvent

MIN_MICRO_BATCH_ROWS = 4


class RemoteSegments(Protocol):
    """Where the segments of one step may run besides the home device."""

    def remote(self, name: str) -> bool:
        """Whether ``name`` should be offered to a guest in this step."""

    def submit(self, name: str, micro_batch: int, hidden: torch.Tensor) -> object | None:
        """Start ``name`` on a guest without waiting; a ticket, or None to run it locally now."""

    def collect(self, ticket: object) -> torch.Tensor | None:
        """Wait for a submitted segment's output; None means it failed (it is then run locally)."""


def split_bounds(chunks: list[SeqChunk], micro_batches: int,
                 min_rows: int = MIN_MICRO_BATCH_ROWS) -> list[tuple[int, int]]:
    """Chunk-index ranges of at most ``micro_batches`` micro-batches of whole chunks, balanced by rows, each with
    at least ``min_rows`` rows; ``[(0, len(chunks))]`` when the batch cannot be split that way."""
    rows = [0]
    for c in chunks:
        rows.append(rows[-1] + c.length)
    total = rows[-1]
    k = min(micro_batches, len(chunks), total // max(1, min_rows))
    while k > 1:
        bounds, prev = [0], 0
        for i in range(1, k):
            target = total * i / k
            cut = min(range(prev + 1, len(chunks) - (k - i) + 1), key=lambda j: abs(rows[j] - target))
            bounds.append(cut)
            prev = cut
        bounds.append(len(chunks))
        if all(rows[b] - rows[a] >= min_rows for a, b in zip(bounds, bounds[1:])):
            return list(zip(bounds, bounds[1:]))
        k -= 1
    return [(0, len(chunks))]


def sub_context(ctx: BatchContext, a: int, b: int) -> BatchContext:
    """The context of chunks ``[a, b)`` of ``ctx``, sliced from it so attention pads and masks exactly as for the
    whole batch (rebuilding it would pad the decode group to the micro-batch's own longest context)."""
    if (a, b) == (0, len(ctx.chunks)):
        return ctx
    rows = [0]
    for c in ctx.chunks:
        rows.append(rows[-1] + c.length)
    r0, r1 = rows[a], rows[b]
    sm = ctx.slot_mapping
    sm = slice(sm.start + r0, sm.start + r1) if isinstance(sm, slice) else sm[r0:r1]
    n_dec = max(0, min(b, ctx.n_decode) - a)
    gather = bias = None
    if n_dec:
        g = ctx.decode_gather
        gather = g if isinstance(g, slice) else g[a:a + n_dec]  # type: ignore[index]
        bias = None if ctx.decode_bias is None else ctx.decode_bias[a:a + n_dec]
    prefills = [PrefillGroup(p.row - r0, p.n, p.gather, p.bias) for p in ctx.prefills if r0 <= p.row < r1]
    return BatchContext(kv=ctx.kv, chunks=ctx.chunks[a:b], positions=ctx.positions[r0:r1], slot_mapping=sm,
                        n_decode=n_dec, decode_gather=gather, decode_bias=bias, prefills=prefills)


class _Local:
    """Runs a segment at home (through the engine's segment runner, if it has one), timing it."""

    def __init__(self, engine: Engine, seg_ms: dict[str, float]) -> None:
        self.engine, self.seg_ms = engine, seg_ms

    def __call__(self, name: str, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        ts = time.perf_counter()
        model, runner = self.engine.model, self.engine.segment_runner
        if runner is None:
            out = model.run_segment(name, hidden, ctx)
        else:
            out = runner.run(name, hidden, ctx, partial(model.run_segment, name))
        self.seg_ms[name] = self.seg_ms.get(name, 0.0) + (time.perf_counter() - ts) * 1e3
        return out


def _run_body(body: list[str], hs: list[torch.Tensor], ctxs: list[BatchContext], local: _Local,
              remote: RemoteSegments | None, seg_ms: dict[str, float]) -> None:
    """Advance every micro-batch through ``body``: lowest runnable micro-batch first, remote segments submitted,
    the oldest submission collected when nothing else can run."""
    m = len(hs)
    pos = [0] * m
    pending: dict[int, tuple[object, str, torch.Tensor, float]] = {}
    order: deque[int] = deque()
    while True:
        for i in range(m):
            while i not in pending and pos[i] < len(body):
                name = body[pos[i]]
                pos[i] += 1
                if remote is not None and remote.remote(name):
                    ticket = remote.submit(name, i, hs[i])
                    if ticket is not None:
                        pending[i] = (ticket, name, hs[i], time.perf_counter())
                        order.append(i)
                        continue
                hs[i] = local(name, hs[i], ctxs[i])
        if not order:
            return
        i = order.popleft()
        ticket, name, inp, ts = pending.pop(i)
        tw = time.perf_counter()
        out = remote.collect(ticket)  # type: ignore[union-attr]
        now = time.perf_counter()
        seg_ms["pipeline_wait"] = seg_ms.get("pipeline_wait", 0.0) + (now - tw) * 1e3
        if out is None:  # counted by the RemoteSegments implementation
            out = local(name, inp, ctxs[i])
        else:
            key = "remote:" + name
            seg_ms[key] = seg_ms.get(key, 0.0) + (now - ts) * 1e3
        hs[i] = out


def pipelined_step(engine: Engine, remote: RemoteSegments | None, micro_batches: int = 2) -> StepResult:
    """One step of ``engine`` in micro-batches, offering segments to ``remote``; same events as ``engine.step()``.

    ``segment_ms`` holds the local time per segment (summed over micro-batches), ``remote:<segment>`` the round
    trip of remote ones and ``pipeline_wait`` the time the home spent waiting for them. With one micro-batch
    nothing is offered (no overlap is possible, so a guest could only add latency).
    """
    t0 = time.perf_counter()
    engine._admit()
    plan = engine._plan()
    if not plan:
        return StepResult([], {}, 0, 0, 0, (time.perf_counter() - t0) * 1e3)
    seg_ms: dict[str, float] = {}
    local = _Local(engine, seg_ms)
    with torch.inference_mode():
        ids: list[int] = []
        for seq, c in plan:
            ids.extend(seq.prompt[c.start:c.start + c.length] if seq.prefilling else seq.output[-1:])
        chunks = [c for _, c in plan]
        ctx = build_context(engine.kv, chunks)
        sampled = [i for i, (seq, c) in enumerate(plan) if c.start + c.length >= len(seq.prompt)]
        last = ctx.last_rows()
        head_rows = [last[i] for i in sampled]
        bounds = split_bounds(chunks, micro_batches)
        rows = [0]
        for c in chunks:
            rows.append(rows[-1] + c.length)
        hidden = local("embed", torch.tensor(ids, dtype=torch.long, device=engine.model.device), ctx)
        hs = [hidden[rows[a]:rows[b]] for a, b in bounds]
        ctxs = [sub_context(ctx, a, b) for a, b in bounds]
        body = [s for s in engine._segments if s not in ("embed", "head")]
        _run_body(body, hs, ctxs, local, remote if len(hs) > 1 else None, seg_ms)
        tokens: list[int] = []
        if head_rows:
            hidden = hs[0] if len(hs) == 1 else torch.cat(hs)
            if len(head_rows) != hidden.shape[0]:
                hidden = hidden.index_select(0, torch.tensor(head_rows, device=hidden.device))
            logits = local("head", hidden, ctx)
            tokens = engine._sample([plan[i][0] for i in sampled], logits)
    events, prefill_tokens, decode_tokens = [], 0, 0
    tok_of = dict(zip(sampled, tokens))
    for i, (seq, c) in enumerate(plan):  # the bookkeeping of Engine.step, unchanged
        if seq.prefilling:
            prefill_tokens += c.length
        else:
            decode_tokens += 1
        seq.computed += c.length
        if i in tok_of:
            events.append(engine._advance(seq, tok_of[i]))
        else:
            events.append(TokenEvent(seq.request_id, [], "", None, len(seq.prompt), 0))
    engine._admit()
    return StepResult(events, seg_ms, len(plan), prefill_tokens, decode_tokens, (time.perf_counter() - t0) * 1e3)
