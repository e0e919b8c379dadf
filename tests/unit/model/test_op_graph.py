"""Operator graph: structure, parameter totals, shapes, FLOPs/bytes sanity and the plain-data round trip."""
from __future__ import annotations

import msgspec
import pytest

from shared.model.config import PRESETS
from shared.model.graph import OPERATOR_KINDS, ModelGraph, batch_kv_work, parse_segment, segment_names


def test_segment_names_order_and_parse():
    names = segment_names(2)
    assert names == ["embed", "attn[0]", "mlp[0]", "attn[1]", "mlp[1]", "head"]
    assert [parse_segment(n) for n in names] == [("embed", None), ("attn", 0), ("mlp", 0), ("attn", 1),
                                                   ("mlp", 1), ("head", None)]
    for bad in ("attn[x]", "mlp", "attn(1)", "att[1]"):
        with pytest.raises(ValueError, match="bad segment name"):
            parse_segment(bad)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_weight_totals_match_param_counts(preset):
    cfg = PRESETS[preset]
    g = ModelGraph.from_config(cfg)
    pc = cfg.param_counts()
    db = cfg.dtype_bytes
    assert g.segment_names() == segment_names(cfg.num_hidden_layers)
    for s in g.segments:
        assert s.weight_bytes == pc[s.kind] * db, s.name
        assert s.weight_bytes == sum(op.weight_bytes for op in g.operators_of(s.name))
        assert s.stateful == (s.kind == "attn")
    assert g.weight_bytes == cfg.weight_bytes()
    assert {op.kind for op in g.operators} == set(OPERATOR_KINDS)


def test_llama7b_fp16_weight_bytes():
    g = ModelGraph.from_config(PRESETS["llama-7b"])
    assert 13.3e9 < g.weight_bytes < 13.6e9  # 6.74 B parameters at 2 bytes
    mlp = g.segment("mlp[0]")
    attn = g.segment("attn[0]")
    assert mlp.weight_bytes / (mlp.weight_bytes + attn.weight_bytes) == pytest.approx(2 / 3, abs=0.01)


def test_dependencies_form_a_chain_with_residuals():
    g = ModelGraph.from_config(PRESETS["tiny-2l"])
    seen = set()
    for s in g.segments:
        for op in g.operators_of(s.name):
            assert all(i in seen for i in op.inputs), f"{op.name} reads an operator not yet produced"
            assert op.segment == s.name
            seen.add(op.name)
    assert [op.name for op in g.operators] == [n for s in g.segments for n in s.operators]
    res = g.operator("mlp[1].residual")
    assert res.inputs == ("mlp[1].down_proj", "attn[1].residual")
    assert g.operator("attn[0].input_norm").inputs == ("embed.embed_tokens",)


def test_shapes_and_flops():
    cfg = PRESETS["llama-7b"]
    g = ModelGraph.from_config(cfg)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    ops = {op.name: op for op in g.operators}
    assert ops["attn[0].qkv_proj"].output_shape(7) == (7, 3 * h)
    assert ops["mlp[0].gate_up_proj"].output_shape(5) == (5, 2 * i)
    assert ops["mlp[0].silu_mul"].output_shape(5) == (5, i)
    assert ops["head.lm_head"].output_shape(3) == (3, v)
    # matmul FLOPs = 2 * params * tokens
    t = 64
    assert g.segment_flops("mlp[3]", t) == pytest.approx(2 * 3 * h * i * t, rel=0.01)
    # attention work grows with KV, weights don't
    f1, f2 = g.segment_flops("attn[0]", 1, 100), g.segment_flops("attn[0]", 1, 1000)
    assert f2 > f1
    assert ops["attn[0].attention"].flops(1, 1000) == pytest.approx(10 * ops["attn[0].attention"].flops(1, 100))
    # decode is memory-bound: bytes ≈ weights; prefill is compute-bound
    b1 = g.segment_bytes("mlp[0]", 1)
    assert g.segment("mlp[0]").weight_bytes <= b1 < 1.01 * g.segment("mlp[0]").weight_bytes
    assert g.segment_flops("mlp[0]", 1) / b1 < 2 < g.segment_flops("mlp[0]", 512) / g.segment_bytes("mlp[0]", 512)


def test_kv_read_bytes_and_batch_kv_work():
    g = ModelGraph.from_config(PRESETS["llama-7b"])
    att = g.operator("attn[0].attention")
    per_token_layer = PRESETS["llama-7b"].kv_bytes_per_token() // PRESETS["llama-7b"].num_hidden_layers
    assert att.bytes_moved(1, 1001) - att.bytes_moved(1, 1) == pytest.approx(1000 * per_token_layer)
    # two decode tokens with 9 and 4 cached positions, one fresh 3-token prefill
    tokens, pairs, reads = batch_kv_work([(1, 9), (1, 4), (3, 0)])
    assert (tokens, pairs, reads) == (5, 10 + 5 + 6, 10 + 5 + 3)
    assert att.bytes_moved(tokens, pairs, reads) < att.bytes_moved(tokens, pairs)


def test_activation_bytes():
    cfg = PRESETS["tiny"]
    g = ModelGraph.from_config(cfg)
    assert g.segment("mlp[0]").activation_bytes(10) == 2 * 10 * cfg.hidden_size * 4
    assert g.segment("head").output_bytes(2) == 2 * cfg.vocab_size * 4
    assert g.segment("embed").input_bytes(3) == 12


def test_plain_dict_round_trip_through_msgpack():
    g = ModelGraph.from_config(PRESETS["tiny"])
    raw = msgspec.msgpack.encode(g.to_dict())
    back = ModelGraph.from_dict(msgspec.msgpack.decode(raw))
    assert back == g
    assert back.segment("attn[2]").operators == g.segment("attn[2]").operators
    assert back.segment_flops("attn[1]", 4, 40) == g.segment_flops("attn[1]", 4, 40)


def test_unknown_segment_error():
    g = ModelGraph.from_config(PRESETS["tiny-2l"])
    with pytest.raises(KeyError, match=r"attn\[5\]"):
        g.segment("attn[5]")
