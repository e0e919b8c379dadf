"""Fitting a profile: recovers a known profile from its own predictions; files round-trip; new profile fields."""
from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from shared.config import ConfigError
from shared.costmodel import ModelCost, load_profile, load_profile_file
from shared.costmodel.fitting import (BUCKETS, build_profile, case_terms, fit_rates, predict_s, prediction_errors,
                                      write_profile)
from shared.costmodel.profiling import Case, Measurement, default_cases, uninterrupted, uninterrupted_mean
from shared.model.config import PRESETS
from shared.model.graph import ModelGraph

TINY = PRESETS["tiny"]


def _truth():
    """A profile with distinct per-class overheads, a step overhead and size-dependent efficiencies."""
    base = load_profile("h100-80gb")
    nb = len(BUCKETS) + 1
    ramp = tuple(min(1.0, 0.2 + 0.06 * b) for b in range(nb))
    return dataclasses.replace(
        base, kind="cpu", peak_flops=8e10, mem_bandwidth=6e10, buckets=BUCKETS, launch_overhead_s=1e-5,
        compute_eff={c: ramp for c in base.compute_eff}, memory_eff={c: tuple(0.3 for _ in range(nb))
                                                                     for c in base.memory_eff},
        launch_overhead_by_class={"gemm": 2e-5, "attention": 4e-5, "elementwise": 5e-6, "embedding": 3e-6},
        step_overhead_s=3e-4, _eff_cache={})


def test_case_terms_match_model_cost():
    cost = ModelCost(TINY, _truth())
    graph = ModelGraph.from_config(TINY.with_(num_hidden_layers=1))
    for case in default_cases(TINY, quick=True):
        terms = case_terms(graph, case)
        prof = cost.profile
        total = 0.0
        for cls, rows, f, b in terms:
            rc, rm = prof.rates(cls, rows)
            total += max(f / rc, b / rm) + prof.launch_s(cls)
        assert total == pytest.approx(predict_s(cost, case), rel=1e-9), case.label


def test_fit_recovers_a_known_profile():
    truth = _truth()
    cost = ModelCost(TINY, truth)
    cases = default_cases(TINY, quick=False, max_tokens=512)
    # exact "measurements" (with a tiny spread so every point has a standard error)
    data = [(TINY, Measurement(c, [predict_s(cost, c) * 1e3 * f for f in (0.999, 1.0, 1.001)])) for c in cases]
    fit = fit_rates(data, peak_flops=truth.peak_flops, mem_bandwidth=truth.mem_bandwidth, per_class_launch=True)
    prof = build_profile(fit, kind="cpu", peak_flops=truth.peak_flops, mem_bandwidth=truth.mem_bandwidth,
                         memory_bytes=truth.memory_bytes, links=truth.links, step_overhead_s=3e-4)
    errs = [abs(e) for *_, e in prediction_errors(prof, data)]
    assert max(errs) < 0.03 and sum(errs) / len(errs) < 0.01
    assert fit.log_rms < 0.02
    assert prof.step_overhead_s == 3e-4
    assert all(0 < x <= 1 for row in prof.compute_eff.values() for x in row)
    assert all(0 < x <= 1 for row in prof.memory_eff.values() for x in row)


def test_fit_caps_rates_at_the_measured_peaks():
    truth = _truth()
    cost = ModelCost(TINY, truth)
    data = [(TINY, Measurement(c, [predict_s(cost, c) * 1e3 * 0.25] * 3)) for c in default_cases(TINY, quick=True)]
    # 4x faster than the truth but peaks of the truth: no efficiency may exceed 1
    fit = fit_rates(data, peak_flops=truth.peak_flops, mem_bandwidth=truth.mem_bandwidth, per_class_launch=True)
    assert (fit.compute_rate <= truth.peak_flops * (1 + 1e-9)).all()
    assert (fit.memory_rate <= truth.mem_bandwidth * (1 + 1e-9)).all()


