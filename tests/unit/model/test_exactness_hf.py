"""Exactness against the reference implementation: random checkpoints of every supported architecture written by
``transformers``, served by this engine (chunked prefill, paged KV cache, mixed batches) in float32.

Logits within 1e-4 of transformers' at every generated position and greedy tokens identical, for Llama, Llama 3.1
rope scaling (with an EOS list and an explicit head_dim), Mistral (sharded), Qwen2 (q/k/v bias, tied embeddings)
and Qwen3 (q/k norm, head_dim != hidden/heads), in the transformers 5 and 4 ``config.json`` formats.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from hf_reference import CASES, engine_run, hf_greedy, hf_logits, make_checkpoint  # noqa: E402

from shared.model.checkpoint import inspect_checkpoint  # noqa: E402

N = 24
TOL = 1e-4


def prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {f"r{i}": torch.randint(3, vocab, (n,), generator=g).tolist() for i, n in enumerate((19, 5, 12, 1))}


@pytest.mark.parametrize("fmt", ["v5", "v4"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers(case, fmt, tmp_path):
    d, ref = make_checkpoint(case, tmp_path / case, fmt=fmt, seed=hash(case) % 1000, shard=case == "mistral")
    if case == "mistral":
        assert (d / "model.safetensors.index.json").is_file()
    ps = prompts(ref.config.vocab_size)
    toks, rows = engine_run(d, ps, N)
    worst = 0.0
    for rid, p in ps.items():
        assert toks[rid] == hf_greedy(ref, p, N), rid
        full = hf_logits(ref, p + toks[rid][:-1])
        ours = torch.stack(rows[rid])
        assert ours.shape == (N, ref.config.vocab_size)
        worst = max(worst, float((ours - full[len(p) - 1:]).abs().max()))
    print(f"{case} {fmt}: max |dlogit| {worst:.2e}")
    assert worst <= TOL, f"max |dlogit| {worst:.2e}"


def test_configs_are_read_as_transformers_reads_them(tmp_path):
    d, _ = make_checkpoint("llama31", tmp_path / "l", fmt="v5")
    cfg = inspect_checkpoint(d).config
    assert cfg.eos_token_ids == (2, 3) and cfg.head_dim == 16 and cfg.rope_theta == 500000.0
    assert cfg.rope["rope_type"] == "llama3" and cfg.rope["original_max_position_embeddings"] == 64
    d4, _ = make_checkpoint("llama31", tmp_path / "l4", fmt="v4")
    assert inspect_checkpoint(d4).config == cfg
    q = inspect_checkpoint(make_checkpoint("qwen3", tmp_path / "q")[0]).config
    assert (q.architecture, q.qk_norm, q.head_dim, q.attention_bias) == ("qwen3", True, 24, False)
    q2 = inspect_checkpoint(make_checkpoint("qwen2", tmp_path / "q2")[0]).config
    assert (q2.attention_bias, q2.tie_word_embeddings, q2.o_bias) == (True, True, False)
