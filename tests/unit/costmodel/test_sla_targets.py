"""Per-request SLA targets: k × the request's own isolated latency; the tenants file's two SLA forms."""
from __future__ import annotations

import pytest
import yaml

from shared.config import SLA, ConfigError, parse_tenants
from shared.costmodel import cost_for
from shared.costmodel.sla import RequestTargets
from shared.model.config import PRESETS
from shared.sim.synthetic import small_cluster


def test_per_request_targets_scale_with_the_request():
    model = PRESETS["llama-7b"]
    sla = SLA(100.0, 30.0, slowdown=5.0, kind="h100-80gb")
    t = RequestTargets(sla, model)
    short, long_ = t(200, 50), t(1800, 50)
    iso = cost_for(model, "h100-80gb").isolated_latency(1800, 50)
    assert long_[0] == pytest.approx(5 * iso[0]) and long_[1] == pytest.approx(5 * iso[1])
    assert long_[0] > 5 * short[0]  # a long prompt gets a much longer TTFT budget
    assert long_[1] > short[1]  # and a longer TPOT budget (its decode attends to more context)
    absolute = RequestTargets(SLA(100.0, 30.0), model)
    assert absolute(200, 50) == absolute(1800, 50) == (0.1, 0.03)


def _tenants(sla):
    return {"tenants": [{"name": "a", "model": {"preset": "llama-7b"}, "sla": sla, "home_devices": ["d0"]}]}


def test_tenants_file_sla_forms_and_errors():
    c = small_cluster(2, 2)
    t = parse_tenants(_tenants({"slowdown": 5}), "t.yaml", c).tenants[0]
    assert t.sla.per_request and t.sla.kind == "h100-80gb"
    ref = cost_for(PRESETS["llama-7b"], "h100-80gb").isolated_latency(1046, 90)
    assert t.sla.ttft_ms == pytest.approx(5e3 * ref[0]) and t.sla.tpot_ms == pytest.approx(5e3 * ref[1])
    assert not parse_tenants(_tenants({"ttft_ms": 100, "tpot_ms": 20}), "t.yaml", c).tenants[0].sla.per_request
    for bad, field in (({"slowdown": 5, "ttft_ms": 1}, "sla"), ({"slowdown": 0.5}, "sla.slowdown"),
                       ({"slowdown": "x"}, "sla.slowdown"), ({"ttft_ms": 100}, "sla.tpot_ms"),
                       ({"ttft_ms": 10, "tpot_ms": 1, "p99": 1}, "sla.p99")):
        with pytest.raises(ConfigError) as e:
            parse_tenants(_tenants(bad), "t.yaml", c)
        assert e.value.field_path == f"tenants[0].{field}", (bad, e.value)
    with pytest.raises(ConfigError, match="cluster"):
        parse_tenants(_tenants({"slowdown": 5}), "t.yaml", None)


def test_shipped_16mix_tenants_use_per_request_targets():
    from shared.config import REPO_CONFIGS, load_cluster, load_tenants
    c = load_cluster(REPO_CONFIGS / "cluster-h100x32.yaml")
    ts = load_tenants(REPO_CONFIGS / "tenants-16mix.yaml", c)
    assert all(t.sla.per_request and t.sla.slowdown == 5 for t in ts.tenants)
    assert yaml.safe_load((REPO_CONFIGS / "tenants-16mix.yaml").read_text())["tenants"][0]["sla"] == {"slowdown": 5}
