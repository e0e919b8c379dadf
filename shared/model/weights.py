"""Model weights: seeded random initialisation, and loading checkpoints straight into the engine's tensors.

A checkpoint is a Hugging Face directory (``config.json``, one or more ``*.safetensors`` files, optionally sharded
with ``model.safetensors.index.json``, ``generation_config.json`` and tokenizer files) or one ``.gguf`` file
(:mod:`shared.model.gguf_file`). Loading allocates the model's tensors once and copies each checkpoint tensor
into them in row chunks read with ``pread`` (at most :data:`CHUNK_BYTES` at a time, converted to the engine's
dtype on the way), so the peak memory is the weights plus one chunk: no memory-mapped file pages, no state dict
of the whole model next to it. Every tensor of the checkpoint must be read by the model and every tensor the
model needs must be there, with its shape; anything else is a :class:`CheckpointError` naming file and tensor.
"""
from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from safetensors.torch import save_file

from shared.model.config import ModelConfig
from shared.model.graph import segment_names
from shared.model.hf_config import CheckpointError, read_json, to_hf_config
from shared.model.llama import LlamaModel, hf_names

__all__ = ["CheckpointError", "load_checkpoint", "load_state_dict", "random_state_dict", "save_checkpoint",
           "checkpoint_tensors", "check_tensors"]

INIT_STD = 0.02  # GPT-2/Llama initialiser scale: keeps random-weight activations finite over many layers
CHUNK_BYTES = 1 << 20
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older transformers saved; derived from config.json
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``cfg`` under Hugging Face names (same seed, same tensors).

    Matrices ~ N(0, 0.02²), norm weights = 1, biases ~ N(0, 0.02²); drawn in float32 from one CPU generator in a
    fixed order, then cast to ``cfg.dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    out: dict[str, torch.Tensor] = {}
    for seg in segment_names(cfg.num_hidden_layers):
        for name, shape in hf_names(cfg, seg).items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                out[name] = out["model.embed_tokens.weight"]
            elif len(shape) == 1 and not name.endswith(".bias"):
                out[name] = torch.ones(shape, dtype=dtype)
            else:
                out[name] = (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)
    return out


def save_checkpoint(model: LlamaModel, directory: str | Path, *, tokenizer_json: str | Path | None = None) -> Path:
    """Write ``config.json`` (transformers format) + ``model.safetensors`` (and a copy of ``tokenizer_json``)."""
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
    (d / "config.json").write_text(json.dumps(to_hf_config(model.cfg), indent=2) + "\n")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (d / "tokenizer.json").write_text(Path(tokenizer_json).read_text())
    return d


def load_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint directory or GGUF file (strict: see :mod:`shared.model.hf_config`)."""
    from shared.model.checkpoint import inspect_checkpoint
    return inspect_checkpoint(path, check_weights=False).config


# ---------------------------------------------------------------- the tensors of a checkpoint
class _Source:
    """Where one tensor's rows are: file, shape, and a reader of row ranges as float tensors."""

    def __init__(self, file: Path, shape: tuple[int, ...], read: Callable[[int, int, int], torch.Tensor],
                 kind: str) -> None:
        self.file, self.shape, self.read, self.kind = file, shape, read, kind


