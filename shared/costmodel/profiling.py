"""Micro-benchmarks of the real operators on the local device (the measuring half of ``slicesched profile``).

What is timed is the model's own segment code (:meth:`shared.model.llama.LlamaModel.run_segment`), the same
calls the engine times per step: ``embed``, ``mlp``, ``head`` over a grid of token counts, and ``attn`` (norm,
qkv, rope, KV write, attention over a paged KV cache, o-proj, residual) for decode batches over several context
lengths, prefill chunks with and without cached context, and mixed batches. Plus the engine's work per step
outside the segments (batch layout, sampling, bookkeeping) and reference peaks (the fastest GEMM and copy).

On the CPU the clock is the calling thread's CPU time (torch runs with one thread in the calling thread), not
wall time: on a shared, oversubscribed machine a long operator's wall time is its CPU time stretched by however
many other processes want the cores at that moment, which is the machine's load, not the device's speed. (The
serving mesh's extra wall time under load is what the online correction absorbs, see
:class:`~shared.costmodel.CorrectionTable`.) On CUDA the clock is wall time between device synchronisations.
Cases are measured in interleaved rounds (every case gets a few calls per round, so the machine's phases hit
all cases alike) until a time budget is spent; the statistic is the mean of the uninterrupted calls (see
:class:`Measurement`), with its standard error. No Redis, no files.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shared.model.batch import SeqChunk, build_context
from shared.model.config import ModelConfig
from shared.model.graph import batch_kv_work
from shared.model.llama import LlamaModel

INTERRUPTED = 3.0


def uninterrupted(samples: list[float]) -> list[float]:
    """The samples not slower than ``INTERRUPTED`` × their median (see :class:`Measurement`)."""
    if not samples:
        return []
    cut = INTERRUPTED * statistics.median(samples)
    return [x for x in samples if x <= cut]


def uninterrupted_mean(samples: list[float]) -> float:
    """Mean of :func:`uninterrupted` samples (nan for none)."""
    kept = uninterrupted(samples)
    return statistics.fmean(kept) if kept else math.nan


@dataclass(frozen=True)
class Case:
    """One benchmark shape. ``kind`` is a segment kind; attention cases give their decode sequences' context
    lengths and their prefill chunks as (new tokens, cached tokens)."""

    kind: str
    tokens: int
    decode_ctx: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int], ...] = ()

    @property
    def n_decode(self) -> int:
        return len(self.decode_ctx)

    @property
    def decode_kv(self) -> int:
        """Query-key pairs of the decode tokens (their context lengths summed)."""
        return sum(self.decode_ctx)

    def prefill_work(self) -> tuple[int, int, int]:
        """(tokens, query-key pairs, KV rows read) of the prefill chunks (graph conventions)."""
        return batch_kv_work(self.prefill)

    @property
    def label(self) -> str:
        if self.kind != "attn":
            return f"{self.kind} t={self.tokens}"
        parts = []
        if self.decode_ctx:
            parts.append(f"decode {self.n_decode}x~{self.decode_kv // self.n_decode}")
        for n, c in self.prefill:
            parts.append(f"prefill {n}" + (f"+{c}" if c else ""))
        return "attn " + " + ".join(parts)


@dataclass
class Measurement:
    """Samples (ms) of one case.

    The fitted statistic is :attr:`value_ms`, the mean of the calls that ran uninterrupted: a call slower than
    ``INTERRUPTED`` × the median was disturbed (a context switch that evicted its caches, or, with a wall
    clock, lost its CPU to another process), which is the machine's load at that moment, not the operator's cost.
    """

    case: Case
    samples_ms: list[float] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        """Plain mean of every call."""
        return statistics.fmean(self.samples_ms) if self.samples_ms else math.nan

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    def _kept(self) -> list[float]:
        return uninterrupted(self.samples_ms)

    @property
    def value_ms(self) -> float:
        """Mean of the uninterrupted calls."""
        return uninterrupted_mean(self.samples_ms)

    @property
    def interrupted(self) -> float:
        """Fraction of calls left out of :attr:`value_ms`."""
        return 1.0 - len(self._kept()) / len(self.samples_ms) if self.samples_ms else 0.0

    @property
    def rel_se(self) -> float:
        """Standard error of :attr:`value_ms`, relative to it."""
        kept = self._kept()
        if len(kept) < 2:
            return 1.0
        return statistics.stdev(kept) / math.sqrt(len(kept)) / max(1e-12, statistics.fmean(kept))


def token_grid(quick: bool, max_tokens: int) -> list[int]:
    """Token counts covering every size bucket of a profile (powers of two, plus in-between points)."""
    grid = [1, 4, 16, 64, 256] if quick else [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048]
    return [t for t in grid if t <= max_tokens]


def default_cases(cfg: ModelConfig, quick: bool = False, max_tokens: int = 2048) -> list[Case]:
    """The benchmark grid for one model shape (contexts capped at its positions)."""
    limit = min(max_tokens, cfg.max_position_embeddings)
    grid = token_grid(quick, limit)
    cases = [Case(k, t) for k in ("embed", "mlp", "head") for t in grid]

    def spread(d: int, ctx: int) -> tuple[int, ...]:
        # contexts spread over [ctx/2, ctx]: a batch's sequences differ in length, as in serving
        lo = max(1, ctx // 2)
        return tuple(ctx - (i * (ctx - lo)) // max(1, d - 1) for i in range(d)) if d > 1 else (ctx,)

    decodes = [1, 4, 16, 64] if quick else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128]
    contexts = [32, 320] if quick else [16, 64, 160, 320, 640, 1280]
    for d in decodes:
        for ctx in contexts:
            if ctx < limit and d * ctx <= 65536:
                cases.append(Case("attn", d, decode_ctx=spread(d, ctx)))
    for n in grid:
        if 2 <= n <= 1024:  # longer prompts are prefilled in chunks (and cost seconds per call here)
            cases.append(Case("attn", n, prefill=((n, 0),)))
    cached = [(32, 224), (128, 128)] if quick else [(16, 240), (32, 224), (64, 448), (128, 128), (256, 768)]
    for n, c in cached:
        if n + c <= limit:
            cases.append(Case("attn", n, prefill=((n, c),)))
    mixed = [(8, 200, 64)] if quick else [(4, 100, 128), (8, 200, 64), (16, 250, 200), (32, 150, 96)]
    for d, ctx, n in mixed:
        if d + n <= limit and ctx < limit:
            cases.append(Case("attn", d + n, decode_ctx=spread(d, ctx), prefill=((n, 0),)))
    return cases


class SegmentBench:
    """The real segment code of one model shape on one device, ready to time any :class:`Case`.

    A one-layer model is enough (every layer runs the same code); weights are seeded random. Decode sequences
    get their KV blocks in one allocation each, as the engine's admission does.
    """

    def __init__(self, cfg: ModelConfig, device: str = "cpu", seed: int = 0) -> None:
        self.cfg = cfg.with_(num_hidden_layers=1)
        self.device = torch.device(device)
        self.model = LlamaModel(self.cfg, self.device, seed=seed)
        self.kv = self.model.new_kv_cache(64, 16)
        self.clock = device_clock(self.device)
        self.layers = cfg.num_hidden_layers
        gen = torch.Generator().manual_seed(seed)
        self._hidden = (torch.randn(4096, self.cfg.hidden_size, generator=gen) * 0.5).to(self.device, self.model.dtype)
        self._ids = torch.randint(0, self.cfg.vocab_size, (4096,), generator=gen).to(self.device)
        self._n = 0

    def reserve(self, cases: list[Case]) -> None:
        """Size the KV cache for every attention case of a pass (each keeps its blocks until :meth:`release`)."""
        blocks = sum(-(-ctx // 16) for c in cases for ctx in c.decode_ctx) \
            + sum(-(-(n + cached) // 16) for c in cases for n, cached in c.prefill)
        if blocks > self.kv.allocator.blocks_total:
            self.kv = self.model.new_kv_cache(blocks + 8, 16)

    def prepare(self, case: Case) -> Callable[[], None]:
        """A zero-argument callable that runs the case's segment once (batch layout built beforehand)."""
        m, t = self.model, case.tokens
        if case.kind == "embed":
            ids = self._ids[:t]
            return lambda: m.run_segment("embed", ids)
        hidden = self._hidden[:t].contiguous()
        if case.kind in ("mlp", "head"):
            name = "mlp[0]" if case.kind == "mlp" else "head"
            return lambda: m.run_segment(name, hidden)
        chunks = []
        for i, ctx in enumerate(case.decode_ctx):
            sid = f"d{self._n}-{i}"
            self.kv.allocate(sid, ctx)
            chunks.append(SeqChunk(sid, ctx - 1, 1))
        for j, (n, cached) in enumerate(case.prefill):
            sid = f"p{self._n}-{j}"
            self.kv.allocate(sid, cached + n)
            chunks.append(SeqChunk(sid, cached, n))
        self._n += 1
        ctx = build_context(self.kv, chunks)
        calls = [0]
        layers = self.layers

        def run() -> None:
            # RoPE rows are computed once per step (in attn[0]) and reused by later layers: clear the cache
            # on one call in `layers` so the mean is the per-layer average
            if calls[0] % layers == 0:
                ctx.rope.clear()
            calls[0] += 1
            m.run_segment("attn[0]", hidden, ctx)
        return run

    def release(self) -> None:
        """Free every KV block (between measurement passes)."""
        for sid in list(self.kv.allocator.sequences()):
            self.kv.free(sid)


