"""The ``bench compare`` command a results part prints as its equivalent: it must reproduce the part's partition."""
from __future__ import annotations

import shlex

from bench.bench_results import containers_option
from bench.results.meta import compare_command


def _containers(cmd: str) -> str | None:
    argv = shlex.split(cmd)
    return argv[argv.index("--containers") + 1] if "--containers" in argv else None


def test_a_mesh_part_on_a_planned_partition_prints_containers_plan():
    planned = {"mode": "plan", "homes": {"em-a": ["e0", "e1", "e2"]}, "devices": {"em-a": 3}, "tuning_seeds": [101]}
    cmd = compare_command("configs/workloads/emulated-6mix.yaml", "configs/cluster-emulated8.yaml",
                          ["container", "slice"], "emulated", "docs/results/emulated.json",
                          {"containers": containers_option(planned), "tuning_seeds": (101, 102)})
    # without it, `bench compare` on a mesh runs the tenants file's homes, not the partition the part ran
    assert _containers(cmd) == "plan"


def test_a_mode_given_as_text_is_printed_as_given_and_a_file_partition_is_not_claimed():
    assert containers_option("plan") == "plan" and containers_option("sized") == "sized"
    assert containers_option({"mode": "homes"}) == "homes"
    assert containers_option({"mode": "file", "file": None, "homes": {"a": ["g0"]}}) is None
    assert containers_option(None) is None
