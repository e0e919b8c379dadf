"""Reading a Hugging Face ``config.json`` (transformers 4 and 5 formats) and ``generation_config.json`` strictly.

Everything that changes what the model computes is either implemented here or refused with a
:class:`CheckpointError` naming the file and the field: an unknown ``architectures`` entry, ``hidden_act`` other
than SiLU, a rope-scaling type other than default/linear/llama3, a quantization config, an MLP bias. Missing
fields take the defaults of the transformers config class of that architecture, so a checkpoint means the same
here as there. transformers 5 keeps ``rope_theta`` and the scaling under ``rope_parameters`` and writes ``dtype``;
transformers 4 writes ``rope_theta`` and ``rope_scaling`` at the top level and ``torch_dtype``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.model.config import ModelConfig, normalise

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
# transformers' config-class defaults for the fields a checkpoint may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "head_dim": 128},
}
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
          "bfloat16": "bfloat16"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class CheckpointError(ValueError):
    """A checkpoint problem: ``file: field or tensor: what is wrong``."""

    def __init__(self, file: str | Path, tensor: str, problem: str) -> None:
        self.file, self.tensor, self.problem = str(file), tensor, problem
        super().__init__(f"{file}: {tensor}: {problem}")

    @property
    def field(self) -> str:
        return self.tensor


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint asks for (``generation_config.json``); None = the API's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()


def architecture_of(d: dict, file: Path) -> str:
    """``llama`` / ``mistral`` / ``qwen2`` / ``qwen3`` from ``architectures`` (or ``model_type``), else refused."""
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise CheckpointError(file, "architectures", f"{archs!r} is not supported; supported: "
                                  f"{', '.join(ARCHITECTURES)} (docs/models.md)")
        arch = ARCHITECTURES[archs[0]]
        mt = d.get("model_type")
        if mt is not None and mt != arch:
            raise CheckpointError(file, "model_type", f"{mt!r} does not match architectures {archs[0]}")
        return arch
    mt = d.get("model_type")
    if mt in DEFAULTS:
        return mt
    raise CheckpointError(file, "architectures", "missing (and model_type "
                          f"{mt!r} is not one of {', '.join(DEFAULTS)})")


def _int(d: dict, key: str, file: Path, default: Any = ...) -> Any:
    v = d.get(key, default)
    if v is ...:
        raise CheckpointError(file, key, "required field is missing")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise CheckpointError(file, key, f"expected an integer, got {v!r}")
    return v


def _rope(d: dict, file: Path) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either format."""
    params = d.get("rope_parameters")
    if params is not None:  # transformers 5
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise CheckpointError(file, "rope_parameters", "expected one mapping (per-layer-type RoPE is not "
                                  "supported)")
        where, scaling = "rope_parameters", dict(params)
        theta = scaling.pop("rope_theta", d.get("rope_theta", 10000.0))
    else:  # transformers 4
        where, scaling = "rope_scaling", dict(d.get("rope_scaling") or {})
        theta = d.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(file, f"{where}.rope_theta" if params is not None else "rope_theta",
                              f"expected a positive number, got {theta!r}")
    rtype = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rtype not in ROPE_KEYS:
        raise CheckpointError(file, f"{where}.rope_type", f"{rtype!r} is not supported; supported: "
                              f"{', '.join(ROPE_KEYS)}")
    prf = scaling.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise CheckpointError(file, "partial_rotary_factor", f"{prf!r}: partial rotary embeddings are not supported")
    out: dict[str, Any] = {"rope_type": rtype}
    for k in ROPE_KEYS[rtype]:
        v = scaling.pop(k, d.get("max_position_embeddings") if k == "original_max_position_embeddings" else None)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise CheckpointError(file, f"{where}.{k}", f"rope_type {rtype} needs a positive number, got {v!r}")
        out[k] = float(v) if k != "original_max_position_embeddings" else int(v)
    if rtype == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise CheckpointError(file, f"{where}.high_freq_factor", "must be greater than low_freq_factor")
    if scaling.get("attention_factor", 1.0) in (None, 1, 1.0):
        scaling.pop("attention_factor", None)
    if scaling:
        raise CheckpointError(file, f"{where}.{sorted(scaling)[0]}", f"not supported for rope_type {rtype}")
    return float(theta), out


def _context(d: dict, arch: str, max_pos: int, file: Path) -> tuple[int, str | None]:
    """The context served: the model's positions, cut to the sliding window where one is in force (then no
    window ever applies, so attention is exact), with a note saying so."""
    window = d.get("sliding_window", DEFAULTS[arch].get("sliding_window"))
    sliding = arch == "mistral" or bool(d.get("use_sliding_window"))
    lt = d.get("layer_types")
    if isinstance(lt, list) and any(t != "full_attention" for t in lt):
        bad = next(t for t in lt if t != "full_attention")
        if bad != "sliding_attention":
            raise CheckpointError(file, "layer_types", f"{bad!r} layers are not supported")
        sliding = True
    if not sliding or window is None:
        return max_pos, None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CheckpointError(file, "sliding_window", f"expected a positive integer, got {window!r}")
    if window >= max_pos:
        return max_pos, None
    return window, f"context cut from {max_pos} to the sliding window of {window} tokens (sliding_window)"


