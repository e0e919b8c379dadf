"""The segment path over the paged KV cache against the independent reference forward; guest partial models."""
from __future__ import annotations

import pytest
import torch

from shared.model.batch import SeqChunk, build_context
from shared.model.config import PRESETS
from shared.model.graph import ModelGraph
from shared.model.llama import LlamaModel
from shared.model.weights import random_state_dict

ATOL = 1e-4


def run_all(model, kv, chunks, ids):
    ctx = build_context(kv, chunks)
    h = torch.tensor(ids)
    for name in model.segments:
        h = model.run_segment(name, h, ctx)
    return h


def test_segment_path_matches_reference_prefill_chunks_and_decode(model2):
    ids = torch.randint(0, model2.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = model2.forward_reference(ids)
    kv = model2.new_kv_cache(16, 8)
    kv.allocate("s", 40)
    outs = [run_all(model2, kv, [SeqChunk("s", 0, 11)], ids[:11]),
            run_all(model2, kv, [SeqChunk("s", 11, 20)], ids[11:31])]
    outs += [run_all(model2, kv, [SeqChunk("s", p, 1)], ids[p:p + 1]) for p in range(31, 37)]
    got = torch.cat(outs)
    assert got.shape == ref.shape == (37, model2.cfg.vocab_size)
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()


def test_mixed_batch_of_decodes_and_prefills_matches_reference(model2):
    gen = torch.Generator().manual_seed(2)
    seqs = {n: torch.randint(0, 512, (L,), generator=gen).tolist() for n, L in (("a", 9), ("b", 20), ("c", 14))}
    kv = model2.new_kv_cache(32, 4)
    # fragment the free list so "b" gets non-consecutive blocks (gather path, not the slice path)
    kv.allocate("pad1", 4); kv.allocate("a", 12); kv.allocate("pad2", 4); kv.free("pad1")
    kv.allocate("b", 24); kv.free("pad2"); kv.allocate("c", 16)
    assert kv.contiguous_start("b") is None
    # step 1: prefill a fully, b partially
    run_all(model2, kv, [SeqChunk("a", 0, 8), SeqChunk("b", 0, 13)], seqs["a"][:8] + seqs["b"][:13])
    run_all(model2, kv, [SeqChunk("c", 0, 5)], seqs["c"][:5])
    # step 2: a decodes (pos 8), c decodes-like 1-token chunk (pos 5), b finishes its prefill, c continues
    chunks = [SeqChunk("a", 8, 1), SeqChunk("c", 5, 1), SeqChunk("b", 13, 7)]
    out = run_all(model2, kv, chunks, [seqs["a"][8], seqs["c"][5]] + seqs["b"][13:20])
    assert torch.allclose(out[0], model2.forward_reference(seqs["a"])[8], atol=ATOL)
    assert torch.allclose(out[1], model2.forward_reference(seqs["c"][:6])[5], atol=ATOL)
    assert torch.allclose(out[2:], model2.forward_reference(seqs["b"])[13:20], atol=ATOL)


def test_partial_guest_model_is_bit_identical(model2):
    mlps = [s for s in model2.segments if s.startswith("mlp[")]
    guest = LlamaModel.partial(model2.cfg, mlps)
    assert guest.segments == mlps
    graph = ModelGraph.from_config(model2.cfg)
    assert guest.weight_bytes == sum(graph.segment(s).weight_bytes for s in mlps) < model2.weight_bytes
    for s in mlps:
        guest.load_segment(s, model2.segment_state_dict(s))
    x = torch.randn(6, model2.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for s in mlps:
        assert torch.equal(guest.run_segment(s, x), model2.run_segment(s, x))
    with pytest.raises(KeyError, match="not held"):
        guest.run_segment("attn[0]", x)
    # staging one more segment, then evicting one
    guest.load_segment("head", model2.segment_state_dict("head"))
    assert guest.segments == mlps + ["head"]
    assert torch.equal(guest.run_segment("head", x), model2.run_segment("head", x))
    guest.drop_segment("mlp[0]")
    assert guest.segments == ["mlp[1]", "head"]


def test_partial_attention_on_guest_with_own_cache(model2):
    guest = LlamaModel.partial(model2.cfg, ["attn[1]"])
    guest.load_segment("attn[1]", model2.segment_state_dict("attn[1]"))
    kv_home, kv_guest = model2.new_kv_cache(8, 8), guest.new_kv_cache(8, 8)
    assert list(kv_guest.k) == [1]
    for kv in (kv_home, kv_guest):
        kv.allocate("s", 10)
    x = torch.randn(10, model2.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    a = model2.run_segment("attn[1]", x, build_context(kv_home, [SeqChunk("s", 0, 10)]))
    b = guest.run_segment("attn[1]", x, build_context(kv_guest, [SeqChunk("s", 0, 10)]))
    assert torch.equal(a, b)


def test_load_segment_rejects_bad_tensors(model2):
    guest = LlamaModel.partial(model2.cfg, ["mlp[0]"])
    sd = dict(model2.segment_state_dict("mlp[0]"))
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight has shape \(3, 3\)"):
        guest.load_segment("mlp[0]", bad)
    missing = dict(sd)
    del missing["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="missing tensor model.layers.0.mlp.down_proj.weight"):
        guest.load_segment("mlp[0]", missing)


def test_seeded_init_is_deterministic_and_finite():
    cfg = PRESETS["tiny"]
    a, b, c = random_state_dict(cfg, 5), random_state_dict(cfg, 5), random_state_dict(cfg, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    m = LlamaModel(cfg, seed=5)
    logits = m.forward_reference(list(range(64)))
    assert torch.isfinite(logits).all() and logits.std() > 0.01


def test_tied_embeddings_share_one_tensor():
    cfg = PRESETS["tiny-2l"].with_(tie_word_embeddings=True)
    m = LlamaModel(cfg, seed=1)
    assert m.weight_bytes == cfg.weight_bytes()
    sd = m.segment_state_dict("head")
    assert sd["lm_head.weight"].data_ptr() == m.segment_state_dict("embed")["model.embed_tokens.weight"].data_ptr()


def test_batched_reference_matches_single(model2):
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(9))
    both = model2.forward_reference(ids)
    assert torch.allclose(both[1], model2.forward_reference(ids[1]), atol=1e-5)
