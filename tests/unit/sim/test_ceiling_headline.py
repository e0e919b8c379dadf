"""``pooled-bound`` dominates every simulated policy on each workload of the headline (the four cluster-scale
workloads on 32 modelled H100s), on the first 60 s of the trace, from the tenants file's homes and from average-work
containers, at a scale below and one above the policies' boundaries. Slow (about 10 minutes on 2 cores)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cli.simulate import load_workload_file, simulate
from shared.config import load_cluster
from shared.policies import POLICIES

REPO = Path(__file__).resolve().parents[3]
TRACES = Path(os.environ.get("SLICESCHED_TRACES", REPO.parent / "shared" / "traces"))
POLICIES_RUN = [n for n in POLICIES.names() if not getattr(POLICIES.get(n), "analytic", False)]
# workload -> a scale well below the policies' boundaries and one above the ceiling's (docs/results.md)
HEADLINE = {"azure-16mix-a0.7": (8.0, 96.0), "azure-16mix-a1.3": (8.0, 96.0), "azure-16mix-a2.1": (8.0, 96.0),
            "servegen-16mix": (16.0, 200.0)}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TRACES.is_dir(), reason=f"needs the traces in {TRACES} (SLICESCHED_TRACES)")]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("workload", list(HEADLINE))
def test_no_policy_beats_the_ceiling_on_the_headline_workloads(workload, monkeypatch):
    monkeypatch.setenv("SLICESCHED_TRACES", str(TRACES))
    cluster = load_cluster(str(REPO / "configs" / "cluster-h100x32.yaml"))
    binds = False
    for scale in HEADLINE[workload]:
        w = load_workload_file(str(REPO / "configs" / "workloads" / f"{workload}.yaml"), scale, seed=1,
                               duration_s=60.0)
        for containers in ("homes", "sized"):
            ceil = simulate(cluster, w, "pooled-bound", containers=containers)
            binds |= ceil["violation_rate"] > 0
            for name in POLICIES_RUN:
                r = simulate(cluster, w, name, containers=containers)
                assert r["violation_rate"] >= ceil["violation_rate"] - 1e-12, (name, scale, containers)
                assert r["tokens_per_s"] <= ceil["tokens_per_s"] + 1e-9, (name, scale, containers)
    assert binds, "the bound never binds on this workload: the grid says nothing"