def measure(bench: SegmentBench, cases: list[Case], budget_s: float, *, seed: int = 0, min_rounds: int = 5,
            round_ms: float = 4.0, progress: Callable[[float], None] | None = None) -> list[Measurement]:
    """Interleaved rounds over ``cases`` until ``budget_s`` is spent (at least ``min_rounds`` rounds).

    Each round calls every case about ``round_ms`` worth of times (at least once), in a shuffled order.
    """
    rng = random.Random(seed)
    clock = bench.clock
    bench.reserve(cases)
    runs = [bench.prepare(c) for c in cases]
    out = [Measurement(c) for c in cases]
    with torch.inference_mode():
        est = []
        for f in runs:  # warm-up, then the median of three calls sizes the case's calls per round
            f()
            times = []
            for _ in range(3):
                t = clock()
                f()
                times.append(clock() - t)
            est.append(max(1e-6, statistics.median(times)))
        reps = [max(1, min(50, int(round_ms / 1e3 / e))) for e in est]
        order = list(range(len(cases)))
        start = time.perf_counter()  # the budget is wall time
        rounds = 0
        while rounds < min_rounds or time.perf_counter() - start < budget_s:
            rng.shuffle(order)
            for i in order:
                f, samples = runs[i], out[i].samples_ms
                for _ in range(reps[i]):
                    t = clock()
                    f()
                    samples.append((clock() - t) * 1e3)
            rounds += 1
            if progress is not None:
                progress(min(1.0, (time.perf_counter() - start) / budget_s))
    bench.release()
    return out


