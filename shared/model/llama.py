"""Llama-family decoder in torch, runnable segment by segment over a paged KV cache.

Weights are held per segment (``embed``, ``attn[l]``, ``mlp[l]``, ``head``) so that a device can hold only some
segments (a guest running ``mlp[l]`` of another tenant's model). A segment's code path does not depend on which
other segments are present, so a segment gives bit-identical results in a full and in a partial model.
Internally q/k/v are fused (gate and up are not) and matrices stored [in, out] (x @ w), except the head's
[vocab, h] (the tied embedding), applied in blocks of vocabulary rows (:meth:`LlamaModel._head`);
:meth:`LlamaModel.segment_state_dict` speaks Hugging Face names and shapes.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F

from shared.model.batch import BatchContext
from shared.model.config import ModelConfig
from shared.model.graph import parse_segment, segment_names
from shared.model.kv_cache import PagedKVCache

HEAD_BLOCK = 1024  # vocabulary rows per block of the head GEMM (LlamaModel._head)
SILU_ALIGN = 64  # elements: SiLU runs over a multiple of this (see silu_rows)


def silu_rows(x: Tensor) -> Tensor:
    """``F.silu(x)`` whose rows do not depend on the other rows: the CPU kernel computes whole vectors with one
    formula and a tail shorter than two vectors with another (last-bit differences), so a row's values would depend
    on where the tensor ends; padded to :data:`SILU_ALIGN` elements every row takes the vector formula (a
    micro-batch's MLP then equals the whole batch's bit for bit; docs/guest-execution.md, "Identical tokens")."""
    n = x.numel()
    if n % SILU_ALIGN == 0 or x.device.type != "cpu":
        return F.silu(x)
    buf = x.new_zeros(n + SILU_ALIGN - n % SILU_ALIGN)
    buf[:n] = x.reshape(-1)
    return F.silu(buf)[:n].view(x.shape)

Tensor = torch.Tensor


def hf_names(cfg: ModelConfig, segment: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names of one segment and their shapes (biases and q/k norms where the config has
    them)."""
    kind, layer = parse_segment(segment)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.q_dim, cfg.kv_dim
    if kind == "embed":
        return {"model.embed_tokens.weight": (v, h)}
    if kind == "head":
        return {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    p = f"model.layers.{layer}."
    if kind == "attn":
        a = p + "self_attn."
        out = {p + "input_layernorm.weight": (h,), a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
               a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
        if cfg.attention_bias:
            out.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            out[a + "o_proj.bias"] = (h,)
        if cfg.qk_norm:
            out.update({a + "q_norm.weight": (cfg.head_dim,), a + "k_norm.weight": (cfg.head_dim,)})
        return out
    return {p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}


def rope_inv_freq(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the config's scaling (linear, Llama 3's) applied as
    transformers' ``modeling_rope_utils`` does."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(dtype) / hd))
    rope = cfg.rope
    if rope["rope_type"] == "linear":
        inv = inv / rope["factor"]
    elif rope["rope_type"] == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _take(cache: Tensor, idx: Tensor | slice, seqs: int = 0) -> Tensor:
    """Positions of a [kvh, slots, hd] cache: a view for a slot range, else a gather.

    With ``seqs`` the result is [kvh * seqs, L, hd] (kv head major) for a batched GEMM.
    """
    kvh, hd = cache.shape[0], cache.shape[2]
    out = cache[:, idx] if isinstance(idx, slice) else cache.index_select(1, idx.reshape(-1))
    return out.reshape(kvh * seqs, -1, hd) if seqs else out


class LlamaModel:
    """A Llama decoder holding the weights of all (or, for a guest, some) segments."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", *, seed: int = 0,
                 weights: dict[str, Tensor] | None = None, segments: Iterable[str] | None = None) -> None:
        errs = cfg.validate()
        if errs:
            raise ValueError("invalid model config: " + "; ".join(errs))
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        all_names = segment_names(cfg.num_hidden_layers)
        held = list(all_names) if segments is None else list(segments)
        for s in held:
            if s not in all_names:
                raise KeyError(f"no segment {s!r} in a {cfg.num_hidden_layers}-layer model")
        self.segments: list[str] = [s for s in all_names if s in held]
        self._w: dict[str, dict[str, Tensor]] = {}
        for s in self.segments:  # embed comes first: a tied head shares its matrix (never a second [v, h] copy)
            self._w[s] = self._empty(s)
        if weights is None and segments is None:
            from shared.model.weights import random_state_dict
            weights = random_state_dict(cfg, seed)
        if weights is not None:
            for s in self.segments:
                self.load_segment(s, {n: weights[n] for n in hf_names(cfg, s) if n in weights})
        if cfg.tie_word_embeddings and "embed" in self._w and "head" in self._w:
            self._w["head"]["lm_head"] = self._w["embed"]["embed"]
        self._nh, self._kvh, self._hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._scale = 1.0 / math.sqrt(self._hd)
        # RoPE angles are computed per batch from the positions (as transformers does), not kept as a
        # [max_position, head_dim] table: for a 128k-context model that table and its float32 temporaries
        # would cost hundreds of MB at start-up
        self._inv: Tensor | None = None  # RoPE inverse frequencies, computed on the first forward (not at load)

    @classmethod
    def partial(cls, cfg: ModelConfig, segments: Iterable[str], device: str | torch.device = "cpu") -> "LlamaModel":
        """A guest instance holding only ``segments`` (zero weights until :meth:`load_segment`)."""
        return cls(cfg, device, segments=list(segments))

    # ---------------------------------------------------------------- weights
    def _empty(self, segment: str) -> dict[str, Tensor]:
        cfg = self.cfg
        h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        qkv = cfg.q_dim + 2 * cfg.kv_dim
        kind, _ = parse_segment(segment)
        # matrices are stored [in, out] (x @ w): faster than [out, in] for the small-batch decode GEMMs on CPU
        shapes = {"embed": {"embed": (v, h)},
                  "attn": {"norm": (h,), "qkv": (h, qkv), "o": (cfg.q_dim, h)},
                  # gate and up apart: two [h, i] GEMMs ran faster than one [h, 2i] (SmolLM2 on this CPU: 33%
                  # at 8 rows, equal at 1; docs/models.md)
                  "mlp": {"norm": (h,), "gate": (h, i), "up": (h, i), "down": (i, h)},
                  "head": {"norm": (h,), "lm_head": (v, h)}}[kind]  # [v, h]: may be the tied embedding
        tied = None
        if kind == "head" and cfg.tie_word_embeddings and "embed" in getattr(self, "_w", {}):
            tied = self._w["embed"]["embed"]
            del shapes["lm_head"]
        if kind == "attn":
            if cfg.attention_bias:
                shapes["qkv_b"] = (qkv,)
            if cfg.o_bias:
                shapes["o_b"] = (h,)
            if cfg.qk_norm:
                shapes["q_norm"], shapes["k_norm"] = (cfg.head_dim,), (cfg.head_dim,)
        out = {k: torch.zeros(s, dtype=self.dtype, device=self.device) for k, s in shapes.items()}
        if tied is not None:
            out["lm_head"] = tied
        return out

    def segment_state_dict(self, name: str) -> dict[str, Tensor]:
        """Weights of one segment under Hugging Face names and shapes (views into this model's tensors,
        not necessarily contiguous)."""
        w, kind = self._held(name), parse_segment(name)[0]
        names = list(hf_names(self.cfg, name))
        if kind == "embed":
            return {names[0]: w["embed"]}
        if kind == "head":
            return {names[0]: w["norm"], names[1]: w["lm_head"]}
        if kind == "attn":
            q, kv = self.cfg.q_dim, self.cfg.kv_dim
            qkv = w["qkv"].t()
            out = {names[0]: w["norm"], names[1]: qkv[:q], names[2]: qkv[q:q + kv], names[3]: qkv[q + kv:],
                   names[4]: w["o"].t()}
            rest = iter(names[5:])
            if "qkv_b" in w:
                b = w["qkv_b"]
                out.update({next(rest): b[:q], next(rest): b[q:q + kv], next(rest): b[q + kv:]})
            if "o_b" in w:
                out[next(rest)] = w["o_b"]
            if "q_norm" in w:
                out.update({next(rest): w["q_norm"], next(rest): w["k_norm"]})
            return out
        return {names[0]: w["norm"], names[1]: w["gate"].t(), names[2]: w["up"].t(), names[3]: w["down"].t()}

    def load_segment(self, name: str, tensors: dict[str, Tensor]) -> None:
        """Install one segment's weights (Hugging Face names); ``ValueError`` naming a missing/mis-shaped tensor."""
        if name not in self._w:
            if name not in segment_names(self.cfg.num_hidden_layers):
                raise KeyError(f"no segment {name!r} in a {self.cfg.num_hidden_layers}-layer model")
            self._w[name] = self._empty(name)
            self.segments = [s for s in segment_names(self.cfg.num_hidden_layers) if s in self._w]
        expected = hf_names(self.cfg, name)
        for n, shape in expected.items():
            if n not in tensors:
                raise ValueError(f"segment {name}: missing tensor {n}")
            if tuple(tensors[n].shape) != shape:
                raise ValueError(f"segment {name}: tensor {n} has shape {tuple(tensors[n].shape)}, expected {shape}")
        extra = set(tensors) - set(expected)
        if extra:
            raise ValueError(f"segment {name}: unexpected tensors {sorted(extra)}")
        with torch.no_grad():
            for n, dst in self.segment_state_dict(name).items():
                dst.copy_(tensors[n])

    def drop_segment(self, name: str) -> None:
        """Release a segment's weights (a guest evicting staged weights)."""
        self._w.pop(name, None)
        self.segments = [s for s in self.segments if s != name]

    def segment_weight_bytes(self, name: str) -> int:
        return sum(t.numel() * t.element_size() for t in self._held(name).values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights held here (a tied embedding counted once)."""
        seen: dict[int, int] = {}
        for s in self.segments:
            for t in self._w[s].values():
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def attn_layers(self) -> list[int]:
        return [parse_segment(s)[1] for s in self.segments if s.startswith("attn[")]  # type: ignore[misc]

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """A paged KV cache for the attention layers held here."""
        return PagedKVCache(self.cfg, num_blocks, block_size, layers=self.attn_layers(), device=self.device,
                            dtype=self.dtype)

    def _held(self, name: str) -> dict[str, Tensor]:
        try:
            return self._w[name]
        except KeyError:
            raise KeyError(f"segment {name!r} is not held by this model (held: {', '.join(self.segments)})") from None

    # ---------------------------------------------------------------- segment execution
    def run_segment(self, name: str, hidden: Tensor, ctx: BatchContext | None = None) -> Tensor:
        """Run one segment: embed takes token ids [T]; attn/mlp map hidden [T, h] to [T, h]; head gives logits."""
        w = self._held(name)
        kind = name[0]
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self._dispatch(kind, name, w, hidden, ctx)
        return self._dispatch(kind, name, w, hidden, ctx)

    def _dispatch(self, kind: str, name: str, w: dict[str, Tensor], hidden: Tensor, ctx: BatchContext | None):
        if kind == "m":
            return self._mlp(w, hidden)
        if kind == "a":
            if ctx is None or ctx.kv is None:
                raise ValueError(f"{name} needs a BatchContext with a KV cache")
            return self._attn(int(name[5:-1]), w, hidden, ctx)
        if kind == "e":
            return F.embedding(hidden, w["embed"])
        return self._head(self._rmsnorm(hidden, w["norm"]), w["lm_head"]).float()

    @staticmethod
    def _head(x: Tensor, w: Tensor) -> Tensor:
        """``F.linear(x, w)`` for the [vocab, h] head, in blocks of :data:`HEAD_BLOCK` vocabulary rows: bit-identical
        to the one call, but each block's weights stay in cache while all rows use them (SmolLM2's [49152, 576]
        head on one CPU thread: 19 ms against 26 ms at 8 rows, 24 against 31 at 16, equal at 1; docs/models.md)."""
        v = w.shape[0]
        if v <= HEAD_BLOCK:
            return F.linear(x, w)
        out = x.new_empty(x.shape[0], v)
        for s in range(0, v, HEAD_BLOCK):
            out[:, s:s + HEAD_BLOCK] = F.linear(x, w[s:s + HEAD_BLOCK])
        return out

    def _rmsnorm(self, x: Tensor, weight: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * weight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _mlp(self, w: dict[str, Tensor], x: Tensor) -> Tensor:
        n = self._rmsnorm(x, w["norm"])
        return x + (silu_rows(n @ w["gate"]) * (n @ w["up"])) @ w["down"]

    def _attn(self, layer: int, w: dict[str, Tensor], x: Tensor, ctx: BatchContext) -> Tensor:
        nh, kvh, hd = self._nh, self._kvh, self._hd
        t = x.shape[0]
        qkv = self._rmsnorm(x, w["norm"]) @ w["qkv"]
        if "qkv_b" in w:
            qkv = qkv + w["qkv_b"]
        qkv = qkv.view(t, nh + 2 * kvh, hd)
        cos = ctx.rope.get("cos")
        if cos is None:
            if self._inv is None:
                self._inv = rope_inv_freq(self.cfg).to(self.device)
            freqs = torch.outer(ctx.positions.to(torch.float32), self._inv)
            cos = ctx.rope["cos"] = torch.cat([freqs, freqs], dim=-1).cos().to(self.dtype).unsqueeze(1)
            sin = freqs.sin()
            ctx.rope["sin"] = torch.cat([-sin, sin], dim=-1).to(self.dtype).unsqueeze(1)  # sign folded in
        sin = ctx.rope["sin"]
        qk = qkv[:, :nh + kvh]
        if "q_norm" in w:  # Qwen3: RMSNorm over each head of q and of k, before RoPE
            qk = self._rmsnorm(qk, torch.cat([w["q_norm"].expand(nh, hd), w["k_norm"].expand(kvh, hd)]))
        # rotate_half(x) * sin == roll(x, hd/2) * (sin with its first half negated): one op fewer
        qk = qk * cos + qk.roll(hd // 2, dims=-1) * sin
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + kvh:]
        kc, vc = ctx.kv.k[layer], ctx.kv.v[layer]  # type: ignore[union-attr]  # [kvh, slots, hd]
        if isinstance(ctx.slot_mapping, slice):
            kc[:, ctx.slot_mapping] = k.transpose(0, 1)
            vc[:, ctx.slot_mapping] = v.transpose(0, 1)
        else:
            kc.index_copy_(1, ctx.slot_mapping, k.transpose(0, 1))
            vc.index_copy_(1, ctx.slot_mapping, v.transpose(0, 1))
        g = nh // kvh
        parts: list[Tensor] = []
        if ctx.n_decode:
            # one batched GEMM over (kv head, sequence); the g query heads of a kv head are the GEMM's rows
            d = ctx.n_decode
            keys, vals = _take(kc, ctx.decode_gather, d), _take(vc, ctx.decode_gather, d)  # [kvh*D, L, hd]
            qd = q[:d].reshape(d, kvh, g, hd).transpose(0, 1).reshape(kvh * d, g, hd)
            s = torch.bmm(qd, keys.transpose(1, 2))  # [kvh*D, g, L]
            p = self._softmax(s.view(kvh, d, g, -1), ctx.decode_bias).view(kvh * d, g, -1)
            o = torch.bmm(p, vals).view(kvh, d, g, hd)
            parts.append(o.transpose(0, 1).reshape(d, nh * hd))
        for pf in ctx.prefills:
            # the fused kernel never materialises the [heads, n, L] scores: a 256-token chunk's attention ran
            # 4-5x faster than scores + mask + softmax as separate ops (docs/model-engine-bench.md)
            n = pf.n
            qp = q[pf.row:pf.row + n].transpose(0, 1).unsqueeze(0)  # [1, nh, n, hd]
            keys, vals = _take(kc, pf.gather).unsqueeze(0), _take(vc, pf.gather).unsqueeze(0)  # [1, kvh, L, hd]
            bias = pf.bias if pf.bias is None or pf.bias.dtype == qp.dtype else pf.bias.to(qp.dtype)
            o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=bias, scale=self._scale,
                                               enable_gqa=g > 1)  # [1, nh, n, hd]
            parts.append(o[0].transpose(0, 1).reshape(n, nh * hd))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = attn @ w["o"]
        return x + (out + w["o_b"] if "o_b" in w else out)

    def _softmax(self, scores: Tensor, bias: Tensor | None) -> Tensor:
        if scores.dtype != torch.float32:
            s = scores.float() * self._scale
            return (s if bias is None else s + bias).softmax(-1).to(scores.dtype)
        s = scores * self._scale
        return (s if bias is None else s + bias).softmax(-1)

    # ---------------------------------------------------------------- reference
    def forward_reference(self, token_ids: Tensor | list[int]) -> Tensor:
        """Logits [T, vocab] (or [B, T, vocab]) by full causal attention, no cache, unfused weights.

        Written independently of the segment path (complex-number RoPE, repeated KV heads) to test it.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        squeeze = ids.dim() == 1
        ids = ids.unsqueeze(0) if squeeze else ids
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b, t = ids.shape

        def norm(x: Tensor, wt: Tensor) -> Tensor:
            xf = x.float()
            return wt * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype)

        pos = torch.arange(t, dtype=torch.float64)
        inv = rope_inv_freq(cfg, torch.float64)
        rot = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64), torch.outer(pos, inv)).to(torch.complex64)

        def rope(x: Tensor) -> Tensor:  # x [b, heads, t, hd]; pairs (j, j + hd/2)
            xc = torch.complex(x[..., :hd // 2].float(), x[..., hd // 2:].float()) * rot.to(x.device)
            return torch.cat([xc.real, xc.imag], dim=-1).to(x.dtype)

        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        with torch.inference_mode():
            x = self.segment_state_dict("embed")["model.embed_tokens.weight"][ids]
            for layer in range(cfg.num_hidden_layers):
                sd = self.segment_state_dict(f"attn[{layer}]")
                a = {k.split(".", 3)[-1]: v for k, v in sd.items()}  # "self_attn.q_proj.weight", ...

                def proj(inp: Tensor, name: str) -> Tensor:
                    y = inp @ a[f"self_attn.{name}.weight"].T
                    bias = a.get(f"self_attn.{name}.bias")
                    return y if bias is None else y + bias

                hn = norm(x, a["input_layernorm.weight"])
                q = proj(hn, "q_proj").view(b, t, nh, hd).transpose(1, 2)
                k = proj(hn, "k_proj").view(b, t, kvh, hd).transpose(1, 2)
                v = proj(hn, "v_proj").view(b, t, kvh, hd).transpose(1, 2)
                if cfg.qk_norm:
                    q, k = norm(q, a["self_attn.q_norm.weight"]), norm(k, a["self_attn.k_norm.weight"])
                q, k = rope(q), rope(k)
                k, v = k.repeat_interleave(nh // kvh, dim=1), v.repeat_interleave(nh // kvh, dim=1)
                sc = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(hd)
                pr = sc.masked_fill(~causal, float("-inf")).softmax(-1).to(x.dtype)
                o = (pr @ v).transpose(1, 2).reshape(b, t, nh * hd)
                x = x + proj(o, "o_proj")
                m = dict(zip(("n", "g", "u", "d"), self.segment_state_dict(f"mlp[{layer}]").values()))
                hn = norm(x, m["n"])
                x = x + (F.silu(hn @ m["g"].T) * (hn @ m["u"].T)) @ m["d"].T
            hw = self.segment_state_dict("head")
            logits = (norm(x, hw["model.norm.weight"]) @ hw["lm_head.weight"].T).float()
        return logits[0] if squeeze else logits
