"""The steering copy (shared/sim/steering.py): its hash round-trips and refuses malformed fields, factors are
averaged per device kind, the corrected what-if prices with them (and without them is the plain what-if), and the
forecast marks devices busy for decisions."""
from __future__ import annotations

import random

import pytest

from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.costmodel import CorrectionTable
from shared.policies.actions import GrantLease
from shared.sim.steering import CorrectedWhatIf, SteeringCopy, kind_factors, steer_snapshot
from shared.sim.synthetic import synthetic_snapshot
from shared.sim.whatif import WhatIf


@pytest.fixture(scope="module")
def world():
    cluster = load_cluster(REPO_CONFIGS / "cluster-h100x32.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-16mix.yaml", cluster)
    return cluster, tenants


def _snap(world):
    cluster, tenants = world
    s = synthetic_snapshot(cluster, tenants, random.Random(5), load=0.5)
    hot = s.devices[tenants.get("t00").home_devices[0]]
    hot.queued, hot.queued_prefill_tokens, hot.running, hot.oldest_pending_s = 8, 12000, 32, s.now - 0.05
    hot.decode_kv_tokens = 32 * 1200
    return s, hot


def test_copy_round_trips_through_its_hash():
    c = SteeringCopy(version=7, ts=1000.5, epoch=42, horizon_s=2.0,
                     factors={"cpu": {"mlp": 1.8, "mlp@4": 2.1, "attn": 0.9}, "h100": {"head": 1.1}},
                     busy={"c0": 0.75, "c1": 0.0}, next_idle_s={"c0": 1.5, "c1": 0.0})
    f = c.to_fields()
    assert f["label"] == "simulated" and f["version"] == "7" and f["factor:cpu/mlp@4"] == "2.1000"
    back = SteeringCopy.from_fields(f)
    assert back == c


@pytest.mark.parametrize("fields, named", [
    ({"ts": "1"}, "version"),
    ({"version": "x", "ts": "1"}, "'version'"),
    ({"version": "1", "ts": "1", "factor:cpu/mlp": "nan"}, "factor:cpu/mlp"),
    ({"version": "1", "ts": "1", "factor:cpu/mlp": "0"}, "factor must be > 0"),
    ({"version": "1", "ts": "1", "factor:cpu": "1.2"}, "factor:<device kind>/<segment kind>"),
    ({"version": "1", "ts": "1", "busy:c0": "lots"}, "busy:c0"),
])
def test_malformed_copy_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError) as ei:
        SteeringCopy.from_fields(fields)
    assert named in str(ei.value)


def test_kind_factors_are_the_mean_over_devices_of_a_kind():
    t = CorrectionTable(alpha=1.0)
    t.observe("a0", "mlp", 1.0, 2.0)
    t.observe("a1", "mlp", 1.0, 3.0)
    t.observe("a1", "mlp@8", 1.0, 4.0)
    t.observe("b0", "attn", 1.0, 0.5)
    got = kind_factors(t, {"a0": "cpu", "a1": "cpu", "b0": "h100", "b1": "h100"})
    assert got == {"cpu": {"mlp": 2.5, "mlp@8": 4.0}, "h100": {"attn": 0.5}}


def test_corrected_whatif_prices_with_the_factors_and_falls_back_without(world):
    cluster, tenants = world
    s, hot = _snap(world)
    guest = next(d for d in s.devices.values() if d.home_tenant != "t00" and d.kind == hot.kind)
    cand = GrantLease("t00", hot.id, guest.id, ("*",), 1.0, 0.4, 0, mode="sequences")
    plain = WhatIf.for_cluster(cluster).evaluate(s, [cand])[0]
    w = CorrectedWhatIf.for_cluster(cluster)
    assert w.evaluate(s, [cand])[0].home_iter_s == pytest.approx(plain.home_iter_s)  # no factors: the plain one
    ten = s.tenants["t00"]
    base_mlp = w.cost(ten, hot.kind).mlp_time(64)
    w.set_factors({hot.kind: {"mlp": 2.0, "attn": 2.0, "embed": 2.0, "head": 2.0}})
    assert w.cost(ten, hot.kind).mlp_time(64) == pytest.approx(2 * base_mlp, rel=1e-6)
    slow = w.evaluate(s, [cand])[0]
    assert slow.home_iter_s == pytest.approx(2 * plain.home_iter_s, rel=0.02)
    assert slow.ttft_before_s > plain.ttft_before_s
    w.set_factors({"some-other-kind": {"mlp": 3.0}})  # factors of another kind leave this one uncorrected
    assert w.cost(ten, hot.kind).mlp_time(64) == pytest.approx(base_mlp)
    w.set_factors({})
    assert w.evaluate(s, [cand])[0].home_iter_s == pytest.approx(plain.home_iter_s)


def test_forecast_marks_devices_predicted_busy(world):
    s, hot = _snap(world)
    idle = [d for d in s.devices.values() if d is not hot][:2]
    for d in idle:
        d.busy, d.busy_until_s = False, 0.0
    copy = SteeringCopy(version=1, ts=s.now, busy={idle[0].id: 0.8, idle[1].id: 0.2, "nowhere": 1.0},
                        next_idle_s={idle[0].id: 1.2})
    assert steer_snapshot(s, copy) == [idle[0].id]
    assert idle[0].busy and idle[0].busy_until_s == pytest.approx(s.now + 1.2)
    assert not idle[1].busy  # predicted mostly idle: left as the scheduler sees it


def test_cost_with_correction_matches_a_fresh_one_and_leaves_the_base_alone(world):
    from shared.costmodel import ModelCost, cost_for, load_profile

    _, tenants = world
    cfg = tenants.get("t00").model.config
    base = cost_for(cfg, "h100-80gb")
    plain = [base.iteration_time(16, 16 * 900), base.iteration_time(4, 2000, 512, 512 * 513 // 2, 512),
             base.prefill_time(1500)]
    corr = {"mlp": 1.7, "attn": 0.8, "mlp@16": 2.2, "attn@512": 1.3}
    quick = base.with_correction(corr)
    fresh = ModelCost(cfg, load_profile("h100-80gb"), corr)
    assert quick.graph is base.graph
    for args in ((16, 16 * 900), (4, 2000, 512, 512 * 513 // 2, 512), (1, 300)):
        assert quick.iteration_time(*args) == pytest.approx(fresh.iteration_time(*args), rel=1e-12)
    assert quick.prefill_time(1500) == pytest.approx(fresh.prefill_time(1500), rel=1e-12)
    assert quick.iteration_time(16, 16 * 900) > plain[0]
    assert [base.iteration_time(16, 16 * 900), base.iteration_time(4, 2000, 512, 512 * 513 // 2, 512),
            base.prefill_time(1500)] == plain
