"""Model shapes: a frozen config for the Llama-family decoders served here, and the named presets.

One shape covers Llama (incl. Llama 3.x rope scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm):
they differ only in the fields below. Reading a checkpoint's ``config.json`` strictly (refusing what this code
does not implement) is :mod:`shared.model.hf_config`'s job; :meth:`ModelConfig.from_dict` is the lenient form
for presets and inline configs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (field names follow Hugging Face ``config.json``)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bos_token_id: int | None = 256
    eos_token_id: int | tuple[int, ...] | None = 257  # a checkpoint may list several (Llama 3: <|eot_id|> too)
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    architecture: str = "llama"
    head_dim_explicit: int = 0  # config.json ``head_dim`` when it is not hidden_size / num_attention_heads
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama with attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs; () = plain RoPE

    @property
    def head_dim(self) -> int:
        return self.head_dim_explicit or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @property
    def rope(self) -> dict[str, Any]:
        """The rope scaling parameters as a dict (``rope_type`` "default" when unscaled)."""
        return dict(self.rope_scaling) if self.rope_scaling else {"rope_type": "default"}

    def validate(self) -> list[str]:
        """Return a list of problems ("field: what is wrong"); empty when the shape is usable."""
        errs = []
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                errs.append(f"{f}: must be a positive integer, got {v!r}")
        if not errs:
            if not self.head_dim_explicit and self.hidden_size % self.num_attention_heads:
                errs.append("hidden_size: must be divisible by num_attention_heads")
            if self.num_attention_heads % self.num_key_value_heads:
                errs.append("num_key_value_heads: must divide num_attention_heads")
            if self.head_dim % 2:
                errs.append(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            errs.append(f"dtype: must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.architecture not in ARCHITECTURES:
            errs.append(f"architecture: must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}")
        rt = self.rope.get("rope_type")
        if rt not in ROPE_TYPES:
            errs.append(f"rope_scaling: rope_type must be one of {', '.join(ROPE_TYPES)}, got {rt!r}")
        for name, tid in (("bos_token_id", self.bos_token_id), *(("eos_token_id", e) for e in self.eos_token_ids)):
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < self.vocab_size):
                errs.append(f"{name}: {tid!r} is not a token id of a {self.vocab_size}-token vocabulary")
        return errs

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def param_counts(self) -> dict[str, int]:
        """Parameters per segment kind: embed, attn (one layer), mlp (one layer), head."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.q_dim, self.kv_dim
        attn = h + h * (q + 2 * kv) + q * h  # norm, q, k, v, o
        attn += (q + 2 * kv if self.attention_bias else 0) + (h if self.o_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = h + 3 * h * i  # norm, gate, up, down
        head = h + (0 if self.tie_word_embeddings else v * h)
        return {"embed": v * h, "attn": attn, "mlp": mlp, "head": head}

    def weight_bytes(self) -> int:
        p = self.param_counts()
        total = p["embed"] + p["head"] + self.num_hidden_layers * (p["attn"] + p["mlp"])
        return total * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, per token."""
        return 2 * self.num_hidden_layers * self.kv_dim * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict of this class's fields (presets, inline configs, :meth:`to_dict`); unknown keys are
        ignored. Checkpoints are read by :func:`shared.model.hf_config.parse_hf_config`, which refuses them."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "torch_dtype" in d and "dtype" not in d:
            kw["dtype"] = str(d["torch_dtype"]).replace("torch.", "")
        if "head_dim" in d and "head_dim_explicit" not in d:
            kw["head_dim_explicit"] = d["head_dim"] or 0
        return cls(**normalise(kw))

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        from shared.model.hf_config import parse_hf_config
        f = Path(path) / "config.json"
        return parse_hf_config(json.loads(f.read_text()), f)

    def with_(self, **kw: Any) -> "ModelConfig":
        return replace(self, **normalise(kw))


def normalise(kw: dict[str, Any]) -> dict[str, Any]:
    """Hashable forms of the list/dict fields (the config is a dict key in the cost model)."""
    out = dict(kw)
    if isinstance(out.get("eos_token_id"), list):
        eos = tuple(out["eos_token_id"])
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    rs = out.get("rope_scaling")
    if isinstance(rs, dict):
        out["rope_scaling"] = tuple(sorted(rs.items())) if rs and rs.get("rope_type", "default") != "default" else ()
    elif isinstance(rs, list):
        out["rope_scaling"] = tuple(tuple(p) for p in rs)
    elif rs is None and "rope_scaling" in out:
        out["rope_scaling"] = ()
    return out


# Tiny shapes run real torch compute on CPU; the 7B/13B shapes feed the cost model and GPUs.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-2l": ModelConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2),
    "small": ModelConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4),
    "llama-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                            dtype="float16"),
    "llama-13b": ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                             num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                             dtype="float16"),
}
