"""A synchronous continuous-batching engine: chunked prefill, paged KV, per-segment timing.

Pure: no asyncio, no Redis, no files. The worker service wraps it. Each :meth:`Engine.step` mixes one decode
token of every running sequence with prefill chunks up to ``max_batch_tokens``, runs the model segment by
segment (optionally through a :class:`SegmentRunner` that may send some segments to a guest device), samples,
and returns the new tokens as :class:`TokenEvent` values. KV for ``prompt + max_tokens`` is reserved when a
sequence is admitted, so a running sequence never runs out of KV and nothing is preempted.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Protocol

import torch

from shared.model.batch import BatchContext, SeqChunk, build_context
from shared.model.deadline import deadline_chunks
from shared.model.step_cap import cap_chunks
from shared.model.graph import segment_names
from shared.model.llama import LlamaModel
from shared.model.sampling import (SamplingOptions, apply_penalties, make_generator, sample_row, token_logprobs,
                                   validate_params)
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SamplingParams:
    """Per-request generation settings (temperature 0 = greedy; top_k 0 = off; ``logprobs`` None = none, k = the
    sampled token's log-probability and the k most likely alternatives)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    @property
    def options(self) -> SamplingOptions:
        return SamplingOptions(self.temperature, self.top_p, self.top_k, self.presence_penalty,
                               self.frequency_penalty, self.repetition_penalty)


@dataclass
class TokenEvent:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new tokens this step (empty for a non-final prefill chunk)
    text: str  # newly detokenized text (stop strings not included)
    finish_reason: str | None  # "stop" (EOS or stop string) | "length" | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[float, list[tuple[int, float]]] | None = None  # of this event's token (if asked for)


@dataclass
class StepResult:
    """Events and measurements of one step."""

    events: list[TokenEvent]
    segment_ms: dict[str, float]  # measured wall time per segment name in this step
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    step_ms: float


class SegmentRunner(Protocol):
    """Hook around every segment: run it locally with ``local(hidden, ctx)`` or elsewhere (a guest device)."""

    def run(self, name: str, hidden: torch.Tensor, ctx: BatchContext, local: Callable) -> torch.Tensor: ...


@dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    output: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose KV is in the cache
    pending: str = ""  # text held back while it might be the start of a stop string
    hold: int = 0  # characters to hold back: longest stop string - 1
    prompt_t: torch.Tensor | None = None  # the prompt as a tensor (repetition penalty)
    last_logprobs: tuple[float, list[tuple[int, float]]] | None = None
    deadline: float = math.inf  # when its first token is due (clock of Engine.clock); deadline_step orders by it

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass
class SequenceState:
    """A sequence past its prompt, as :meth:`Engine.export_sequence` takes it from one engine and
    :meth:`Engine.import_sequence` continues it on another of the same model (a guest lane handing a prefilled
    sequence to its tenant's home device): the tokens, sampling state, text held back, and the KV of every position
    computed so far (``kv[i]`` = (K, V) of the i-th layer, each ``[kv_heads, computed, head_dim]``)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    computed: int
    pending: str
    generator_state: torch.Tensor | None
    detok: tuple
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class Engine:
    """Continuous batching over a :class:`LlamaModel` holding every segment."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, *, kv_blocks: int, block_size: int = 16,
                 max_batch_tokens: int = 256, max_running: int = 64,
                 segment_runner: SegmentRunner | None = None) -> None:
        if max_batch_tokens <= 0 or max_running <= 0:
            raise ValueError("max_batch_tokens and max_running must be positive")
        missing = [s for s in segment_names(model.cfg.num_hidden_layers) if s not in model.segments]
        if missing:
            raise ValueError(f"the engine needs a model holding every segment; missing {missing}")
        self.model, self.tokenizer = model, tokenizer
        self.kv = model.new_kv_cache(kv_blocks, block_size)
        self.block_size = block_size
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.segment_runner = segment_runner
        self._segments = list(model.segments)
        self._waiting: OrderedDict[str, _Seq] = OrderedDict()
        self._running: OrderedDict[str, _Seq] = OrderedDict()
        self._paused: set[str] = set()  # running sequences left out of steps while they are being handed over
        # every id that ends generation: the tokenizer's EOS list and the model config's (generation_config.json)
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ()) | frozenset(model.cfg.eos_token_ids)
        # deadline-aware chunked prefill (shared/model/deadline.py) while set: the predicted time of an iteration,
        # (decode rows, their context, prefill tokens, query-key pairs, KV rows read, rows sampled) -> seconds;
        # requests are then admitted and chunked by their first-token deadlines (add's ``deadline``, on ``clock``)
        self.deadline_step: Callable[[int, int, int, int, int, int], float] | None = None
        # TPOT-bounded chunked prefill (shared/model/step_cap.py) while set: (seconds, the predicted time of an
        # iteration as deadline_step's); a step with sequences decoding takes prefill only while within the seconds
        self.step_cap: tuple[float, Callable[[int, int, int, int, int, int], float]] | None = None
        self.clock: Callable[[], float] = time.time

    # ---------------------------------------------------------------- capacity
    @property
    def kv_blocks_total(self) -> int:
        return self.kv.allocator.blocks_total

    @property
    def kv_blocks_free(self) -> int:
        return self.kv.allocator.blocks_free

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks reserved for a request: ``prompt_len + max_tokens`` positions."""
        return -(-(prompt_len + max_tokens) // self.block_size)

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a request would start running at the next step (nothing queued ahead, KV and a slot free)."""
        return (not self._waiting and len(self._running) < self.max_running
                and self.blocks_needed(prompt_len, max_tokens) <= self.kv_blocks_free)

    def running_ids(self) -> list[str]:
        return list(self._running)

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting) or len(self._running) > len(self._paused)

    def prefill_backlog(self) -> tuple[int, list[str]]:
        """(prompt tokens not yet prefilled, ids of the requests they belong to); safe to call from another
        thread than the one stepping (reads copies)."""
        seqs = list(self._waiting.values()) + list(self._running.values())
        todo = [(s.request_id, len(s.prompt) - s.computed) for s in seqs if s.computed < len(s.prompt)]
        return sum(n for _, n in todo), [rid for rid, _ in todo]

    # ---------------------------------------------------------------- requests
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            deadline: float = math.inf) -> None:
        """Queue a request; it is admitted (KV reserved) as soon as blocks and a running slot are free. ``deadline``
        (on :attr:`clock`) is when its first token is due; it orders admission and prefill under ``deadline_step``.

        ``ValueError`` for a duplicate id, an empty or out-of-vocabulary prompt, bad parameters, or a request that
        could never fit (longer than the model's positions or than the whole KV cache).
        """
        if request_id in self._running or request_id in self._waiting:
            raise ValueError(f"duplicate request id {request_id!r}")
        cfg = self.model.cfg
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        validate_params(params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.logprobs)
        bad = next((t for t in prompt_ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} outside the vocabulary (size {cfg.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_position_embeddings:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) = {total} tokens "
                             f"exceeds the model's {cfg.max_position_embeddings} positions")
        need = self.blocks_needed(len(prompt_ids), params.max_tokens)
        if need > self.kv_blocks_total:
            raise ValueError(f"request needs {need} KV blocks, the cache has {self.kv_blocks_total}")
        params = replace(params, stop=tuple(s for s in params.stop if s))
        seq = self._waiting[request_id] = self._new_seq(request_id, prompt_ids, params,
                                                        make_generator(params.seed) if params.temperature > 0
                                                        else None, IncrementalDetokenizer(self.tokenizer, prompt_ids))
        seq.deadline = deadline
        self._admit()

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV now; False if it is unknown or already finished."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if self._running.pop(request_id, None) is not None:
            self._paused.discard(request_id)
            self.kv.free(request_id)
            self._admit()
            return True
        return False

    def pause(self, request_id: str) -> bool:
        """Leave a running sequence out of the steps (its KV stays reserved) until :meth:`resume` or
        :meth:`cancel`; False if it is not running."""
        if request_id not in self._running:
            return False
        self._paused.add(request_id)
        return True

    def resume(self, request_id: str) -> None:
        self._paused.discard(request_id)

    def export_sequence(self, request_id: str) -> SequenceState:
        """A copy of a running sequence that has its first token (its prompt prefilled), for
        :meth:`import_sequence` on another engine of the same model; the sequence stays here until it is
        cancelled, so a refused hand-over loses nothing. ``ValueError`` if it is unknown or still prefilling."""
        seq = self._running.get(request_id)
        if seq is None or seq.prefilling or not seq.output:
            raise ValueError(f"request {request_id!r} is not a running sequence past its prompt")
        slots = self.kv.seq_slots(request_id)[:seq.computed]
        kv = [(self.kv.k[layer].index_select(1, slots).clone(), self.kv.v[layer].index_select(1, slots).clone())
              for layer in self.kv.layers]
        return SequenceState(request_id, list(seq.prompt), list(seq.output), seq.params, seq.computed, seq.pending,
                             seq.generator.get_state() if seq.generator is not None else None, seq.detok.state(), kv)

    def import_sequence(self, state: SequenceState) -> None:
        """Continue an exported sequence here: its KV is written into newly reserved blocks and it decodes from the
        next step, as if it had run here throughout. ``ValueError`` (nothing changed) for a duplicate id, KV of
        another model's shape, or no running slot or KV blocks free for ``prompt + max_tokens`` now."""
        rid = state.request_id
        if rid in self._running or rid in self._waiting:
            raise ValueError(f"duplicate request id {rid!r}")
        layers = self.kv.layers
        if len(state.kv) != len(layers) or any(
                k.shape != (self.kv.k[layer].shape[0], state.computed, self.kv.k[layer].shape[2]) or v.shape != k.shape
                for layer, (k, v) in zip(layers, state.kv)):
            raise ValueError(f"request {rid!r}: its KV does not match this model's cache")
        if len(self._running) >= self.max_running or \
                self.blocks_needed(len(state.prompt), state.params.max_tokens) > self.kv_blocks_free:
            raise ValueError(f"request {rid!r}: no running slot or KV blocks free for it here")
        p = state.params
        gen = None
        if state.generator_state is not None:
            gen = make_generator(p.seed)
            gen.set_state(state.generator_state)
        detok = IncrementalDetokenizer(self.tokenizer)
        detok.restore(state.detok)
        self.kv.allocate(rid, len(state.prompt) + p.max_tokens)
        slots = self.kv.seq_slots(rid)[:state.computed]
        for layer, (k, v) in zip(layers, state.kv):
            self.kv.k[layer].index_copy_(1, slots, k.to(self.kv.k[layer].device, self.kv.dtype))
            self.kv.v[layer].index_copy_(1, slots, v.to(self.kv.v[layer].device, self.kv.dtype))
        seq = self._running[rid] = self._new_seq(rid, state.prompt, p, gen, detok)
        seq.output, seq.computed, seq.pending = list(state.output), state.computed, state.pending

    @staticmethod
    def _new_seq(rid: str, prompt: list[int], params: SamplingParams, gen: torch.Generator | None,
                 detok: IncrementalDetokenizer) -> _Seq:
        return _Seq(rid, list(prompt), params, gen, detok, hold=max((len(s) for s in params.stop), default=1) - 1,
                    prompt_t=torch.tensor(prompt, dtype=torch.long) if params.repetition_penalty != 1.0 else None)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            rid, seq = (min(self._waiting.items(), key=lambda x: x[1].deadline) if self.deadline_step is not None
                        else next(iter(self._waiting.items())))
            need = len(seq.prompt) + seq.params.max_tokens
            if not self.kv.allocator.can_allocate(need):
                break
            self.kv.allocate(rid, need)
            del self._waiting[rid]
            self._running[rid] = seq

    # ---------------------------------------------------------------- step
    def _plan(self) -> list[tuple[_Seq, SeqChunk]]:
        budget, plan = self.max_batch_tokens, []
        paused = self._paused
        decoding = [s for s in self._running.values() if not s.prefilling and s.request_id not in paused]
        for seq in decoding[:budget]:  # decode tokens first: they form the batched decode group
            plan.append((seq, SeqChunk(seq.request_id, seq.computed, 1)))
        budget -= len(plan)
        if len(decoding) > len(plan):  # more decoders than the budget: serve them round-robin
            for seq, _ in plan:
                self._running.move_to_end(seq.request_id)
        step = self.deadline_step
        n_dec = len(plan)  # the decode batch's context only where a step is priced (not on the plain path)
        dec_kv = sum(c.start + 1 for _, c in plan) if step is not None or self.step_cap is not None else 0
        if step is not None and budget:
            chunks = deadline_chunks(((s, s.computed, len(s.prompt) - s.computed, s.deadline)
                                      for s in self._running.values() if s.prefilling and s.request_id not in paused),
                                     budget, self.clock(),
                                     lambda p, pairs, reads, done: step(n_dec, dec_kv, p, pairs, reads, n_dec + done))
        else:
            chunks = []
            for seq in self._running.values():
                if budget and seq.prefilling and seq.request_id not in paused:
                    n = min(len(seq.prompt) - seq.computed, budget)
                    chunks.append((seq, n))
                    budget -= n
        if self.step_cap is not None and n_dec and chunks:
            cap, t = self.step_cap
            chunks = cap_chunks(((s, s.computed, n, len(s.prompt) - s.computed) for s, n in chunks), cap,
                                lambda p, pairs, reads, done: t(n_dec, dec_kv, p, pairs, reads, n_dec + done))
        return plan + [(s, SeqChunk(s.request_id, s.computed, n)) for s, n in chunks]

    def step(self) -> StepResult:
        """Run one iteration over the running batch; returns its events and timings.

        If a segment raises (e.g. from the segment runner), no request state has changed and the step can be
        retried: KV written for the chunk is overwritten by the retry and no sampling draw was consumed.
        """
        t0 = time.perf_counter()
        self._admit()
        plan = self._plan()
        if not plan:
            return StepResult([], {}, 0, 0, 0, (time.perf_counter() - t0) * 1e3)
        with torch.inference_mode():
            ids: list[int] = []
            for seq, c in plan:
                ids.extend(seq.prompt[c.start:c.start + c.length] if seq.prefilling else seq.output[-1:])
            ctx = build_context(self.kv, [c for _, c in plan])
            sampled = [i for i, (seq, c) in enumerate(plan) if c.start + c.length >= len(seq.prompt)]
            last = ctx.last_rows()
            head_rows = [last[i] for i in sampled]
            seg_ms: dict[str, float] = {}
            hidden = torch.tensor(ids, dtype=torch.long, device=self.model.device)
            for name in self._segments:
                if name == "head" and not head_rows:
                    break
                if name == "head" and len(head_rows) != len(ids):  # only rows that sample need logits
                    hidden = hidden.index_select(0, torch.tensor(head_rows, device=hidden.device))
                ts = time.perf_counter()
                if self.segment_runner is None:
                    hidden = self.model.run_segment(name, hidden, ctx)
                else:
                    hidden = self.segment_runner.run(name, hidden, ctx, partial(self.model.run_segment, name))
                seg_ms[name] = (time.perf_counter() - ts) * 1e3
            logits = hidden
            tokens = self._sample([plan[i][0] for i in sampled], logits)
        events, prefill_tokens, decode_tokens = [], 0, 0
        tok_of = dict(zip(sampled, tokens))
        for i, (seq, c) in enumerate(plan):
            if seq.prefilling:
                prefill_tokens += c.length
            else:
                decode_tokens += 1
            seq.computed += c.length
            if i in tok_of:
                events.append(self._advance(seq, tok_of[i]))
            else:
                events.append(TokenEvent(seq.request_id, [], "", None, len(seq.prompt), 0))
        self._admit()
        return StepResult(events, seg_ms, len(plan), prefill_tokens, decode_tokens, (time.perf_counter() - t0) * 1e3)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        if not seqs:
            return []
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for r, (s, g) in enumerate(zip(seqs, greedy)):
            p = s.params
            if s.generator is None and not p.options.penalised and p.logprobs is None:
                out.append(g)  # plain greedy: the batched argmax
                continue
            # seeded draws run on CPU generators so a seed gives the same tokens on any device
            row = logits[r].float().cpu()
            adj = apply_penalties(row, p.options, s.prompt_t, s.output) if p.options.penalised else row
            tok = int(adj.argmax()) if s.generator is None else \
                sample_row(adj, p.temperature, p.top_p, s.generator, p.top_k)
            s.last_logprobs = token_logprobs(row, tok, p.logprobs) if p.logprobs is not None else None
            out.append(tok)
        return out

    def _advance(self, seq: _Seq, token: int) -> TokenEvent:
        """Append a sampled token, detokenize, apply stop conditions; free KV when finished."""
        seq.output.append(token)
        p = seq.params
        finish = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            finish = "stop"
            new_text = seq.detok.flush()
        else:
            new_text = seq.detok.push([token])
            if len(seq.output) >= p.max_tokens:
                finish = "length"
                new_text += seq.detok.flush()
        text = seq.pending + new_text
        cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, finish, seq.pending = text[:cut], "stop", ""
        elif finish is None and seq.hold:
            keep = min(seq.hold, len(text))
            text, seq.pending = text[:len(text) - keep], text[len(text) - keep:]
        else:
            seq.pending = ""
        if finish is not None:
            self._running.pop(seq.request_id, None)
            self.kv.free(seq.request_id)
        return TokenEvent(seq.request_id, [token], text, finish, len(seq.prompt), len(seq.output),
                          seq.last_logprobs)
