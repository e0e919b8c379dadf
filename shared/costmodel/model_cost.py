"""Roofline time of operators, segments and whole iterations of one model on one device kind.

Per operator: ``max(flops / (peak × eff_c), bytes / (bandwidth × eff_m)) + launch overhead`` with the
efficiencies of the operator's kind (where the profile has a row for it) or class, and size bucket
(:mod:`shared.costmodel.profiles`). FLOPs and bytes come
from the operator graph (:mod:`shared.model.graph`). Attention is costed from the batch's KV work; decode and
prefill attention are separate kernels (as in paged-attention engines), so a decode-only iteration is exactly
affine in the batch's total KV length, which the simulator uses to advance runs of decode iterations in
closed form.
"""
from __future__ import annotations

import math
from typing import Mapping

from shared.costmodel.profiles import DeviceProfile
from shared.model.config import ModelConfig
from shared.model.graph import ModelGraph, OperatorSpec

OP_CLASS = {"qkv_proj": "gemm", "o_proj": "gemm", "gate_up_proj": "gemm", "down_proj": "gemm", "lm_head": "gemm",
            "attention": "attention", "rmsnorm": "elementwise", "rope": "elementwise", "residual_add": "elementwise",
            "silu_mul": "elementwise", "embed": "embedding"}
SEGMENT_KINDS = ("embed", "attn", "mlp", "head")


def tokens_bucket(n: int) -> int:
    """Batch tokens rounded up to a power of two: the shape bucket workers report segment times in, and the
    bucket of a ``kind@bucket`` correction factor."""
    b = 1
    while b < n:
        b <<= 1
    return b


def op_time(profile: DeviceProfile, op: OperatorSpec, tokens: int, kv_tokens: int = 0,
            kv_read_tokens: int | None = None) -> float:
    """Roofline time (s) of one operator over ``tokens`` rows (and ``kv_tokens`` query-key pairs)."""
    if tokens <= 0:
        return 0.0
    cls = OP_CLASS[op.kind]
    rc, rm = profile.rates(cls, tokens, op.kind)
    return max(op.flops(tokens, kv_tokens) / rc, op.bytes_moved(tokens, kv_tokens, kv_read_tokens) / rm) \
        + profile.launch_s(cls, op.kind)


