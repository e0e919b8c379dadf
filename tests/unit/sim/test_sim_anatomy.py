"""Busy-time bins, the anatomy of a run's violations, and ``slicesched bench anatomy``."""
from __future__ import annotations

import json
import random

import pytest

from services.cli.main import main
from shared.policies import make_policy
from shared.sim import SimConfig, Simulator
from shared.sim.anatomy import BusyBins, anatomy
from shared.sim.synthetic import bursty_workload, small_cluster, small_tenants
from shared.workload import Workload, WorkloadRequest


def test_busy_bins_spread_an_interval_over_the_bins_it_covers():
    b = BusyBins(0.5)
    b.add(0.25, 1.75)  # 0.25 in bin 0, all of bins 1 and 2, 0.25 of bin 3
    b.add(1.6, 1.8, guest=True, weight=0.5)  # half of 0.2 s, guest, in bin 3
    assert b.own == pytest.approx([0.25, 0.5, 0.5, 0.25])
    assert b.guest == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert b.idle(5) == pytest.approx([0.5, 0.0, 0.0, 0.3, 1.0])
    b.add(2.0, 2.0)  # empty: nothing
    assert len(b.own) == 4
    with pytest.raises(ValueError, match="bin_s"):
        BusyBins(0)


def _overloaded_one_idle_other():
    """Tenant t0 flooded with long prompts on d0; t1 on d1 gets nothing: every t0 wait has one idle device beside."""
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    reqs = tuple(WorkloadRequest(f"r{i}", 0.02 * i, "t0", 1500, 20) for i in range(150))
    return c, t, Workload(name="flood", tenants=t, requests=reqs, duration_s=3.0, seed=1)


def test_anatomy_finds_ttft_violations_waiting_beside_an_idle_device():
    c, t, w = _overloaded_one_idle_other()
    sim = Simulator(c, t, make_policy("container"), SimConfig(), random.Random(0))
    sim.record_busy(0.25)
    res = sim.run(w)
    a = anatomy(sim, w, 0.25)
    assert a["by_cause"]["ttft"] > 50 and a["violations"] == res.total["violations"]
    tv = a["ttft_violations"]
    # d1 (outside t0's container) never ran anything: one whole device idle over every wait; d0 was busy
    assert tv["idle_elsewhere"]["p50"] == pytest.approx(1.0) and tv["with_idle_device_elsewhere"] == 1.0
    assert tv["own_container_busy"]["p50"] > 0.95
    assert tv["excess_ms"]["p50"] > 0
    # the bins hold every busy second the device counted
    assert sum(sim.devices["d0"].bins.own) == pytest.approx(sim.devices["d0"].busy_s)
    assert a["devices"]["guest_busy_mean"] == 0.0 and a["leases"]["granted"] == 0
    assert a["tenants"]["t0"]["ttft"] == a["by_cause"]["ttft"] and a["tenants"]["t0"]["devices"] == 1


def test_anatomy_counts_lane_time_as_guest_busy_under_slice():
    c = small_cluster(4, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b", "llama-13b"])
    w = bursty_workload(t, [8.0, 1.0, 0.6], 40.0, random.Random(5))
    sim = Simulator(c, t, make_policy("slice"), SimConfig(), random.Random(0))
    sim.record_busy(0.25)
    sim.run(w)
    a = anatomy(sim, w, 0.25)
    assert a["leases"]["granted"] > 0 and a["devices"]["guest_busy_mean"] > 0
    # lane iterations and offloaded segments, as the devices counted them
    assert sum(sum(d.bins.guest) for d in sim.devices.values()) == \
        pytest.approx(sum(d.guest_busy_s for d in sim.devices.values()))


def _compare_result(path, fidelity="sim", **extra):
    path.write_text(json.dumps({
        "workload": "configs/workloads/azure-16mix-a1.3.yaml", "cluster": "configs/cluster-h100x32.yaml",
        "fidelity": fidelity, "policies": ["container", "slice"], "seeds": [1], "duration_s": 4.0,
        "containers": {"mode": "homes"},
        "per_seed": {"1": {"policies": {"container": {"max_scale_9": 2.0}, "slice": {"max_scale_9": 3.0}}}},
        **extra}))
    return path


def test_bench_anatomy_replays_both_policies_at_slices_boundary(tmp_path):
    """Both policies at slice's boundary and container at its own, each prefilling as in the source run
    (here container with deadline-aware chunks)."""
    src = _compare_result(tmp_path / "sim-x.json", deadline_chunks=["container"])
    out = tmp_path / "anatomy-x.json"
    assert main(["bench", "anatomy", "--from", str(src), "--json", str(out)]) == 0
    a = json.loads(out.read_text())
    assert a["scale"] == 3.0 and set(a["runs"]) == {"container", "slice", "container at its boundary"}
    assert a["runs"]["container at its boundary"]["scale"] == 2.0 and a["runs"]["slice"]["policy"] == "slice"
    assert {k: r["deadline_chunks"] for k, r in a["runs"].items()} == {
        "container": True, "container at its boundary": True, "slice": False}
    assert a["meta"]["command"].startswith("slicesched bench anatomy --from ")


@pytest.mark.parametrize("change, needle", [
    (lambda p: p.with_name("missing.json"), "--from: file not found"),
    (lambda p: _compare_result(p, "real"), "fidelity"),
])
def test_bench_anatomy_refuses_a_bad_source_naming_the_field(tmp_path, capsys, change, needle):
    src = change(tmp_path / "sim-x.json")
    assert main(["bench", "anatomy", "--from", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_bench_anatomy_refuses_an_unknown_policy(tmp_path, capsys):
    src = _compare_result(tmp_path / "sim-x.json")
    assert main(["bench", "anatomy", "--from", str(src), "--policies", "container,nope"]) == 2
    assert "--policies: nope" in capsys.readouterr().err
