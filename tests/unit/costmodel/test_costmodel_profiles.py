"""Device profiles: shipped files load and say how trustworthy they are; bad files name file and field."""
from __future__ import annotations

import pytest
import yaml

from shared.config import ConfigError
from shared.costmodel import load_profile, load_profile_file, parse_profile, transfer_time
from shared.costmodel.profiles import PROFILE_DIR


@pytest.mark.parametrize("kind", ["a100-80gb", "h100-80gb", "h200"])
def test_gpu_profiles_say_where_they_come_from(kind):
    p = load_profile(kind)
    assert p.kind == kind
    raw = _raw(kind)
    prov = raw["provenance"]
    assert "7d47513" in prov["data"] and "MIT" in prov["data"]
    assert "first principles" in prov["not_fitted"] and "attention" in prov["not_fitted"]
    assert prov["command"].startswith("slicesched bench costmodel") and prov["date"]
    if kind == "h200":  # no H200 measurements: derived, and labelled so
        assert "derived" in p.source and not p.calibrated and "not measured" in prov["derived"]
    else:
        assert p.source.startswith("fitted to measured") and p.calibrated
        assert set(prov["mape_after_fit"]) >= {"gemm", "norm", "rotary", "activation", "residual", "embedding",
                                               "nvlink"}
    # attention keeps the first-principles rows: datasheet peaks x the estimated efficiencies
    assert set(p.compute_eff["attention"]) == {0.3, 0.4, 0.5, 0.55, 0.6}
    assert p.peak_flops > 1e14 and p.mem_bandwidth > 1e12 and p.memory_bytes > 70e9
    for link in ("nvlink", "pcie", "nccl", "cuda_ipc", "shm", "tcp"):
        assert p.link(link).bandwidth > 0


def test_datasheet_ordering():
    a, h, h2 = load_profile("a100-80gb"), load_profile("h100-80gb"), load_profile("h200")
    assert a.peak_flops < h.peak_flops == h2.peak_flops
    assert a.mem_bandwidth < h.mem_bandwidth < h2.mem_bandwidth
    assert h2.memory_bytes > h.memory_bytes


def test_cpu_profile_is_measured():
    p = load_profile("cpu")
    assert p.source == "measured" and p.calibrated


def test_unknown_kind_lists_valid():
    with pytest.raises(ConfigError, match="h100-80gb"):
        load_profile("tpu-v9")


def _raw(kind="h100-80gb"):
    return yaml.safe_load((PROFILE_DIR / f"{kind}.yaml").read_text())


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("peak_flops"), "peak_flops"),
    (lambda d: d.update(mem_bandwidth=-1), "mem_bandwidth"),
    (lambda d: d.pop("source"), "source"),
    (lambda d: d["links"].update(warp={"bandwidth": 1, "latency_s": 0}), "links.warp"),
    (lambda d: d["efficiency"]["compute"].update(gemm=[0.5]), "efficiency.compute.gemm"),
    (lambda d: d["efficiency"]["memory"]["attention"].__setitem__(0, 1.6), "efficiency.memory.attention"),
    (lambda d: d["efficiency"]["compute"]["attention"].__setitem__(0, 1.1), "efficiency.compute.attention"),
    (lambda d: d["efficiency"]["compute"].update(warp=d["efficiency"]["compute"]["gemm"]), "efficiency.compute.warp"),
    (lambda d: d["efficiency"]["memory"].pop("rope"), "efficiency.memory.rope"),
    (lambda d: d["efficiency"]["memory"].update(rope=[0.5]), "efficiency.memory.rope"),
    (lambda d: d["launch_overhead_by_class"].update(warp=1e-6), "launch_overhead_by_class.warp"),
])
def test_bad_profile_names_field(tmp_path, mutate, field):
    d = _raw()
    mutate(d)
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as e:
        load_profile_file(f)
    assert e.value.field_path == field and str(f) in str(e.value)


def test_profile_round_trips():
    p = load_profile("h100-80gb")
    q = parse_profile(p.to_dict())
    assert q.to_dict() == p.to_dict()


def test_transfer_time_is_latency_plus_bandwidth():
    p = load_profile("h100-80gb")
    nv, nccl = p.link("nvlink"), p.link("nccl")
    assert transfer_time(p, "nvlink", 0) == 0
    assert transfer_time(p, "nvlink", 1e9) == pytest.approx(nv.latency_s + 1e9 / nv.bandwidth)
    assert transfer_time(p, "nccl", 1e9) > transfer_time(p, "nvlink", 1e9)
    assert transfer_time(p, "nccl", 1e9) == pytest.approx(nccl.latency_s + 1e9 / nccl.bandwidth)
