"""Small random checkpoints written by Hugging Face ``transformers`` (the reference implementation), and the
engine run that the exactness tests compare against it.

Every parameter is drawn at random (norm weights around 1, biases non-zero), so a tensor that is loaded into the
wrong place, or not at all, changes the logits. Imported by the tests as ``hf_reference`` (this folder is on
``sys.path`` through the model tests' conftest).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.model.checkpoint import inspect_checkpoint
from shared.model.engine import Engine, SamplingParams
from shared.model.tokenizer import load_tokenizer
from shared.model.weights import load_checkpoint

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama31": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, eos_token_id=[2, 3], head_dim=16,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, rope_theta=1e6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, rope_theta=1e6, num_attention_heads=4)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """N(0, 0.1²) matrices and biases, norm weights 1 + N(0, 0.1²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1 + r if "norm" in name else r)


def to_v4(config_json: Path) -> None:
    """Rewrite a transformers 5 ``config.json`` the way transformers 4 writes it."""
    d = json.loads(config_json.read_text())
    rp = d.pop("rope_parameters", None) or {}
    d["rope_theta"] = rp.pop("rope_theta", 10000.0)
    d["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    d.pop("layer_types", None)
    config_json.write_text(json.dumps(d, indent=2))


def make_checkpoint(case: str, directory: Path, *, fmt: str = "v5", seed: int = 0, shard: bool = False):
    """(directory, transformers model in eval mode) of a random checkpoint of ``case``."""
    import transformers

    cfg_cls, model_cls, extra = CASES[case]
    kw = dict(BASE, **extra)
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(directory, max_shard_size="200KB" if shard else "5GB")
    if fmt == "v4":
        to_v4(directory / "config.json")
    return directory, model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by the reference: a full forward of the whole sequence for every new token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def engine_run(path: Path, prompts: dict[str, list[int]], n: int, *, block_size: int = 4,
               max_batch_tokens: int = 7, dtype: str | None = None):
    """Greedy generation of every prompt at once through the engine (chunked prefill: ``max_batch_tokens`` a step;
    paged KV: small blocks, requests interleaved), returning ({rid: tokens}, {rid: [logits row per token]})."""
    info = inspect_checkpoint(path, dtype=dtype)
    model = load_checkpoint(path, cfg=info.config)
    eng = Engine(model, load_tokenizer(path, info.config), kv_blocks=256, block_size=block_size,
                 max_batch_tokens=max_batch_tokens, max_running=8)
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    real = eng._sample

    def spy(seqs, logits):  # records the logits each sampled token was drawn from
        for r, s in enumerate(seqs):
            rows[s.request_id].append(logits[r].detach().float().clone())
        return real(seqs, logits)

    eng._sample = spy  # type: ignore[method-assign]
    out: dict[str, list[int]] = {r: [] for r in prompts}

    def step() -> None:
        for ev in eng.step().events:
            out[ev.request_id].extend(ev.token_ids)

    for rid, p in prompts.items():
        eng.add(rid, p, SamplingParams(max_tokens=n, ignore_eos=True))
        step()  # staggered arrivals: later prompts prefill while earlier ones decode (mixed batches)
        step()
    while eng.has_work():
        step()
    return out, rows
