"""The operator graph of a Llama-family decoder as pure data (no torch).

A model is a chain of segments (``embed``, ``attn[l]``, ``mlp[l]`` for every layer, ``head``); each segment is a
chain of operators. Shapes, FLOPs and bytes are functions of the batch: ``tokens`` is the number of token rows
entering the operator and ``kv_tokens`` the attention work of the batch (see :func:`batch_kv_work`).

Conventions (shared with the cost model and the simulator):

* ``kv_tokens`` counts query-key pairs: the sum, over every query token of the batch, of the KV positions it
  attends to (its own position included). For a decode token this is the sequence's context length, so for a
  decode-only batch it is the sum of context lengths.
* ``kv_read_tokens`` (optional, defaults to ``kv_tokens``) counts KV positions read from the cache, each
  sequence's context once. It differs from ``kv_tokens`` only for prefill chunks.
* For ``head`` the caller passes the number of sampled rows (one per sequence that samples this step), because
  the engine runs the final norm and lm-head only on those rows.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from shared.model.config import ModelConfig

OPERATOR_KINDS = ("embed", "rmsnorm", "qkv_proj", "rope", "attention", "o_proj", "residual_add",
                  "gate_up_proj", "silu_mul", "down_proj", "lm_head")
SEGMENT_KINDS = ("embed", "attn", "mlp", "head")
_MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
TOKEN_ID_BYTES = 4  # token ids travel as int32


def segment_names(num_layers: int) -> list[str]:
    """Segment names in execution order: ``embed``, ``attn[0]``, ``mlp[0]``, …, ``head``."""
    out = ["embed"]
    for layer in range(num_layers):
        out += [f"attn[{layer}]", f"mlp[{layer}]"]
    out.append("head")
    return out


@functools.lru_cache(maxsize=8192)
def parse_segment(name: str) -> tuple[str, int | None]:
    """Split a segment name into (kind, layer); ``ValueError`` for a malformed name."""
    if name in ("embed", "head"):
        return name, None
    for kind in ("attn", "mlp"):
        if name.startswith(kind + "[") and name.endswith("]"):
            idx = name[len(kind) + 1:-1]
            if idx.isdigit():
                return kind, int(idx)
    raise ValueError(f"bad segment name {name!r}: expected embed, head, attn[<layer>] or mlp[<layer>]")


def batch_kv_work(seqs: Iterable[tuple[int, int]]) -> tuple[int, int, int]:
    """(tokens, kv_tokens, kv_read_tokens) of a batch given ``(new_tokens, cached_tokens)`` per sequence.

    ``cached_tokens`` is the KV already in the cache before this step (0 for a fresh prefill, context-1 for
    a decode token). Each new token at position p attends to p+1 positions.
    """
    tokens = pairs = reads = 0
    for new, cached in seqs:
        tokens += new
        pairs += new * cached + new * (new + 1) // 2
        reads += cached + new
    return tokens, pairs, reads


@dataclass(frozen=True)
class OperatorSpec:
    """One node of the graph. ``in_features``/``out_features`` are per-token widths of its input/output."""

    name: str
    kind: str
    segment: str
    inputs: tuple[str, ...]
    weight_bytes: int
    in_features: int
    out_features: int
    dtype_bytes: int
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0

    def output_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the output tensor for a batch of ``tokens`` rows."""
        return (tokens, self.out_features)

    def flops(self, tokens: int, kv_tokens: int = 0) -> float:
        """Floating-point operations (a multiply-add counts 2)."""
        k, t = self.kind, tokens
        if k in _MATMULS:
            return 2.0 * t * self.in_features * self.out_features
        if k == "rmsnorm":
            return 4.0 * t * self.in_features  # square, sum, scale, weight
        if k == "rope":
            rotated = (self.num_heads + self.num_kv_heads) * self.head_dim
            return 3.0 * t * rotated
        if k == "attention":
            # QK^T and PV: 2 FLOPs per pair per head-dim each; softmax ~5 per pair per head
            return 4.0 * kv_tokens * self.num_heads * self.head_dim + 5.0 * kv_tokens * self.num_heads
        if k == "residual_add":
            return float(t * self.out_features)
        if k == "silu_mul":
            return 5.0 * t * self.out_features
        return 0.0  # embed: a gather

    def bytes_moved(self, tokens: int, kv_tokens: int = 0, kv_read_tokens: int | None = None) -> float:
        """Bytes read and written: weights, input and output activations, and (attention) KV read + write."""
        db, t = self.dtype_bytes, tokens
        if self.kind == "embed":
            return float(t * TOKEN_ID_BYTES + 2 * t * self.out_features * db)  # ids in, rows gathered, rows out
        if self.kind == "attention":
            kv_width = 2 * self.num_kv_heads * self.head_dim
            reads = kv_tokens if kv_read_tokens is None else kv_read_tokens
            return float(t * self.in_features * db + t * self.out_features * db
                         + t * kv_width * db + reads * kv_width * db)
        if self.kind == "rope":  # q and k are rotated (read and written); v passes through untouched
            return float(2 * t * (self.num_heads + self.num_kv_heads) * self.head_dim * db)
        n_inputs = 2 if self.kind == "residual_add" else 1
        return float(self.weight_bytes + n_inputs * t * self.in_features * db + t * self.out_features * db)


