"""The ``bench compare`` command a results part prints as its equivalent: it must reproduce the part's partition."""
from __future__ import annotations

import shlex

import pytest

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


@pytest.mark.parametrize("part", ["emulated", "real"])
def test_the_results_command_names_a_non_default_count_of_mesh_runs(part):
    import argparse

    from bench.bench_results import configure, mesh_runs, results_command
    p = argparse.ArgumentParser()
    configure(p)
    one = p.parse_args(["--only", part, f"--{part}-runs", "1"])
    assert shlex.split(results_command(one))[-4:] == ["--only", part, f"--{part}-runs", "1"]
    assert mesh_runs(one, part) == 1
    default = p.parse_args(["--only", part])
    assert f"--{part}-runs" not in results_command(default) and mesh_runs(default, part) == 3
    assert mesh_runs(p.parse_args(["--quick"]), part) == 1
    with pytest.raises(SystemExit):
        p.parse_args([f"--{part}-runs", "0"])


def test_the_commands_name_the_policies_run_with_deadline_aware_chunks(capsys):
    import argparse

    from bench.bench_results import configure, results_command
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--only", "sim", "--deadline-chunks", "container"])
    assert shlex.split(results_command(args))[-2:] == ["--deadline-chunks", "container"]
    assert "--deadline-chunks" not in results_command(p.parse_args(["--only", "sim"]))
    cmd = compare_command("w.yaml", "c.yaml", ["container", "slice"], "sim", "o.json",
                          {"deadline_chunks": ("container",)})
    argv = shlex.split(cmd)
    assert argv[argv.index("--deadline-chunks") + 1] == "container"
    from services.cli.main import main
    assert main(["bench", "results", "--only", "sim", "--deadline-chunks", "pooled-bound", "--out",
                 "/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--deadline-chunks" in err[0] and "pooled-bound" in err[0]


def test_the_commands_name_each_policys_step_cap(capsys):
    import argparse

    from bench.bench_results import configure, results_command
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--only", "sim", "--step-cap", "container=0.04,slice=0.06"])
    assert shlex.split(results_command(args))[-2:] == ["--step-cap", "container=0.04,slice=0.06"]
    assert "--step-cap" not in results_command(p.parse_args(["--only", "sim"]))
    argv = shlex.split(compare_command("w.yaml", "c.yaml", ["container"], "sim", "o.json",
                                       {"step_cap": {"container": 0.04}}))
    assert argv[argv.index("--step-cap") + 1] == "container=0.04"
    from services.cli.main import main
    assert main(["bench", "results", "--only", "sim", "--step-cap", "pooled-bound=0.04", "--out",
                 "/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-cap" in err[0] and "pooled-bound" in err[0]


def test_a_mesh_part_plans_its_partition_with_the_engine_options_it_runs(monkeypatch, tmp_path):
    """The mesh and its prediction run on one partition, planned as `bench compare` plans it: with `container`'s
    prefill order and step cap, on the tuning seeds."""
    import argparse

    from bench import bench_compare
    from bench.bench_results import configure, run_mesh

    seen = []

    class Planned(Exception):
        pass

    def resolve(ns):
        seen.append(ns)
        raise Planned

    monkeypatch.setattr(bench_compare, "resolve_containers", resolve)
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--only", "emulated", "--deadline-chunks", "container,muxserve",
                         "--step-cap", "container=0.06,slice=0.08"])
    with pytest.raises(Planned):
        run_mesh(args, tmp_path, "cmd", "emulated")
    ns = seen[0]
    assert ns.containers == "plan" and ns.fidelity == "sim"
    assert ns.deadline_chunks == ("container",)
    assert ns.step_cap == {"container": 0.06, "slice": 0.08}


def test_the_commit_says_when_the_code_differs_from_it_but_not_for_the_docs(tmp_path):
    import subprocess

    from bench.results.meta import code_commit

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=t@example.com", "-c", "user.name=t",
                               *a], check=True, capture_output=True, text=True).stdout.strip()
    assert code_commit(tmp_path) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for f in ("code.py", "README.md", "docs/results/real.json", "docs/page.md"):
        (tmp_path / f).write_text("v1\n")
    git("add", "-A")
    git("commit", "-qm", "c")
    head = git("rev-parse", "--short", "HEAD")
    assert code_commit(tmp_path) == head
    (tmp_path / "README.md").write_text("v2\n")
    (tmp_path / "docs" / "results" / "real.json").write_text("v2\n")
    (tmp_path / "docs" / "page.md").write_text("v2\n")
    assert code_commit(tmp_path) == head  # the docs, which a results run itself rewrites, are not code
    (tmp_path / "code.py").write_text("v2\n")
    assert code_commit(tmp_path) == head + "+changes"
