"""Pipelined micro-batch steps: bit-identical to ``Engine.step`` with segments remote, failing or local;
micro-batch splitting rules; the schedule overlaps home and guest work."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.model.batch import SeqChunk
from shared.model.config import PRESETS
from shared.model.engine import Engine, SamplingParams
from shared.model.llama import LlamaModel
from shared.model.pipeline import MIN_MICRO_BATCH_ROWS, pipelined_step, split_bounds
from shared.model.tokenizer import load_tokenizer


class ThreadRemote:
    """A stand-in guest: runs segments on a partial copy of the model in another thread."""

    def __init__(self, model: LlamaModel, segments: list[str], fail_every: int = 0, delay_s: float = 0.0,
                 log: list | None = None) -> None:
        self.guest = LlamaModel.partial(model.cfg, segments)
        for s in segments:
            self.guest.load_segment(s, model.segment_state_dict(s))
        self.segments, self.fail_every, self.delay_s, self.log = set(segments), fail_every, delay_s, log
        self.pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))
        self.calls = 0

    def remote(self, name: str) -> bool:
        return name in self.segments

    def submit(self, name: str, micro_batch: int, hidden: torch.Tensor):
        self.calls += 1
        if self.log is not None:
            self.log.append(("submit", name, micro_batch))
        fail = self.fail_every and self.calls % self.fail_every == 0
        return self.pool.submit(self._run, name, hidden.clone(), fail)

    def _run(self, name, hidden, fail):
        if self.delay_s:
            time.sleep(self.delay_s)
        return None if fail else self.guest.run_segment(name, hidden)

    def collect(self, fut):
        out = fut.result()
        if self.log is not None:
            self.log.append(("collect", out is not None))
        return out


def _capture_logits(engine: Engine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    orig = engine._sample

    def sample(seqs, logits):
        if seqs:
            seen.append(logits.clone())
        return orig(seqs, logits)

    engine._sample = sample  # type: ignore[method-assign]
    return seen


def _workload(engine: Engine, rng: random.Random, n: int) -> None:
    vocab = engine.model.cfg.vocab_size
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 9, 17, 40]))]
        temp = rng.choice([0.0, 0.0, 0.8])
        engine.add(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12), temperature=temp,
                                                   seed=rng.randrange(1000) if temp else None, ignore_eos=True))


def _run(engine: Engine, step) -> list[tuple]:
    out = []
    while engine.has_work():
        r = step()
        out.append(tuple((e.request_id, tuple(e.token_ids), e.text, e.finish_reason) for e in r.events))
    return out


@pytest.fixture(scope="module")
def tiny():
    cfg = PRESETS["tiny"]
    return LlamaModel(cfg, seed=5), load_tokenizer(None, cfg)


@pytest.fixture
def one_thread():
    """Bit-identity is the one-thread property (docs/guest-execution.md, "Identical tokens"): with more threads
    MKL splits a GEMM's rows between them and a share under 4 rows takes another kernel (seen on a 2-core VM)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("micro_batches,fail_every,max_batch_tokens", [(2, 0, 64), (3, 0, 32), (2, 3, 48)])
def test_pipelined_step_is_bit_identical_to_engine_step(tiny, one_thread, micro_batches, fail_every,
                                                        max_batch_tokens):
    model, tok = tiny
    ref = Engine(model, tok, kv_blocks=256, block_size=16, max_batch_tokens=max_batch_tokens)
    pip = Engine(model, tok, kv_blocks=256, block_size=16, max_batch_tokens=max_batch_tokens)
    for e in (ref, pip):
        _workload(e, random.Random(micro_batches * 100 + fail_every), 14)
    ref_logits, pip_logits = _capture_logits(ref), _capture_logits(pip)
    mlps = [s for s in model.segments if s.startswith("mlp")]
    remote = ThreadRemote(model, mlps, fail_every=fail_every)
    expect = _run(ref, ref.step)
    got = _run(pip, lambda: pipelined_step(pip, remote, micro_batches))
    assert got == expect
    assert len(ref_logits) == len(pip_logits)
    for a, b in zip(ref_logits, pip_logits):
        assert torch.equal(a, b)
    assert remote.calls > 0, "no segment was offered to the guest"


def test_without_remote_and_one_micro_batch_equals_engine_step(tiny):
    model, tok = tiny
    ref = Engine(model, tok, kv_blocks=128, max_batch_tokens=40)
    pip = Engine(model, tok, kv_blocks=128, max_batch_tokens=40)
    for e in (ref, pip):
        _workload(e, random.Random(9), 6)
    assert _run(pip, lambda: pipelined_step(pip, None, 1)) == _run(ref, ref.step)


def test_split_bounds_rules():
    rng = random.Random(1)
    for _ in range(500):
        chunks = [SeqChunk(f"s{i}", 0, rng.choice([1, 1, 1, 2, 7, 30])) for i in range(rng.randint(1, 30))]
        m = rng.randint(1, 4)
        b = split_bounds(chunks, m)
        assert b[0][0] == 0 and b[-1][1] == len(chunks) and len(b) <= m
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        rows = [sum(c.length for c in chunks[x:y]) for x, y in b]
        if len(b) > 1:
            assert min(rows) >= MIN_MICRO_BATCH_ROWS
    sixteen = [SeqChunk(f"d{i}", 5, 1) for i in range(16)]
    assert split_bounds(sixteen, 2) == [(0, 8), (8, 16)]
    assert split_bounds(sixteen[:7], 2) == [(0, 7)]  # 3 + 4 rows would give a 3-row GEMM


def test_schedule_overlaps_guest_and_home(tiny):
    """While the guest runs mlp[l] of micro-batch 0, the home runs attn[l] of micro-batch 1."""
    model, tok = tiny
    log: list = []
    eng = Engine(model, tok, kv_blocks=128, max_batch_tokens=64)

    class Runner:
        def run(self, name, hidden, ctx, local):
            log.append(("local", name, len(ctx.chunks)))
            return local(hidden, ctx)

    eng.segment_runner = Runner()
    for i in range(8):
        eng.add(f"r{i}", [10 + i], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()  # the prefill of 8 one-token prompts: 8 rows
    log.clear()
    remote = ThreadRemote(model, ["mlp[0]", "mlp[1]"], delay_s=0.002, log=log)
    pipelined_step(eng, remote, 2)
    kinds = [(e[0], e[1]) for e in log[:6]]
    assert kinds == [("local", "embed"), ("local", "attn[0]"), ("submit", "mlp[0]"), ("local", "attn[0]"),
                     ("submit", "mlp[0]"), ("collect", True)]
    assert ("local", "mlp[0]") not in kinds and ("local", "mlp[2]") in [(e[0], e[1]) for e in log]


def test_remote_segments_run_concurrently_with_home_work(tiny):
    model, tok = tiny
    eng = Engine(model, tok, kv_blocks=128, max_batch_tokens=64)
    for i in range(16):
        eng.add(f"r{i}", [20 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    active = threading.Event()
    overlap = []

    class Runner:
        def run(self, name, hidden, ctx, local):
            if name.startswith("attn"):
                overlap.append(active.is_set())
            return local(hidden, ctx)

    class Slow(ThreadRemote):
        def _run(self, name, hidden, fail):
            active.set()
            time.sleep(0.003)
            out = self.guest.run_segment(name, hidden)
            active.clear()
            return out

    eng.segment_runner = Runner()
    remote = Slow(model, [s for s in model.segments if s.startswith("mlp")])
    while eng.has_work():
        pipelined_step(eng, remote, 2)
    assert any(overlap), "home attention never ran while the guest was computing"
