"""Roofline costs: regimes, monotonicity, the exact decode line the simulator relies on, corrections."""
from __future__ import annotations

import pytest

from shared.costmodel import CorrectionTable, ModelCost, cost_for, load_profile, op_time
from shared.model.config import PRESETS
from shared.model.graph import ModelGraph


@pytest.fixture(scope="module")
def c7():
    return cost_for(PRESETS["llama-7b"], "h100-80gb")


def test_decode_gemm_is_memory_bound_and_prefill_compute_bound():
    p = load_profile("h100-80gb")
    op = ModelGraph.from_config(PRESETS["llama-7b"]).operator("mlp[0].gate_up_proj")
    rc, rm = p.rates("gemm", 1)
    assert op.bytes_moved(1) / rm > op.flops(1) / rc  # one token: weight streaming dominates
    rc, rm = p.rates("gemm", 2048)
    assert op.flops(2048) / rc > op.bytes_moved(2048) / rm
    # batch-1 time ≈ weight bytes / effective bandwidth (+ launch)
    rm1 = p.rates("gemm", 1)[1]
    assert op_time(p, op, 1) == pytest.approx(op.weight_bytes / rm1 + p.launch_s("gemm", op.kind), rel=0.01)


def test_isolated_latency_plausible(c7):
    ttft, tpot = c7.isolated_latency(1024, 128)
    # 13.5 GB of fp16 weights over ~2.7 TB/s effective: a few ms per token; 1k-token prefill some tens of ms
    assert 0.004 < tpot < 0.010
    assert 0.010 < ttft < 0.060
    t13, p13 = cost_for(PRESETS["llama-13b"], "h100-80gb").isolated_latency(1024, 128)
    assert t13 > ttft and p13 > tpot
    ta, pa = cost_for(PRESETS["llama-7b"], "a100-80gb").isolated_latency(1024, 128)
    assert ta > ttft and pa > tpot


def test_iteration_time_monotone(c7):
    assert c7.iteration_time(32, 32 * 1000) < c7.iteration_time(64, 64 * 1000)
    assert c7.iteration_time(32, 32 * 1000) < c7.iteration_time(32, 32 * 2000)
    short = c7.iteration_time(0, 0, 512, 512 * 513 // 2, 512, 1)
    assert short < c7.iteration_time(0, 0, 2048, 2048 * 2049 // 2, 2048, 1)


@pytest.mark.parametrize("b", [1, 7, 64, 256])
def test_decode_line_is_exact(c7, b):
    a, c, kmax = c7.decode_line(b)
    assert kmax == float("inf")  # MHA decode attention is memory-bound everywhere on an H100
    for k in (b, b * 500, b * 4000):
        direct = (c7.embed_time(b) + c7.head_time(b)
                  + c7.layers * (c7.attn_dense_time(b) + c7.mlp_time(b) + c7.decode_attention_time(b, k)))
        assert a + c * k == pytest.approx(direct, rel=1e-12)


def test_correction_factor_scales_segment(c7):
    slow = ModelCost(PRESETS["llama-7b"], load_profile("h100-80gb"), correction={"mlp": 2.0})
    assert slow.mlp_time(64) == pytest.approx(2 * c7.mlp_time(64))
    assert slow.attn_dense_time(64) == pytest.approx(c7.attn_dense_time(64))


def test_request_work_grows_with_length(c7):
    assert c7.request_work(2000, 10) > c7.request_work(500, 10)
    assert c7.request_work(500, 400) > c7.request_work(500, 10)


def test_correction_table_converges_and_reports_error():
    t = CorrectionTable(alpha=0.2)
    assert t.factor("g0", "mlp") == 1.0
    for _ in range(60):
        t.observe("g0", "mlp", predicted_s=1.0, measured_s=1.3)
    assert t.factor("g0", "mlp") == pytest.approx(1.3, rel=1e-3)
    assert t.error("g0", "mlp") < 0.01  # corrected predictions now hit
    assert t.snapshot()["g0/mlp"]["raw_error"] == pytest.approx(0.3 / 1.3, rel=1e-3)
    assert t.correct("g0", "mlp", 2.0) == pytest.approx(2.6, rel=1e-3)
    assert t.factor("g1", "mlp") == 1.0 and t.factors_for("g0") == {"mlp": t.factor("g0", "mlp")}


def test_correction_table_clamps_outliers():
    t = CorrectionTable(alpha=1.0, max_factor=3.0)
    t.observe("g0", "attn", 1.0, 100.0)
    assert t.factor("g0", "attn") == 3.0
    t.observe("g0", "attn", 0.0, 1.0)  # ignored
    assert t.factor("g0", "attn") == 3.0


def test_a_bucket_without_its_own_factor_takes_its_neighbours():
    from shared.costmodel import ModelCost, load_profile
    from shared.model.config import PRESETS
    mc = ModelCost(PRESETS["tiny-2l"], load_profile("cpu"), {"mlp": 3.0, "mlp@2": 1.0, "mlp@8": 4.0, "attn@16": 2.0})
    assert mc.factor("mlp", 2) == 1.0 and mc.factor("mlp", 8) == 4.0  # their own
    assert mc.factor("mlp", 4) == pytest.approx(2.0)  # halfway (log2) between 2 and 8: geometric mean of 1 and 4
    assert mc.factor("mlp", 1) == 1.0 and mc.factor("mlp", 64) == 4.0  # beyond the ends: the nearest
    assert mc.factor("attn", 3) == 2.0 and mc.factor("head", 4) == 1.0  # one bucket known; none known: the kind's