class _TimedRunner:
    """Segment runner that sums the device clock spent inside segments (to subtract from the step's)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.inside = clock, 0.0

    def run(self, name: str, hidden: torch.Tensor, ctx, local: Callable) -> torch.Tensor:
        t = self.clock()
        out = local(hidden, ctx)
        self.inside += self.clock() - t
        return out


def measure_step_overhead(cfg: ModelConfig, device: str = "cpu", steps: int = 60, seed: int = 0) -> float:
    """Seconds per engine step spent outside the segments (batch layout, sampling, bookkeeping): the mean over
    uninterrupted steps (as :attr:`Measurement.value_ms`) of decode steps at a few batch sizes and the prefill
    steps that start them, on the device clock."""
    from shared.model.engine import Engine, SamplingParams
    from shared.model.tokenizer import load_tokenizer

    small = cfg.with_(num_hidden_layers=1)
    model = LlamaModel(small, device, seed=seed)
    tok = load_tokenizer(None, small)
    clock = device_clock(torch.device(device))
    over: list[float] = []
    for batch in (1, 8, 32):
        runner = _TimedRunner(clock)
        eng = Engine(model, tok, kv_blocks=max(64, batch * 32), max_batch_tokens=256, max_running=64,
                     segment_runner=runner)
        for i in range(batch):
            prompt = [min(small.vocab_size - 1, 65 + (i + j) % 26) for j in range(48)]
            eng.add(f"r{i}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
        n = 0
        while eng.has_work() and n < steps:
            runner.inside = 0.0
            t = clock()
            eng.step()
            if n >= 2:  # first steps pay one-time allocations
                over.append(max(0.0, clock() - t - runner.inside))
            n += 1
    return uninterrupted_mean(over) if over else 0.0


def device_clock(device: torch.device) -> Callable[[], float]:
    """Seconds on the device's clock: the thread's CPU time on the CPU, synchronised wall time on CUDA."""
    if device.type == "cuda":
        def cuda_clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return cuda_clock
    return time.thread_time


def measure_peaks(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(FLOP/s, bytes/s): the fastest GEMM and the fastest copy over a few sizes (small ones stay in cache).

    Efficiencies are fractions of these, so the fitted rates are capped by them."""
    dev = torch.device(device)
    clock = device_clock(dev)
    gemms = (256, 512, 1024) if dev.type == "cpu" else (4096, 8192)
    copies = (2**18, 2**22, 2**26) if dev.type == "cpu" else (2**26, 2**30)
    flops, bw = 0.0, 0.0
    with torch.inference_mode():
        for n in gemms:
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            for _ in range(3):
                t = clock()
                torch.mm(a, b)
                flops = max(flops, 2.0 * n ** 3 / max(1e-9, clock() - t))
        for nbytes in copies:
            src = torch.ones(nbytes // 4, device=dev)
            dst = torch.empty_like(src)
            for _ in range(3):
                t = clock()
                dst.copy_(src)
                bw = max(bw, 2.0 * nbytes / max(1e-9, clock() - t))
    return flops, bw
