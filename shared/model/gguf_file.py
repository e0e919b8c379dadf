"""GGUF checkpoints: the header (metadata and tensor table), the model config it describes, and tensor rows
dequantized with the ``gguf`` package.

The header is parsed here in one pass over a buffer (``gguf.GGUFReader`` builds every field of the 49k-token
vocabulary as numpy views and took 8-11 s for SmolLM2's header on this machine; this parser takes well under a
second); the value-type and quantization tables and the dequantization kernels are the ``gguf`` package's.
Tensor data is read with ``pread`` in row chunks and dequantized chunk by chunk, so loading never maps the whole
file nor holds a second copy of the weights. Architectures: ``llama`` (also Mistral files, which llama.cpp writes
as llama), ``qwen2``, ``qwen3``; llama.cpp's interleaving of the Llama q/k rows is undone as transformers does.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.model.config import ModelConfig, normalise
from shared.model.hf_config import CheckpointError

GGUF_MAGIC = b"GGUF"
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
LAYER_TENSORS = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                 "attn_output.weight": "self_attn.o_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
                 "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
                 "attn_output.bias": "self_attn.o_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
                 "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight"}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): the Hugging Face shape
    qtype: int
    offset: int  # absolute file offset of the data
    n_bytes: int

    @property
    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


class _Buf:
    """A growing read buffer over the file's header."""

    def __init__(self, f, path: Path) -> None:
        self.f, self.path, self.data, self.pos = f, path, bytearray(), 0

    def need(self, n: int) -> None:
        while len(self.data) < self.pos + n:
            chunk = self.f.read(max(1 << 20, self.pos + n - len(self.data)))
            if not chunk:
                raise CheckpointError(self.path, "(header)", "file ends inside the GGUF header (truncated?)")
            self.data += chunk

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += n
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.data[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype == 8:
                return [self.string() for _ in range(count)]
            if itype in _NP:
                size = np.dtype(_NP[itype]).itemsize * count
                self.need(size)
                arr = np.frombuffer(bytes(self.data[self.pos:self.pos + size]), dtype=_NP[itype]).tolist()
                self.pos += size
                return arr
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise CheckpointError(self.path, "(header)", f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype])