class ModelCost:
    """Predicted times of one model (``config``) on one device kind (``profile``).

    ``correction`` maps a segment kind (embed, attn, mlp, head) to a multiplicative factor (from measured
    execution; see :class:`shared.costmodel.correction.CorrectionTable`), and optionally ``kind@bucket`` (e.g.
    ``mlp@4``) to a factor for iterations whose batch has that many tokens (rounded up to a power of two, as the
    workers bucket their measurements); a bucket without its own factor interpolates (geometrically, in log2 of
    the bucket) between the nearest buckets of the kind that have one, takes the nearest beyond the ends, and uses
    the kind's factor only when no bucket of the kind has one. Results are cached per batch size.
    """

    def __init__(self, config: ModelConfig, profile: DeviceProfile,
                 correction: Mapping[str, float] | None = None) -> None:
        self.config, self.profile = config, profile
        self.graph = ModelGraph.from_config(config)
        self.layers = config.num_hidden_layers
        self.corr = {k: float((correction or {}).get(k, 1.0)) for k in SEGMENT_KINDS}
        self.bucket_corr = {(k.split("@", 1)[0], int(k.split("@", 1)[1])): float(v)
                            for k, v in (correction or {}).items() if "@" in k}
        g = self.graph
        self._embed_ops = g.operators_of("embed")
        attn_ops = g.operators_of("attn[0]")
        self._attn_dense = [op for op in attn_ops if op.kind != "attention"]
        self._attn_op = next(op for op in attn_ops if op.kind == "attention")
        self._mlp_ops = g.operators_of("mlp[0]")
        self._head_ops = g.operators_of("head")
        self.weight_bytes = g.weight_bytes
        self.kv_bytes_per_token = config.kv_bytes_per_token()
        self.hidden_bytes_per_token = g.segment("mlp[0]").input_bytes_per_token
        self.mlp_weight_bytes = g.segment("mlp[0]").weight_bytes  # one layer
        self.attn_weight_bytes = g.segment("attn[0]").weight_bytes
        self._cache: dict[tuple[str, int], float] = {}
        self._factors: dict[tuple[str, int], float] = {}  # (kind, bucket) -> correction factor
        self._lines: dict[int, tuple[float, float, float]] = {}
        self._raw: dict[tuple[str, int], float] = {}  # (tag, tokens) -> uncorrected segment time; shared by copies

    def with_correction(self, correction: Mapping[str, float] | None) -> "ModelCost":
        """The same model and profile with other correction factors: shares the operator graph and the uncorrected
        per-segment times already computed (a fresh :class:`ModelCost` builds its graph again, milliseconds), so a
        scheduler taking new factors every half second does not pay for that on its next decision."""
        c = object.__new__(ModelCost)
        c.__dict__.update(self.__dict__)
        c.corr = {k: float((correction or {}).get(k, 1.0)) for k in SEGMENT_KINDS}
        c.bucket_corr = {(k.split("@", 1)[0], int(k.split("@", 1)[1])): float(v)
                         for k, v in (correction or {}).items() if "@" in k}
        c._cache, c._factors, c._lines = {}, {}, {}
        return c

    # ---------------------------------------------------------------- per segment (one layer)
    def factor(self, kind: str, batch_tokens: int) -> float:
        """Correction factor of segment ``kind`` in an iteration of ``batch_tokens`` tokens."""
        if not self.bucket_corr:
            return self.corr[kind]
        key = (kind, tokens_bucket(batch_tokens))
        f = self._factors.get(key)
        if f is None:
            f = self._factors[key] = self._bucket_factor(*key)
        return f

    def _bucket_factor(self, kind: str, b: int) -> float:
        f = self.bucket_corr.get((kind, b))
        if f is not None:
            return f
        known = sorted(k for (kk, k) in self.bucket_corr if kk == kind)
        lo = [k for k in known if k < b]
        hi = [k for k in known if k > b]
        if lo and hi:
            a, c = lo[-1], hi[0]
            w = (math.log2(b) - math.log2(a)) / (math.log2(c) - math.log2(a))
            return self.bucket_corr[(kind, a)] ** (1 - w) * self.bucket_corr[(kind, c)] ** w
        if lo or hi:
            return self.bucket_corr[(kind, (lo[-1] if lo else hi[0]))]
        return self.corr[kind]

    def _sum(self, tag: str, ops: list[OperatorSpec], tokens: int, batch_tokens: int | None = None) -> float:
        bt = tokens if batch_tokens is None else batch_tokens
        key = (tag, tokens, bt)
        t = self._cache.get(key)
        if t is None:
            raw = self._raw.get((tag, tokens))
            if raw is None:
                raw = self._raw[(tag, tokens)] = sum(op_time(self.profile, op, tokens) for op in ops)
            t = raw * self.factor(tag.split("_")[0], bt)
            self._cache[key] = t
        return t

    def embed_time(self, tokens: int) -> float:
        """``embed`` segment over ``tokens`` rows."""
        return self._sum("embed", self._embed_ops, tokens)

    def head_time(self, sampled: int, batch_tokens: int | None = None) -> float:
        """``head`` segment (final norm + lm-head) over the ``sampled`` rows of an iteration of ``batch_tokens``
        tokens (default: ``sampled``; it picks the correction bucket)."""
        return self._sum("head", self._head_ops, sampled, batch_tokens)

    def mlp_time(self, tokens: int) -> float:
        """One ``mlp[l]`` segment over ``tokens`` rows."""
        return self._sum("mlp", self._mlp_ops, tokens)

    def attn_dense_time(self, tokens: int) -> float:
        """One ``attn[l]`` segment without its attention kernel (norm, qkv, rope, o-proj, residual)."""
        return self._sum("attn_dense", self._attn_dense, tokens)

    def prefill_attention_time(self, tokens: int, pairs: int, reads: int, batch_tokens: int | None = None) -> float:
        """Attention kernel of one layer for prefill chunks: ``pairs`` query-key pairs, ``reads`` KV rows read."""
        return op_time(self.profile, self._attn_op, tokens, pairs, reads) * \
            self.factor("attn", tokens if batch_tokens is None else batch_tokens)

    def decode_attention_line(self, n_decode: int) -> tuple[float, float, float]:
        """(c0, c1, k_max): one layer's decode attention over ``n_decode`` sequences with total KV length K
        takes exactly ``c0 + c1*K`` seconds for ``K <= k_max`` (memory-bound region; ``inf`` when it always is)."""
        op, b = self._attn_op, n_decode
        rc, rm = self.profile.rates("attention", b)
        f1 = op.flops(b, 1) - op.flops(b, 0)
        beta0 = op.bytes_moved(b, 0, 0)
        beta1 = op.bytes_moved(b, 1, 1) - beta0
        k = self.factor("attn", n_decode)
        c0, c1 = (beta0 / rm + self.profile.launch_s("attention")) * k, beta1 / rm * k
        slope_c = f1 / rc
        k_max = float("inf") if beta1 / rm >= slope_c else (beta0 / rm) / (slope_c - beta1 / rm)
        return c0, c1, k_max

    def decode_attention_time(self, n_decode: int, kv: int, batch_tokens: int | None = None) -> float:
        """Attention kernel of one layer for ``n_decode`` decode tokens with total context ``kv``."""
        return op_time(self.profile, self._attn_op, n_decode, kv, kv) * \
            self.factor("attn", n_decode if batch_tokens is None else batch_tokens)

    # ---------------------------------------------------------------- whole iterations
    def decode_line(self, n_decode: int) -> tuple[float, float, float]:
        """(a, c, k_max): a decode-only iteration of ``n_decode`` sequences with total KV length K takes exactly
        ``a + c*K`` seconds while ``K <= k_max``."""
        line = self._lines.get(n_decode)
        if line is None:
            c0, c1, kmax = self.decode_attention_line(n_decode)
            b, n = n_decode, self.layers
            a = self.embed_time(b) + n * (self.attn_dense_time(b) + self.mlp_time(b) + c0) + self.head_time(b) \
                + self.profile.step_overhead_s
            line = (a, n * c1, kmax)
            self._lines[n_decode] = line
        return line

    def iteration_time(self, n_decode: int, decode_kv: int, prefill_tokens: int = 0, prefill_pairs: int = 0,
                       prefill_reads: int = 0, sampled: int | None = None) -> float:
        """One iteration: ``n_decode`` decode tokens (total context ``decode_kv``) plus prefill chunks
        (``prefill_tokens`` rows, ``prefill_pairs`` query-key pairs, ``prefill_reads`` KV rows read);
        ``sampled`` rows go through the head (default: ``n_decode``); the profile's per-step overhead is added."""
        t = n_decode + prefill_tokens
        if t <= 0:
            return 0.0
        if prefill_tokens == 0:
            a, c, kmax = self.decode_line(n_decode)
            if decode_kv <= kmax:
                return a + c * decode_kv
        s = n_decode if sampled is None else sampled
        per_layer = self.attn_dense_time(t) + self.mlp_time(t)
        if n_decode:
            per_layer += self.decode_attention_time(n_decode, decode_kv, t)
        if prefill_tokens:
            per_layer += self.prefill_attention_time(prefill_tokens, prefill_pairs, prefill_reads, t)
        return self.embed_time(t) + self.layers * per_layer + self.head_time(s, t) + self.profile.step_overhead_s

    def chunk_iteration(self, n_decode: int, decode_kv: int, queued_prefill: int, budget: int) -> tuple[float, int]:
        """(time, prefill rows) of a chunked-prefill iteration: ``n_decode`` decode rows (total context
        ``decode_kv``) and the next chunk of ``queued_prefill`` prompt tokens, as many as the ``budget`` of tokens per
        iteration leaves (one chunk from the start of a prompt); the first token of a prompt the chunk finishes is
        sampled with the decode rows."""
        p = min(queued_prefill, max(0, budget - n_decode))
        return self.iteration_time(n_decode, decode_kv, p, p * (p + 1) // 2, p, n_decode + (1 if p else 0)), p

    def prefill_time(self, input_tokens: int, chunk: int = 2048) -> float:
        """Time to prefill one prompt alone, in chunks of ``chunk`` tokens (the isolated TTFT)."""
        key = ("prefill", input_tokens * 100003 + chunk)
        cached = self._cache.get(key)  # type: ignore[call-overload]
        if cached is not None:
            return cached
        done, total = 0, 0.0
        while done < input_tokens:
            q = min(chunk, input_tokens - done)
            pairs = q * done + q * (q + 1) // 2
            last = done + q >= input_tokens
            total += self.iteration_time(0, 0, q, pairs, done + q, sampled=1 if last else 0)
            done += q
        self._cache[key] = total  # type: ignore[index]
        return total

    def isolated_latency(self, input_tokens: int, output_tokens: int, chunk: int = 2048) -> tuple[float, float]:
        """(TTFT, TPOT) of one request alone on the device: prefill, then batch-1 decode steps."""
        ttft = self.prefill_time(input_tokens, chunk)
        if output_tokens <= 1:
            return ttft, 0.0
        a, c, _ = self.decode_line(1)
        n = output_tokens - 1
        # decode step i attends to input + i positions (i = 1..n)
        total = sum(self.iteration_time(1, input_tokens + i) for i in range(1, n + 1)) if c == 0 else \
            n * a + c * (n * input_tokens + n * (n + 1) / 2)
        return ttft, total / n

    def request_work(self, input_tokens: int, output_tokens: int, ref_batch: int = 32) -> float:
        """Device-seconds a request costs at a reference decode batch: its prefill plus its share of
        ``ref_batch``-wide decode iterations (used to size containers from offered work)."""
        a, c, _ = self.decode_line(ref_batch)
        ctx = input_tokens + output_tokens / 2
        per_token = (a + c * ref_batch * ctx) / ref_batch
        return self.prefill_time(input_tokens) + max(output_tokens - 1, 0) * per_token