def test_written_profile_loads_back(tmp_path):
    truth = _truth()
    path = write_profile(tmp_path / "p.yaml", truth, header="measured here\nsecond line",
                         meta={"date": "2026-01-01", "threads": 1, "models": ["tiny"]})
    back = load_profile_file(path)
    raw = yaml.safe_load(path.read_text())
    assert raw["date"] == "2026-01-01" and raw["models"] == ["tiny"]
    assert path.read_text().startswith("# measured here\n# second line\n")
    assert back.buckets == truth.buckets and back.step_overhead_s == pytest.approx(truth.step_overhead_s)
    assert back.launch_overhead_by_class == pytest.approx(truth.launch_overhead_by_class, rel=1e-3)
    for c in truth.compute_eff:
        assert back.compute_eff[c] == pytest.approx(truth.compute_eff[c], rel=1e-3)
    assert ModelCost(TINY, back).iteration_time(4, 400) == pytest.approx(ModelCost(TINY, truth).iteration_time(4, 400),
                                                                        rel=1e-3)


def test_model_cost_uses_class_overheads_and_step_overhead():
    truth = _truth()
    plain = dataclasses.replace(truth, launch_overhead_by_class={}, step_overhead_s=0.0, _eff_cache={})
    a, b = ModelCost(TINY, truth), ModelCost(TINY, plain)
    # embed is one embedding operator; its overhead is the embedding class's, not the global one
    assert a.embed_time(1) - b.embed_time(1) == pytest.approx(3e-6 - 1e-5)
    # every iteration pays the step overhead once, in closed form and step by step alike
    line_a, line_b = a.decode_line(8), b.decode_line(8)
    diff = line_a[0] - line_b[0]
    per_layer = (a.attn_dense_time(8) + a.mlp_time(8)) - (b.attn_dense_time(8) + b.mlp_time(8))
    assert diff == pytest.approx(3e-4 + a.embed_time(8) - b.embed_time(8) + a.head_time(8) - b.head_time(8)
                                 + TINY.num_hidden_layers * (per_layer + 4e-5 - 1e-5))
    assert a.iteration_time(0, 0, 64, 64 * 65 // 2, 64, 1) > b.iteration_time(0, 0, 64, 64 * 65 // 2, 64, 1) + 3e-4


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(step_overhead_s=-1.0), "step_overhead_s"),
    (lambda d: d.update(launch_overhead_by_class={"gemm": "fast"}), "launch_overhead_by_class.gemm"),
    (lambda d: d.update(launch_overhead_by_class={"warp": 1e-6}), "launch_overhead_by_class.warp"),
    (lambda d: d.update(launch_overhead_by_class=[1]), "launch_overhead_by_class"),
])
def test_bad_new_fields_name_the_field(tmp_path, mutate, field):
    d = load_profile("cpu").to_dict()
    mutate(d)
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as e:
        load_profile_file(f)
    assert e.value.field_path == field


def test_uninterrupted_mean_drops_disturbed_calls():
    xs = [1.0, 1.1, 0.9, 1.0, 9.0]  # one call 9x the median lost its CPU
    assert uninterrupted(xs) == [1.0, 1.1, 0.9, 1.0]
    assert uninterrupted_mean(xs) == pytest.approx(1.0)
    m = Measurement(Case("mlp", 4), xs)
    assert m.value_ms == pytest.approx(1.0) and m.interrupted == pytest.approx(0.2)
    assert m.mean_ms == pytest.approx(13.0 / 5) and 0 < m.rel_se < 0.1
    assert math.isnan(uninterrupted_mean([]))


def test_grid_covers_every_kind_and_stays_inside_the_model():
    small = PRESETS["tiny-2l"]
    cases = default_cases(small.with_(max_position_embeddings=300), quick=False)
    kinds = {c.kind for c in cases}
    assert kinds == {"embed", "mlp", "head", "attn"}
    assert all(max(c.decode_ctx, default=0) < 300 and all(n + k <= 300 for n, k in c.prefill) for c in cases)
    assert any(c.decode_ctx and c.prefill for c in cases)  # mixed batches
    assert any(k for c in cases for _, k in c.prefill)  # prefill chunks after cached context
