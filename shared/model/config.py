"""Model shapes: a frozen config for Llama-family decoders and the named presets."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any


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
    bos_token_id: int = 256
    eos_token_id: int = 257
    tie_word_embeddings: bool = False
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> list[str]:
        """Return a list of problems ("field: what is wrong"); empty when the shape is usable."""
        errs = []
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                errs.append(f"{f}: must be a positive integer, got {v!r}")
        if not errs:
            if self.hidden_size % self.num_attention_heads:
                errs.append("hidden_size: must be divisible by num_attention_heads")
            if self.num_attention_heads % self.num_key_value_heads:
                errs.append("num_key_value_heads: must divide num_attention_heads")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            errs.append(f"dtype: must be float32, float16 or bfloat16, got {self.dtype!r}")
        return errs

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def param_counts(self) -> dict[str, int]:
        """Parameters per segment kind: embed, attn (one layer), mlp (one layer), head."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        attn = h + h * h + 2 * h * kv + h * h  # norm, q, k, v, o
        mlp = h + 3 * h * i  # norm, gate, up, down
        head = h + (0 if self.tie_word_embeddings else v * h)
        return {"embed": v * h, "attn": attn, "mlp": mlp, "head": head}

    def weight_bytes(self) -> int:
        p = self.param_counts()
        total = p["embed"] + p["head"] + self.num_hidden_layers * (p["attn"] + p["mlp"])
        return total * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, per token."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict (e.g. a Hugging Face config.json); unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "torch_dtype" in d and "dtype" not in d:
            kw["dtype"] = str(d["torch_dtype"]).replace("torch.", "")
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def with_(self, **kw: Any) -> "ModelConfig":
        return replace(self, **kw)


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