def parse_hf_config(d: Any, file: str | Path = "config.json", *, notes: list[str] | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a ``config.json`` dict, or :class:`CheckpointError` naming the field."""
    file = Path(file)
    if not isinstance(d, dict):
        raise CheckpointError(file, "(top level)", "expected a JSON object")
    arch = architecture_of(d, file)
    dflt = DEFAULTS[arch]
    for key in REQUIRED:
        _int(d, key, file)
    if "quantization_config" in d or "compression_config" in d:
        q = d.get("quantization_config") or d.get("compression_config") or {}
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise CheckpointError(file, "quantization_config", f"quantized weights ({method}) are not supported; "
                              "serve the unquantized checkpoint or a GGUF file (docs/models.md)")
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if act != "silu":
        raise CheckpointError(file, "hidden_act", f"{act!r} is not supported (only silu)")
    if d.get("mlp_bias"):
        raise CheckpointError(file, "mlp_bias", "MLP biases are not supported")
    if d.get("pretraining_tp") not in (None, 1) and not isinstance(d.get("pretraining_tp"), int):
        raise CheckpointError(file, "pretraining_tp", f"expected an integer, got {d.get('pretraining_tp')!r}")
    theta, rope = _rope(d, file)
    max_pos = _int(d, "max_position_embeddings", file, dflt["max_position_embeddings"])
    context, note = _context(d, arch, max_pos, file)
    if note and notes is not None:
        notes.append(note)
    heads = _int(d, "num_attention_heads", file)
    head_dim = _int(d, "head_dim", file, dflt["head_dim"])
    hidden = _int(d, "hidden_size", file)
    bias = arch in ("llama", "qwen3") and bool(d.get("attention_bias", False))  # Mistral has none; Qwen2 q/k/v always
    raw_dtype = d.get("dtype", d.get("torch_dtype")) or "float32"
    dtype = DTYPES.get(str(raw_dtype).replace("torch.", ""))
    if dtype is None:
        raise CheckpointError(file, "dtype" if "dtype" in d else "torch_dtype",
                              f"{raw_dtype!r} is not float32, float16 or bfloat16")
    eps = d.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise CheckpointError(file, "rms_norm_eps", f"expected a positive number, got {eps!r}")
    eos = d.get("eos_token_id", dflt["eos_token_id"])
    for key, v in (("bos_token_id", d.get("bos_token_id", dflt["bos_token_id"])), ("eos_token_id", eos)):
        ids = v if isinstance(v, list) else [v]
        if any(x is not None and (isinstance(x, bool) or not isinstance(x, int)) for x in ids):
            raise CheckpointError(file, key, f"expected a token id or a list of them, got {v!r}")
    cfg = ModelConfig(**normalise(dict(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=_int(d, "num_key_value_heads", file, None) or heads,
        head_dim_explicit=head_dim if head_dim and (hidden % heads or head_dim != hidden // heads) else 0,
        max_position_embeddings=context, rms_norm_eps=float(eps), rope_theta=theta, rope_scaling=rope,
        bos_token_id=d.get("bos_token_id", dflt["bos_token_id"]),
        eos_token_id=[e for e in (eos if isinstance(eos, list) else [eos]) if e is not None] or None,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), dtype=dtype,
        attention_bias=arch == "qwen2" or bias, o_bias=bias,
        qk_norm=arch == "qwen3")))
    errs = cfg.validate()
    if errs:
        field, problem = errs[0].split(": ", 1)
        raise CheckpointError(file, field, problem)
    return cfg


def read_json(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(file, "(file)", f"{file.name} not found")
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(file, "(file)", f"unreadable: {e}") from None
    except ValueError as e:
        raise CheckpointError(file, "(file)", f"invalid JSON: {e}") from None


def parse_generation_config(file: Path) -> GenerationDefaults:
    """``generation_config.json`` defaults (absent file: none). Only sampling fields are read; ``do_sample``
    is ignored, as vLLM does: a request without ``temperature`` samples at the checkpoint's temperature."""
    if not file.is_file():
        return GenerationDefaults()
    d = read_json(file)
    if not isinstance(d, dict):
        raise CheckpointError(file, "(top level)", "expected a JSON object")
    out: dict[str, Any] = {}
    for key, kinds, lo in (("temperature", (int, float), 0.0), ("top_p", (int, float), 0.0),
                           ("top_k", (int,), 0), ("repetition_penalty", (int, float), 0.0)):
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, kinds) or v < lo or (key != "top_k" and v == lo and
                                                                           key != "temperature"):
            raise CheckpointError(file, key, f"out of range: {v!r}")
        out[key] = v
    eos = d.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
        raise CheckpointError(file, "eos_token_id", f"expected a token id or a list of them, got {eos!r}")
    return GenerationDefaults(eos_token_ids=tuple(ids), **out)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` (transformers 4 format) for ``cfg``: what :func:`save_checkpoint` writes."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[cfg.architecture]
    d: dict[str, Any] = {
        "architectures": [arch], "model_type": cfg.architecture, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": dict(cfg.rope_scaling) or None,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": cfg.dtype}
    if cfg.architecture in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.architecture == "mistral":
        d["sliding_window"] = None
    return d
