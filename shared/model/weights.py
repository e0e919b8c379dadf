"""Model weights: seeded random initialisation, and Hugging Face-style checkpoint directories.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files with Llama tensor names
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, …, ``lm_head.weight``), and
optionally ``tokenizer.json``.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.model.config import ModelConfig
from shared.model.graph import segment_names
from shared.model.llama import LlamaModel, hf_names

INIT_STD = 0.02  # GPT-2/Llama initialiser scale: keeps random-weight activations finite over many layers


class CheckpointError(ValueError):
    """A checkpoint problem: ``file: tensor: what is wrong``."""

    def __init__(self, file: str | Path, tensor: str, problem: str) -> None:
        self.file, self.tensor, self.problem = str(file), tensor, problem
        super().__init__(f"{file}: {tensor}: {problem}")


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``cfg`` under Hugging Face names (same seed, same tensors).

    Matrices ~ N(0, 0.02²), norm weights = 1; drawn in float32 from one CPU generator in a fixed order, then
    cast to ``cfg.dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    out: dict[str, torch.Tensor] = {}
    for seg in segment_names(cfg.num_hidden_layers):
        for name, shape in hf_names(cfg, seg).items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                out[name] = out["model.embed_tokens.weight"]
            elif len(shape) == 1:
                out[name] = torch.ones(shape, dtype=dtype)
            else:
                out[name] = (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)
    return out


def save_checkpoint(model: LlamaModel, directory: str | Path, *, tokenizer_json: str | Path | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (and a copy of ``tokenizer_json``) for a full model."""
    missing = set(segment_names(model.cfg.num_hidden_layers)) - set(model.segments)
    if missing:
        raise ValueError(f"save_checkpoint needs a full model; this one lacks {sorted(missing)}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for seg in segment_names(model.cfg.num_hidden_layers):
        for name, t in model.segment_state_dict(seg).items():
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                continue
            tensors[name] = t.detach().to("cpu").contiguous().clone()
    cfg = model.cfg.to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=model.cfg.dtype)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (d / "tokenizer.json").write_text(Path(tokenizer_json).read_text())
    return d


def load_config(directory: str | Path) -> ModelConfig:
    """Read and validate ``config.json`` of a checkpoint directory."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        raise CheckpointError(f, "(file)", "config.json not found")
    try:
        cfg = ModelConfig.from_dict(json.loads(f.read_text()))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f, "(config)", f"unreadable: {e}") from None
    errs = cfg.validate()
    if errs:
        raise CheckpointError(f, errs[0].split(":")[0], errs[0].split(": ", 1)[1])
    return cfg


def _index(directory: Path) -> dict[str, Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "(files)", "no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in where:
                        raise CheckpointError(f, name, f"tensor also present in {where[name].name}")
                    where[name] = f
        except SafetensorError as e:
            raise CheckpointError(f, "(file)", f"not a readable safetensors file: {e}") from None
    return where


def load_state_dict(directory: str | Path, cfg: ModelConfig, segments: Iterable[str] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Read the tensors of ``segments`` (all by default), checking names and shapes against ``cfg``."""
    d = Path(directory)
    where = _index(d)
    wanted = list(segments) if segments is not None else segment_names(cfg.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for seg in wanted:
            for name, shape in hf_names(cfg, seg).items():
                src = name
                if name == "lm_head.weight" and name not in where and cfg.tie_word_embeddings:
                    src = "model.embed_tokens.weight"
                if src not in where:
                    files = ", ".join(sorted({p.name for p in where.values()}))
                    raise CheckpointError(d, name, f"missing tensor (looked in {files})")
                f = where[src]
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                t = handles[f].get_tensor(src)  # type: ignore[attr-defined]
                if tuple(t.shape) != shape:
                    raise CheckpointError(f, src, f"shape {tuple(t.shape)}, expected {shape} for config.json")
                if not t.is_floating_point():
                    raise CheckpointError(f, src, f"dtype {t.dtype} is not a floating-point type")
                out[name] = t
    return out


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    segments: Iterable[str] | None = None) -> LlamaModel:
    """Build a model (or, with ``segments``, a partial one) from a checkpoint directory."""
    cfg = load_config(directory)
    segs = list(segments) if segments is not None else None
    state = load_state_dict(directory, cfg, segs)
    dtype = getattr(torch, cfg.dtype)
    state = {k: v.to(dtype) for k, v in state.items()}
    if segs is None:
        return LlamaModel(cfg, device, weights=state)
    model = LlamaModel.partial(cfg, segs, device)
    for s in segs:
        model.load_segment(s, {n: state[n] for n in hf_names(cfg, s)})
    return model