def _safetensors_header(f: Path) -> dict:
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f, "(file)", "not a readable safetensors file: too short")
            n = struct.unpack("<Q", head)[0]
            size = os.fstat(fh.fileno()).st_size
            if n > min(size - 8, 100 << 20):
                raise CheckpointError(f, "(file)", "not a readable safetensors file: bad header length")
            hdr = json.loads(fh.read(n))
    except OSError as e:
        raise CheckpointError(f, "(file)", f"unreadable: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f, "(file)", f"not a readable safetensors file: {e}") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f, "(file)", "not a readable safetensors file: header is not an object")
    hdr.pop("__metadata__", None)
    base = 8 + n
    for name, e in hdr.items():
        try:
            a, b = e["data_offsets"]
            shape, dt = tuple(int(x) for x in e["shape"]), e["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f, name, "malformed safetensors header entry") from None
        if base + b > size or a > b:
            raise CheckpointError(f, name, "tensor data lies past the end of the file (truncated?)")
        e["_abs"] = base + a
        e["_shape"] = shape
    return hdr


def _st_reader(fds: dict[Path, int], f: Path, e: dict, name: str):
    dtype = ST_DTYPES.get(e["dtype"])
    if dtype is None:
        raise CheckpointError(f, name, f"dtype {e['dtype']} is not a floating-point type")
    shape = e["_shape"]
    row_elems = int(np.prod(shape[1:])) if len(shape) > 1 else (shape[0] if shape else 1)
    elem = torch.tensor([], dtype=dtype).element_size()

    def read(fd_unused: int, r0: int, r1: int) -> torch.Tensor:
        rows = (r1 - r0) if len(shape) > 1 else 1
        nbytes = rows * row_elems * elem
        start = e["_abs"] + (r0 * row_elems * elem if len(shape) > 1 else 0)
        buf = bytearray(nbytes)
        got = os.preadv(fds[f], [buf], start)
        if got != nbytes:
            raise CheckpointError(f, name, "short read (file truncated?)")
        t = torch.frombuffer(buf, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        return t.reshape((r1 - r0, *shape[1:]) if len(shape) > 1 else shape)

    return read


def checkpoint_tensors(path: str | Path, cfg: ModelConfig, fds: dict[Path, int] | None = None
                       ) -> dict[str, _Source]:
    """HF name → source of every tensor of a checkpoint directory or GGUF file (names not mapped by a GGUF
    file keep their GGUF name, so that :func:`check_tensors` reports them)."""
    p = Path(path)
    fds = fds if fds is not None else {}
    out: dict[str, _Source] = {}
    if p.suffix == ".gguf":
        from shared.model.gguf_file import hf_name, open_gguf, unpermute_rows
        g = open_gguf(p)
        for gname, t in g.tensors.items():
            name = hf_name(gname) or gname
            heads = 0
            if cfg.architecture in ("llama", "mistral") and ".attn_q." in gname + "." and gname.endswith("weight"):
                heads = cfg.num_attention_heads
            elif cfg.architecture in ("llama", "mistral") and ".attn_k." in gname + "." and gname.endswith("weight"):
                heads = cfg.num_key_value_heads

            def read(fd_unused: int, r0: int, r1: int, t=t, heads=heads) -> torch.Tensor:
                if len(t.shape) == 1:
                    return torch.from_numpy(g.read_rows(fds[p], t, 0, 1).reshape(t.shape).copy())
                rows = g.read_rows(fds[p], t, r0, r1)
                if heads:
                    rows = unpermute_rows(rows, (r1 - r0) // cfg.head_dim)
                return torch.from_numpy(np.ascontiguousarray(rows))

            out[name] = _Source(p, t.shape, read, t.type_name)
        return out
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(p, "(files)", "no *.safetensors files")
    idx = p / "model.safetensors.index.json"
    mapped: dict = {}
    if idx.is_file():
        mapped = read_json(idx).get("weight_map") or {}
        absent = sorted({v for v in mapped.values() if not (p / v).is_file()})
        if absent:
            raise CheckpointError(idx, "weight_map", f"names files that are not there: {', '.join(absent)}")
    for f in files:
        for name, e in _safetensors_header(f).items():
            if name in out:
                raise CheckpointError(f, name, f"tensor also present in {out[name].file.name}")
            if mapped and mapped.get(name, f.name) != f.name:
                raise CheckpointError(f, name, f"model.safetensors.index.json puts it in {mapped[name]}")
            out[name] = _Source(f, e["_shape"], _st_reader(fds, f, e, name), e["dtype"])
    return out


def check_tensors(path: str | Path, cfg: ModelConfig, sources: dict[str, _Source]) -> None:
    """Every needed tensor present with its shape, every present tensor read (``CheckpointError`` otherwise)."""
    p = Path(path)
    expected: dict[str, tuple[int, ...]] = {}
    for seg in segment_names(cfg.num_hidden_layers):
        expected.update(hf_names(cfg, seg))
    for name, shape in expected.items():
        src = sources.get(name)
        if src is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            files = ", ".join(sorted({s.file.name for s in sources.values()}))
            raise CheckpointError(p, name, f"missing tensor (looked in {files})")
        if tuple(src.shape) != shape:
            raise CheckpointError(src.file, name, f"shape {tuple(src.shape)}, expected {shape} for the config")
        if src.kind not in ST_DTYPES and p.suffix != ".gguf":
            raise CheckpointError(src.file, name, f"dtype {src.kind} is not a floating-point type")
    extra = sorted(n for n in sources if n not in expected and not n.endswith(IGNORED_SUFFIXES))
    if extra:
        src = sources[extra[0]]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(src.file, extra[0], f"tensor that this model does not read{more}: the checkpoint "
                              f"is not a plain {cfg.architecture} decoder as its config says (docs/models.md)")
    if p.suffix == ".gguf":
        from shared.model.gguf_file import check_quant_types
        check_quant_types(p, {n: s.kind for n, s in sources.items()})


def _copy_into(dst: torch.Tensor, src: _Source, cfg: ModelConfig) -> None:
    """Copy ``src`` into the (possibly strided) view ``dst`` in row chunks of whole heads."""
    if len(src.shape) == 1:
        dst.copy_(src.read(0, 0, src.shape[0]))
        return
    rows, row_bytes = src.shape[0], 4 * int(np.prod(src.shape[1:]))
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    step = max(cfg.head_dim, step // cfg.head_dim * cfg.head_dim) if rows % cfg.head_dim == 0 else step
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        dst[r0:r1].copy_(src.read(0, r0, r1))


def _open_all(stack: ExitStack, sources: dict[str, _Source], fds: dict[Path, int]) -> None:
    for f in {s.file for s in sources.values()}:
        fd = os.open(f, os.O_RDONLY)
        stack.callback(os.close, fd)
        fds[f] = fd


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", segments: Iterable[str] | None = None,
                    *, cfg: ModelConfig | None = None) -> LlamaModel:
    """Build a model (or, with ``segments``, a partial one) from a checkpoint directory or GGUF file.

    ``cfg`` (from :func:`shared.model.checkpoint.inspect_checkpoint`, e.g. with the tenant's dtype) defaults to
    the checkpoint's own.
    """
    cfg = cfg or load_config(path)
    fds: dict[Path, int] = {}
    sources = checkpoint_tensors(path, cfg, fds)
    check_tensors(path, cfg, sources)
    segs = list(segments) if segments is not None else segment_names(cfg.num_hidden_layers)
    model = LlamaModel.partial(cfg, segs, device)
    with ExitStack() as stack, torch.inference_mode():
        _open_all(stack, sources, fds)
        for seg in segs:
            for name, dst in model.segment_state_dict(seg).items():
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    if "embed" not in segs:  # a head without the embedding: copy the tied matrix
                        _copy_into(dst, sources["model.embed_tokens.weight"], cfg)
                    continue
                _copy_into(dst, sources[name], cfg)
    if cfg.tie_word_embeddings and "embed" in model.segments and "head" in model.segments:
        model._w["head"]["lm_head"] = model._w["embed"]["embed"]
    return model


def load_state_dict(path: str | Path, cfg: ModelConfig, segments: Iterable[str] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors of ``segments`` (all by default) under Hugging Face names, in ``cfg.dtype``."""
    model = load_checkpoint(path, "cpu", segments, cfg=cfg)
    out: dict[str, torch.Tensor] = {}
    for seg in model.segments:
        out.update({k: v.contiguous() for k, v in model.segment_state_dict(seg).items()})
    return out
