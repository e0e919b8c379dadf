"""Container planning: per-tenant decomposition finds the partition brute force finds; containers files."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from shared.config import ConfigError
from shared.containers import parse_containers, read_containers, with_homes, write_containers
from shared.policies import make_policy
from shared.sim import SimConfig, Simulator
from shared.sim.planner import ContainerPlanner, PlanError
from shared.sim.synthetic import bursty_workload, small_cluster, small_tenants

CLUSTER = small_cluster(4, 2)
TENANTS = small_tenants(CLUSTER, ["llama-7b", "llama-7b", "llama-13b"])
RATES = (6.0, 1.5, 1.0)


def workload_at(seed: int, scale: float):
    return bursty_workload(TENANTS, [r * scale for r in RATES], 40.0, random.Random(seed))


def _sustains(counts: dict[str, int], scale: float, seeds, bound: float) -> bool:
    """Full simulation of ``container`` on the partition: every tenant within the bound on every seed."""
    ids = [d.id for d in CLUSTER.devices]
    homes, i = {}, 0
    for t, n in counts.items():
        homes[t], i = ids[i:i + n], i + n
    for seed in seeds:
        w = workload_at(seed, scale)
        tenants = with_homes(w.tenants, homes)
        w = dataclasses.replace(w, tenants=tenants)
        r = Simulator(CLUSTER, tenants, make_policy("container"), SimConfig(), random.Random(seed)).run(w)
        if any(v["violation_rate"] > bound for v in r.tenants.values()):
            return False
    return True


def _max_scale(counts, seeds, bound, tol=0.03):
    lo, hi = 0.05, 64.0
    if not _sustains(counts, lo, seeds, bound):
        return 0.0
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _sustains(counts, mid, seeds, bound) else (lo, mid)
    return lo


def test_planner_matches_brute_force_on_a_small_cluster():
    seeds, bound = (11,), 0.09
    plan = ContainerPlanner(CLUSTER, workload_at, seeds, bound, tolerance=0.03).plan(start_scale=1.0)
    assert sum(plan.counts.values()) == 4 and min(plan.counts.values()) >= 1
    best = max(_max_scale(dict(zip(("t0", "t1", "t2"), c)), seeds, bound)
               for c in itertools.product(range(1, 3), repeat=3) if sum(c) == 4)
    assert plan.max_scale >= best / 1.07  # within the two searches' tolerances
    assert _sustains(plan.counts, plan.max_scale, seeds, bound)  # the plan holds under full simulation
    assert plan.counts["t0"] == 2  # the busiest tenant gets the spare device
    assert all(n.violation_rate <= bound for n in plan.needs.values())


def test_planner_refuses_mixed_clusters_and_too_many_tenants():
    mixed = dataclasses.replace(CLUSTER, devices=CLUSTER.devices[:2] + tuple(
        dataclasses.replace(d, kind="a100-80gb") for d in CLUSTER.devices[2:]))
    with pytest.raises(PlanError, match="one kind"):
        ContainerPlanner(mixed, workload_at, (1,))
    two = dataclasses.replace(CLUSTER, devices=CLUSTER.devices[:2])
    with pytest.raises(PlanError, match="3 tenants need"):
        ContainerPlanner(two, workload_at, (1,)).plan()


def test_containers_file_round_trip_and_errors(tmp_path):
    p = tmp_path / "c.yaml"
    write_containers(p, {"t0": ["d0", "d1"], "t1": ["d2"], "t2": ["d3"]}, {"bound": 0.09},
                     header="planned: by hand\n# already a comment")
    assert p.read_text().startswith("# planned: by hand\n# already a comment\ncontainers:")
    assert read_containers(p, CLUSTER, TENANTS) == {"t0": ("d0", "d1"), "t1": ("d2",), "t2": ("d3",)}
    mixed = parse_containers({"t0": 2, "t1": ["d0"], "t2": 1}, "x", CLUSTER, TENANTS)
    assert mixed == {"t0": ("d1", "d2"), "t1": ("d0",), "t2": ("d3",)}  # counts fill what lists leave
    cases = [({"t0": 2, "t1": 1}, "containers.t2", "missing"),
             ({"t0": 2, "t1": 1, "t2": 1, "zz": 1}, "containers.zz", "unknown tenant"),
             ({"t0": ["d0"], "t1": ["d0"], "t2": 1}, "containers.t1", "already in t0"),
             ({"t0": ["d9"], "t1": 1, "t2": 1}, "containers.t0", "unknown device"),
             ({"t0": 3, "t1": 1, "t2": 1}, "containers", "ask for 5 devices"),
             ({"t0": 0, "t1": 1, "t2": 1}, "containers.t0", "at least one"),
             ({"t0": "two", "t1": 1, "t2": 1}, "containers.t0", "device count")]
    for raw, field, msg in cases:
        with pytest.raises(ConfigError) as e:
            parse_containers(raw, "x.yaml", CLUSTER, TENANTS)
        assert e.value.field_path == field and msg in e.value.problem, (raw, e.value)
    tiny = small_cluster(4, 2, memory_gb=8)
    with pytest.raises(ConfigError, match="do not fit"):
        parse_containers({"t0": 1, "t1": 1, "t2": 2}, "x", tiny, small_tenants(tiny, ["llama-7b", "llama-7b",
                                                                                      "llama-13b"]))
    (tmp_path / "bad.yaml").write_text("t0: 1\n")
    with pytest.raises(ConfigError, match="containers"):
        read_containers(tmp_path / "bad.yaml", CLUSTER, TENANTS)


def test_stop_above_agrees_with_the_full_run():
    """A run stopped as soon as it must violate the bound fails exactly when the full run does."""
    from shared.sim.metrics import worst_tenant
    for scale in (0.5, 2.0, 4.0, 8.0):
        w = workload_at(3, scale)
        full = Simulator(CLUSTER, TENANTS, make_policy("container"), SimConfig(), random.Random(3)).run(w)
        sim = Simulator(CLUSTER, TENANTS, make_policy("container"), SimConfig(), random.Random(3))
        sim.stop_above(w, 0.09, 10)
        part = sim.run(w)
        worst = worst_tenant(full.tenants, 10)[1]
        full_fails = full.violation_rate > 0.09 or worst > 0.09
        assert sim.stopped_early == full_fails == bool(part.extra.get("stopped_early")), scale
        if full_fails:
            assert part.violation_rate > 0.09 or worst_tenant(part.tenants, 0)[1] > 0.09
        else:
            assert part.violation_rate == full.violation_rate