class GGUFFile:
    """The header of a GGUF file: ``metadata`` (key → value) and ``tensors`` (name → :class:`GGUFTensor`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                buf = _Buf(f, self.path)
                buf.need(4)
                if bytes(buf.data[:4]) != GGUF_MAGIC:
                    raise CheckpointError(self.path, "(file)", "not a GGUF file (bad magic)")
                buf.pos = 4
                version = buf.unpack("<I")
                if version not in (2, 3):
                    raise CheckpointError(self.path, "GGUF.version", f"{version} is not supported (2 or 3)")
                n_tensors, n_kv = buf.unpack("<Q"), buf.unpack("<Q")
                self.metadata: dict[str, Any] = {}
                for _ in range(n_kv):
                    key = buf.string()
                    self.metadata[key] = buf.value(buf.unpack("<I"))
                infos = []
                for _ in range(n_tensors):
                    name = buf.string()
                    dims = [buf.unpack("<Q") for _ in range(buf.unpack("<I"))]
                    infos.append((name, tuple(reversed(dims)), buf.unpack("<I"), buf.unpack("<Q")))
                align = int(self.metadata.get("general.alignment", 32))
                start = -(-buf.pos // align) * align
                size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise CheckpointError(self.path, "(file)", f"unreadable: {e}") from None
        from gguf import GGML_QUANT_SIZES
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, off in infos:
            if qtype not in GGML_QUANT_SIZES:
                raise CheckpointError(self.path, name, f"unknown GGML tensor type {qtype}")
            block, tsize = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise CheckpointError(self.path, name, f"row length {shape[-1]} is not a multiple of the "
                                      f"{block}-element blocks of its type")
            t = GGUFTensor(name, shape, qtype, start + off, n // block * tsize)
            if t.offset + t.n_bytes > size:
                raise CheckpointError(self.path, name, "tensor data lies past the end of the file (truncated?)")
            self.tensors[name] = t

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def read_rows(self, fd: int, t: GGUFTensor, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a 2-D tensor (or the whole 1-D one) dequantized to float32."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        rb = t.row_bytes
        raw = os.pread(fd, (r1 - r0) * rb, t.offset + r0 * rb)
        if len(raw) != (r1 - r0) * rb:
            raise CheckpointError(self.path, t.name, "short read (file truncated?)")
        arr = np.frombuffer(raw, dtype=np.uint8).reshape(r1 - r0, rb)
        try:
            out = dequantize(arr, GGMLQuantizationType(t.qtype))
        except NotImplementedError:
            raise CheckpointError(self.path, t.name, f"quantization type {t.type_name} cannot be dequantized by "
                                  "the gguf package") from None
        return np.asarray(out, dtype=np.float32).reshape(r1 - r0, t.shape[-1])


_CACHE: dict[tuple[str, int, int], GGUFFile] = {}


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed header of ``path``, parsed once per process (per file size and mtime)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise CheckpointError(p, "(file)", f"unreadable: {e}") from None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        if len(_CACHE) > 4:
            _CACHE.clear()
        _CACHE[key] = GGUFFile(p)
    return _CACHE[key]


def _meta(g: GGUFFile, key: str, kinds: tuple = (int,), default: Any = ...) -> Any:
    v = g.metadata.get(key, default)
    if v is ...:
        raise CheckpointError(g.path, key, "required metadata key is missing")
    if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
        raise CheckpointError(g.path, key, f"expected {'/'.join(k.__name__ for k in kinds)}, got {v!r}")
    return v


def gguf_config(g: GGUFFile, dtype: str = "float32") -> ModelConfig:
    """The model config a GGUF header describes; :class:`CheckpointError` for what is not supported."""
    arch = g.architecture
    if arch not in ARCHS:
        raise CheckpointError(g.path, "general.architecture", f"{arch!r} is not supported; supported: "
                              f"{', '.join(ARCHS)} (docs/models.md)")
    a = arch
    num = (int, float)
    heads = _meta(g, f"{a}.attention.head_count")
    hidden = _meta(g, f"{a}.embedding_length")
    head_dim = _meta(g, f"{a}.attention.key_length", default=None) or hidden // heads
    rope_dim = _meta(g, f"{a}.rope.dimension_count", default=None)
    if rope_dim is not None and rope_dim != head_dim:
        raise CheckpointError(g.path, f"{a}.rope.dimension_count", f"{rope_dim} != head dim {head_dim}: partial "
                              "rotary embeddings are not supported")
    scaling = _meta(g, f"{a}.rope.scaling.type", (str,), default="none")
    rope: dict[str, Any] = {"rope_type": "default"}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(_meta(g, f"{a}.rope.scaling.factor", num))}
    elif scaling not in ("none", None):
        raise CheckpointError(g.path, f"{a}.rope.scaling.type", f"{scaling!r} is not supported")
    if "rope_freqs.weight" in g.tensors:
        raise CheckpointError(g.path, "rope_freqs.weight", "per-frequency RoPE factors (Llama 3.1 in GGUF) are "
                              "not supported; serve the safetensors checkpoint (docs/models.md)")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    vocab = _meta(g, f"{a}.vocab_size", default=None) or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise CheckpointError(g.path, f"{a}.vocab_size", "missing, and no tokenizer.ggml.tokens to count")
    eos = [_meta(g, f"tokenizer.ggml.{k}", default=None) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    has_bias = f"blk.0.attn_q.bias" in g.tensors
    if arch == "llama" and has_bias:
        raise CheckpointError(g.path, "blk.0.attn_q.bias", "attention biases in a llama GGUF are not supported")
    cfg = ModelConfig(**normalise(dict(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_meta(g, f"{a}.feed_forward_length"), num_hidden_layers=_meta(g, f"{a}.block_count"),
        num_attention_heads=heads, num_key_value_heads=_meta(g, f"{a}.attention.head_count_kv", default=heads),
        head_dim_explicit=head_dim if head_dim * heads != hidden else 0,
        max_position_embeddings=_meta(g, f"{a}.context_length"),
        rms_norm_eps=float(_meta(g, f"{a}.attention.layer_norm_rms_epsilon", num)),
        rope_theta=float(_meta(g, f"{a}.rope.freq_base", num, default=10000.0)), rope_scaling=rope,
        bos_token_id=_meta(g, "tokenizer.ggml.bos_token_id", default=None),
        eos_token_id=[e for i, e in enumerate(eos) if e is not None and e not in eos[:i]] or None,
        tie_word_embeddings="output.weight" not in g.tensors, dtype=dtype,
        attention_bias=arch == "qwen2", o_bias=False, qk_norm=arch == "qwen3")))
    errs = cfg.validate()
    if errs:
        field, problem = errs[0].split(": ", 1)
        raise CheckpointError(g.path, field, problem)
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not one this code reads)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    return None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving for whole heads (transformers' ``reverse_permute_weights``)."""
    shape = rows.shape
    dim = shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *shape[1:]).swapaxes(2, 1).reshape(shape)


def check_quant_types(path: Path, kinds: dict[str, str]) -> None:
    """Every tensor type of the file can be dequantized by the installed ``gguf`` package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    for kind in sorted(set(kinds.values())):
        try:
            qt = GGMLQuantizationType[kind]
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qt][1]), dtype=np.uint8), qt)
        except (KeyError, NotImplementedError):
            name = next(n for n, k in kinds.items() if k == kind)
            raise CheckpointError(path, name, f"quantization type {kind} is not supported (the gguf package "
                                  "cannot dequantize it)") from None