@dataclass(frozen=True)
class SegmentSpec:
    """A contiguous chain of operators placed as a unit."""

    name: str
    kind: str
    layer: int | None
    operators: tuple[str, ...]
    weight_bytes: int
    stateful: bool
    input_bytes_per_token: int
    output_bytes_per_token: int

    def input_bytes(self, tokens: int) -> int:
        """Bytes entering the segment (token ids for embed, hidden states otherwise)."""
        return tokens * self.input_bytes_per_token

    def output_bytes(self, tokens: int) -> int:
        """Bytes leaving the segment (logits for head, hidden states otherwise)."""
        return tokens * self.output_bytes_per_token

    def activation_bytes(self, tokens: int) -> int:
        """Bytes in plus bytes out: what a guest placement moves across the link per micro-batch."""
        return self.input_bytes(tokens) + self.output_bytes(tokens)


class ModelGraph:
    """Operators and segments of one model shape, in execution order."""

    def __init__(self, config: ModelConfig, operators: Iterable[OperatorSpec], segments: Iterable[SegmentSpec]):
        self.config = config
        self.operators: list[OperatorSpec] = list(operators)  # execution order
        self.segments: list[SegmentSpec] = list(segments)  # execution order
        self._ops = {op.name: op for op in self.operators}
        self._by_name = {s.name: s for s in self.segments}

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "ModelGraph":
        """Build the graph of ``cfg`` (weights counted at ``cfg.dtype``)."""
        h, i, v, db = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.dtype_bytes
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = (nh + 2 * kvh) * hd
        heads = dict(num_heads=nh, num_kv_heads=kvh, head_dim=hd)
        ops: list[OperatorSpec] = []
        segs: list[SegmentSpec] = []

        def seg(name: str, kind: str, layer: int | None, chain: list[tuple], stateful: bool,
                in_b: int, out_b: int, prev: str | None) -> str:
            # chain: (suffix, kind, weight_params, in_features, out_features, extra input ops, OperatorSpec kwargs)
            names = []
            for suffix, kind_, params, fin, fout, extra, kw in chain:
                op_name = f"{name}.{suffix}"
                inputs = tuple(x for x in (prev, *extra) if x)
                ops.append(OperatorSpec(op_name, kind_, name, inputs, params * db, fin, fout, db, **kw))
                names.append(op_name)
                prev = op_name
            segs.append(SegmentSpec(name, kind, layer, tuple(names), sum(p for _, _, p, *_ in chain) * db,
                                    stateful, in_b, out_b))
            return prev  # type: ignore[return-value]

        last = seg("embed", "embed", None, [("embed_tokens", "embed", v * h, 1, h, (), {})],
                   False, TOKEN_ID_BYTES, h * db, None)
        for layer in range(cfg.num_hidden_layers):
            a, m = f"attn[{layer}]", f"mlp[{layer}]"
            seg_in = last
            last = seg(a, "attn", layer, [
                ("input_norm", "rmsnorm", h, h, h, (), {}),
                ("qkv_proj", "qkv_proj", h * qkv + (qkv if cfg.attention_bias else 0), h, qkv, (), {}),
                ("rope", "rope", 2 * hd if cfg.qk_norm else 0, qkv, qkv, (), heads),  # Qwen3's q/k norms here
                ("attention", "attention", 0, nh * hd, nh * hd, (), heads),
                ("o_proj", "o_proj", nh * hd * h + (h if cfg.o_bias else 0), nh * hd, h, (), {}),
                ("residual", "residual_add", 0, h, h, (seg_in,), {}),
            ], True, h * db, h * db, seg_in)
            seg_in = last
            last = seg(m, "mlp", layer, [
                ("post_norm", "rmsnorm", h, h, h, (), {}),
                ("gate_up_proj", "gate_up_proj", 2 * h * i, h, 2 * i, (), {}),
                ("silu_mul", "silu_mul", 0, 2 * i, i, (), {}),
                ("down_proj", "down_proj", i * h, i, h, (), {}),
                ("residual", "residual_add", 0, h, h, (seg_in,), {}),
            ], False, h * db, h * db, seg_in)
        seg("head", "head", None, [
            ("final_norm", "rmsnorm", h, h, h, (), {}),
            ("lm_head", "lm_head", 0 if cfg.tie_word_embeddings else v * h, h, v, (), {}),
        ], False, h * db, v * db, last)
        return cls(cfg, ops, segs)

    # ---------------------------------------------------------------- queries
    def segment_names(self) -> list[str]:
        """Names of the segments in execution order."""
        return [s.name for s in self.segments]

    def segment(self, name: str) -> SegmentSpec:
        """The segment called ``name``; ``KeyError`` naming the valid range otherwise."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no segment {name!r} in a {self.config.num_hidden_layers}-layer model "
                           f"(valid: embed, attn[0..{self.config.num_hidden_layers - 1}], mlp[..], head)") from None

    def operator(self, name: str) -> OperatorSpec:
        """The operator called ``name`` (e.g. ``attn[3].qkv_proj``)."""
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"no operator {name!r} in this graph") from None

    def operators_of(self, segment: str) -> list[OperatorSpec]:
        """The operators of a segment, in execution order."""
        return [self._ops[n] for n in self.segment(segment).operators]

    def segment_flops(self, name: str, tokens: int, kv_tokens: int = 0) -> float:
        """Sum of the segment's operator FLOPs."""
        return sum(op.flops(tokens, kv_tokens) for op in self.operators_of(name))

    def segment_bytes(self, name: str, tokens: int, kv_tokens: int = 0, kv_read_tokens: int | None = None) -> float:
        """Sum of the segment's operator bytes moved."""
        return sum(op.bytes_moved(tokens, kv_tokens, kv_read_tokens) for op in self.operators_of(name))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (tied embeddings counted once)."""
        return sum(s.weight_bytes for s in self.segments)

    # ---------------------------------------------------------------- plain-data form
    def to_dict(self) -> dict[str, Any]:
        """Plain types only (str/int/float/bool/None/list/dict), ready for MessagePack."""
        return {
            "config": self.config.to_dict(),
            "operators": [{**asdict(op), "inputs": list(op.inputs)} for op in self.operators],
            "segments": [{**asdict(s), "operators": list(s.operators)} for s in self.segments],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelGraph":
        """Inverse of :meth:`to_dict`."""
        ops = [OperatorSpec(**{**o, "inputs": tuple(o["inputs"])}) for o in d["operators"]]
        segs = [SegmentSpec(**{**s, "operators": tuple(s["operators"])}) for s in d["segments"]]
        return cls(ModelConfig.from_dict(d["config"]), ops, segs)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ModelGraph) and self.config == other.config
                and self.operators == other.operators and self.segments == other.segments)

    def __repr__(self) -> str:
        return f"ModelGraph(layers={self.config.num_hidden_layers}, operators={len(self.operators)})"
