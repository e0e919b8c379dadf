"""``slicesched simulate`` / ``bench compare`` end to end on small files; bad files give one-line errors."""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import yaml

from services.cli.main import main


@pytest.fixture()
def files(tmp_path):
    rng = random.Random(3)
    lines, t = ["TIMESTAMP,ContextTokens,GeneratedTokens"], 0.0
    for _ in range(300):
        t += rng.expovariate(4.0)
        s = int(t)
        lines.append(f"2023-11-16 18:{s // 60:02d}:{s % 60:02d}.{int((t - s) * 1e7):07d},"
                     f"{rng.randint(50, 3000)},{rng.randint(1, 300)}")
    (tmp_path / "trace.csv").write_text("\n".join(lines))
    devices = [{"id": f"g{i}", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80, "host": f"n{i // 2}"}
               for i in range(4)]
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"cluster": {"name": "c4"}, "devices": devices,
                                                           "links": {"intra_host": "nvlink", "inter_host": "nccl"}}))
    tenants = [{"name": f"t{i}", "model": {"preset": "llama-7b"}, "sla": {"ttft_ms": 109, "tpot_ms": 28.8},
                "home_devices": [f"g{i}"]} for i in range(3)]
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    wl = {"name": "small", "tenants": "tenants.yaml", "traces": [{"path": str(tmp_path / "trace.csv"),
                                                                  "format": "azure"}],
          "alpha": 1.3, "seed": 1, "duration_s": 60}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(wl))
    return tmp_path


def test_simulate_writes_metrics(files, capsys):
    out = files / "out.json"
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "container", "--rate-scale", "2", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("tokens_per_s", "violation_rate", "wall_s", "events"):
        assert key in r
    assert r["tokens_per_s"] > 0 and r["events"] > 0 and r["wall_s"] > 0
    assert set(r["tenants"]) <= {"t0", "t1", "t2"}
    t = next(iter(r["tenants"].values()))
    for key in ("tokens_per_s", "ttft_ms", "tpot_ms", "violation_rate"):
        assert key in t
    assert set(t["ttft_ms"]) >= {"p50", "p90", "p99"}
    assert r["devices"]["g0"]["memory_peak_bytes"] <= r["devices"]["g0"]["memory_limit_bytes"]
    assert len(r["memory_timeline"]["g0"]) >= 2
    assert "tokens/s" in capsys.readouterr().out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def test_bad_cluster_file_names_file_and_field(files, capsys):
    bad = files / "bad.yaml"
    bad.write_text("devices:\n  - {id: g0, backend: quantum, kind: h100-80gb, memory_gb: 80}\n")
    rc = main(["simulate", "--cluster", str(bad), "--workload", str(files / "w.yaml"), "--policy", "container"])
    assert rc == 2
    line = _one_line_error(capsys)
    assert "bad.yaml" in line and "devices[0].backend" in line


def test_missing_and_malformed_workload(files, capsys):
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "nope.yaml"),
               "--policy", "container"])
    assert rc == 2 and "nope.yaml" in _one_line_error(capsys)
    (files / "w2.yaml").write_text("name: x\ntenants: tenants.yaml\ntraces: []\nseed: one\n")
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w2.yaml"),
               "--policy", "container"])
    assert rc == 2 and "w2.yaml" in _one_line_error(capsys)


def test_workload_for_another_cluster_is_refused(files, capsys):
    devices = [{"id": "x0", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80}]
    (files / "other.yaml").write_text(yaml.safe_dump({"devices": devices}))
    rc = main(["simulate", "--cluster", str(files / "other.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "container"])
    assert rc == 2 and "home_devices" in _one_line_error(capsys)


def test_unknown_policy(files, capsys):
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "nope"])
    assert rc == 2 and "valid:" in _one_line_error(capsys)


def test_bench_compare_small(files, capsys):
    """The JSON holds the planned partition, the tuning and reporting seeds and, per policy and per seed, the
    boundary figures with the worst tenant; the analytic ceiling is at least every policy's."""
    out = files / "cmp.json"
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container,container-avgwork,pooled-bound", "--fidelity", "sim", "--duration-s", "30",
               "--tolerance", "0.25", "--start-scale", "8", "--seeds", "1,2", "--tuning-seeds", "7",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["fidelity"] == "sim" and r["workload"].endswith("w.yaml")
    assert r["seeds"] == [1, 2] and r["tuning_seeds"] == [7]
    c = r["containers"]
    assert c["mode"] == "plan" and sorted(d for ds in c["homes"].values() for d in ds) == ["g0", "g1", "g2", "g3"]
    fields = {f"{f}_{k}" for f in ("max_scale", "tokens_per_s", "worst_tenant_violation_rate", "worst_tenant",
                                   "tenants") for k in ("9", "1")}
    for seed in ("1", "2"):
        for name in ("container", "container-avgwork", "pooled-bound"):
            p = r["per_seed"][seed]["policies"][name]
            assert set(p) >= fields, name
            assert p["max_scale_9"] >= p["max_scale_1"] > 0
            assert (p["worst_tenant_violation_rate_9"] or 0) <= 0.09
        for name in ("container", "container-avgwork"):
            assert r["per_seed"][seed]["policies"]["pooled-bound"]["tokens_per_s_9"] >= \
                r["per_seed"][seed]["policies"][name]["tokens_per_s_9"]
    for name in ("container", "pooled-bound"):
        p = r["policies"][name]
        assert set(p) >= {"max_scale_9", "tokens_per_s_9", "max_scale_1", "tokens_per_s_1", "violation_rate",
                          "worst_tenant_violation_rate_9", "max_scale_9_range"}
        assert p["violation_rate"] <= 0.09
    assert r["ratio_to_container"]["container"]["9"] == 1.0
    assert "seeds 1,2; containers: plan (planned on seeds 7)" in capsys.readouterr().out
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container", "--seeds", "7", "--tuning-seeds", "7"])
    assert rc == 2 and "tuning seeds must differ" in capsys.readouterr().err
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container", "--fidelity", "warp"])
    assert rc == 2


def test_bench_compare_reuses_an_unchanged_policys_searches(files, capsys, monkeypatch):
    """``--reuse container=FILE`` takes container's searches (and its partition) from an earlier run with the same
    settings and runs only the others; the ratio is computed as if it had run. A run whose settings differ is
    refused in one line naming what differs."""
    from bench import bench_compare
    first = files / "first.json"
    base = _small_compare(files)
    assert main([*base, "--policies", "container", "--json", str(first)]) == 0
    prev = json.loads(first.read_text())
    assert prev["search"] == {"start_scale": 8.0, "tolerance": 0.3, "max_scale": 256.0}
    ran: list[str] = []
    real = bench_compare._runner("sim")
    monkeypatch.setattr(bench_compare, "_runner", lambda fidelity: lambda a, policy, *x, **k: (
        ran.append(policy), real(a, policy, *x, **k))[1])
    second = files / "second.json"
    assert main([*base, "--policies", "container,container-avgwork", "--reuse", f"container={first}",
                 "--json", str(second)]) == 0
    r = json.loads(second.read_text())
    assert ran and set(ran) == {"container-avgwork"}  # container was not searched again
    assert r["per_seed"]["1"]["policies"]["container"] == prev["per_seed"]["1"]["policies"]["container"]
    assert r["containers"] == prev["containers"] and r["reused"] == {"container": str(first)}
    assert [x for x in r["runs"] if x["policy"] == "container"] == prev["runs"]
    cont, avg = (r["per_seed"]["1"]["policies"][p]["tokens_per_s_9"] for p in ("container", "container-avgwork"))
    assert r["ratio_to_container"]["container-avgwork"]["9"] == pytest.approx(avg / cont)
    capsys.readouterr()
    for extra, named in ((["--duration-s", "30"], "duration_s"), (["--tolerance", "0.2"], "--tolerance"),
                         (["--seeds", "2"], "seed 2"), (["--tuning-seeds", "8"], "planned on seeds [7]")):
        args = [*base, "--policies", "container", "--reuse", f"container={first}", *extra]
        assert main(args) == 2 and named in _one_line_error(capsys), extra
    assert main([*base, "--policies", "slice", "--reuse", f"container={first}"]) == 2
    assert "not among --policies" in _one_line_error(capsys)
    # a containers file with the same devices per tenant stands for the partition there; other devices do not
    from shared.containers import write_containers
    homes = prev["containers"]["homes"]
    write_containers(files / "same.yaml", homes)
    third = files / "third.json"
    assert main([*base, "--policies", "container", "--containers", str(files / "same.yaml"), "--reuse",
                 f"container={first}", "--json", str(third)]) == 0
    r3 = json.loads(third.read_text())
    assert r3["containers"]["homes"] == homes and r3["containers"]["file"] == str(files / "same.yaml")
    swapped = dict(zip(homes, reversed(list(homes.values()))))
    assert swapped != homes
    write_containers(files / "other.yaml", swapped)
    assert main([*base, "--policies", "container", "--containers", str(files / "other.yaml"), "--reuse",
                 f"container={first}"]) == 2
    assert "gives other devices than the partition there" in _one_line_error(capsys)
    assert main([*base, "--policies", "container", "--reuse", "container"]) == 2
    assert "POLICY=FILE" in _one_line_error(capsys)


def test_simulate_containers_sized_or_the_tenants_homes(files):
    """``sized`` spreads the tenants over every device by offered work; ``homes`` keeps the tenants file's home
    devices (as the live mesh runs), so g3 (no tenant's home) stays idle under ``container``."""
    busy = {}
    for mode in ("sized", "homes"):
        out = files / f"{mode}.json"
        rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
                   "--policy", "container", "--rate-scale", "2", "--containers", mode, "--json", str(out)])
        assert rc == 0
        r = json.loads(out.read_text())
        assert r["containers"] == mode
        busy[mode] = r["devices"]["g3"]["busy_s"]
    assert busy["sized"] > 0 and busy["homes"] == 0


def test_simulate_applies_the_cluster_files_policy_parameters(files, capsys):
    data = yaml.safe_load((files / "cluster.yaml").read_text())
    data["policies"] = {"slice": {"nope": 1}}
    (files / "cluster.yaml").write_text(yaml.safe_dump(data))
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "slice", "--duration-s", "5"])
    assert rc == 2 and "nope" in _one_line_error(capsys)


def test_bench_compare_mesh_fidelity_refuses_sized_containers(files, capsys):
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container", "--fidelity", "emulated", "--containers", "sized"])
    assert rc == 2 and "home devices" in _one_line_error(capsys)


def test_mesh_fidelity_searches_take_turns(monkeypatch):
    """On a serial fidelity the policies' points alternate (a drift of the machine reaches both alike); a policy
    whose search ends leaves the rotation and the other finishes alone."""
    import argparse
    import time as _time

    from bench import bench_compare

    order, running = [], []
    limit = {"container": 3.0, "slice": 9.0}  # slice needs more points: its boundary is further out

    def point(args, policy, scale, **kw):
        running.append(policy)
        assert len(running) == 1, "two mesh points at once"
        _time.sleep(0.01 if policy == "container" else 0.002)  # different speeds must not break the alternation
        order.append(policy)
        running.pop()
        return {"tokens_per_s": 10.0 * scale, "violation_rate": 0.0 if scale <= limit[policy] else 0.5}

    monkeypatch.setattr(bench_compare, "_runner", lambda fidelity: point)
    args = argparse.Namespace(fidelity="real", start_scale=4.0, tolerance=0.05, max_scale=64.0, jobs=1,
                              workload="w.yaml", cluster="c.yaml", seed=None, duration_s=None, containers=None)
    res = bench_compare.compare(args, ["container", "slice"])
    n_c = order.count("container")
    assert order[: 2 * n_c - 1:2] == ["container"] * n_c  # strict alternation while both search
    assert order[1: 2 * n_c:2] == ["slice"] * n_c
    assert order[2 * n_c:] == ["slice"] * (len(order) - 2 * n_c)
    assert order.count("slice") > n_c
    assert 2.8 < res["policies"]["container"]["max_scale_9"] <= 3.0
    assert 8.5 < res["policies"]["slice"]["max_scale_9"] <= 9.0


def test_confirmed_search_replays_the_boundary_and_drops_a_lucky_pass(monkeypatch):
    """With --confirm 2 a reported point must pass twice: a point that passed once by luck fails its replay and
    the bisection goes on below it; the reported throughput is the replays' mean."""
    import argparse

    from bench import bench_compare

    calls: dict[float, int] = {}

    def point(args, policy, scale, **kw):
        n = calls[scale] = calls.get(scale, 0) + 1
        lucky = 4.0 < scale <= 5.0 and n == 1  # passes the first time only
        ok = scale <= 4.0 or lucky
        return {"tokens_per_s": 10.0 * scale + n, "violation_rate": 0.0 if ok else 0.5,
                "cpu_s": {"gateway": scale, "cpu0": 2 * scale}}

    monkeypatch.setattr(bench_compare, "_runner", lambda fidelity: point)
    base = dict(start_scale=1.0, tolerance=0.05, max_scale=64.0, jobs=1, workload="w.yaml", cluster="c.yaml",
                seed=None, duration_s=None, containers=None)
    once = bench_compare.compare(argparse.Namespace(fidelity="real", confirm=1, **base), ["container"])
    assert 4.5 < once["policies"]["container"]["max_scale_9"] <= 5.0  # the lucky pass is the answer
    calls.clear()
    res = bench_compare.compare(argparse.Namespace(fidelity="real", **base), ["container"])  # default: 2 on real
    r = res["policies"]["container"]
    assert res["confirm"] == 2
    assert 3.8 < r["max_scale_9"] <= 4.0
    s = float(f"{r['max_scale_9']:.6g}")
    assert calls[s] == 2
    assert r["tokens_per_s_9"] == pytest.approx(10.0 * s + 1.5)  # mean of the two replays
    assert len([x for x in res["runs"] if x["scale"] == s]) == 2  # both replays are in the log
    assert all(x["cpu_s"] == {"gateway": x["scale"], "cpu0": 2 * x["scale"]} for x in res["runs"])  # mesh CPU kept
    assert bench_compare.confirm_of(argparse.Namespace(fidelity="sim")) == 1
    assert bench_compare.confirm_of(argparse.Namespace(fidelity="emulated")) == 2  # a mesh replay is noisy too
    assert bench_compare.confirm_of(argparse.Namespace(fidelity="emulated", confirm=1)) == 1


def test_a_failure_found_by_the_tighter_search_caps_the_looser_bound(monkeypatch):
    """A short trace's boundary need not be monotone: the ≤ 9 % search passes 4 and 8, then the ≤ 1 % search runs
    points near 2.4 in full that fail 9 % too. Load above a failing point is not sustainable, so the ≤ 9 % boundary
    moves below that failure (the searches repeat until a round adds no point)."""
    import argparse

    from bench import bench_compare

    def violations(scale):
        if scale <= 2.0:
            return 0.0
        if scale < 3.0:
            return 0.2
        return 0.05 if scale <= 8.5 else 0.5

    def point(args, policy, scale, **kw):
        return {"tokens_per_s": 10.0 * scale, "violation_rate": violations(scale)}

    monkeypatch.setattr(bench_compare, "_runner", lambda fidelity: point)
    args = argparse.Namespace(fidelity="real", start_scale=1.0, tolerance=0.05, max_scale=64.0, jobs=1, confirm=1,
                              workload="w.yaml", cluster="c.yaml", seed=None, duration_s=None, containers=None)
    res = bench_compare.compare(args, ["container"])
    r = res["policies"]["container"]
    assert r["max_scale_1"] == pytest.approx(2.0)
    assert r["max_scale_9"] == pytest.approx(2.0)  # not 8.4: the failures near 2.4 come first
    ran = [x["scale"] for x in res["runs"]]
    assert any(8.0 < s <= 8.5 for s in ran)  # the first round did reach the lucky passes


def test_bench_compare_refuses_confirm_below_one(files, capsys):
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container", "--confirm", "0"])
    assert rc == 2 and "--confirm" in _one_line_error(capsys)


def test_an_interrupt_stops_every_search_and_its_subprocesses(monkeypatch):
    """Ctrl-C or SIGTERM during a comparison with parallel points: the running points' subprocesses are
    terminated and no new point starts, so it stops at once instead of finishing every policy's search first."""
    import argparse
    import signal
    import time as _time

    from bench import bench_compare

    started = []

    def point(args, policy, scale, **kw):  # a point that would take 30 s in a subprocess
        started.append(policy)
        p = bench_compare.CHILDREN.run(["sleep", "30"], Path("."))
        return {"tokens_per_s": 1.0, "violation_rate": 0.0 if p.returncode == 0 else 1.0}

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_compare, "_runner", lambda fidelity: point)
    args = argparse.Namespace(fidelity="sim", start_scale=4.0, tolerance=0.05, max_scale=64.0, jobs=2,
                              workload="w.yaml", cluster="c.yaml", seed=None, duration_s=None, containers="homes")
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = _time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            bench_compare.compare(args, ["container", "muxserve", "token-pool", "slice"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert _time.monotonic() - t0 < 10
    assert sorted(started) == ["container", "muxserve"]  # the two running; the queued two never started a point
    with pytest.raises(RuntimeError, match="interrupted"):
        bench_compare.CHILDREN.run(["true"], Path("."))
    bench_compare.CHILDREN.stopping.clear()


def test_plan_containers_writes_a_file_every_command_takes(files, capsys):
    out = files / "containers.yaml"
    rc = main(["plan", "containers", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--seeds", "5", "--duration-s", "30", "--tolerance", "0.2", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "sustains rate scale" in text and "simulated)" in text
    data = yaml.safe_load(out.read_text())
    assert sorted(d for ds in data["containers"].values() for d in ds) == ["g0", "g1", "g2", "g3"]
    assert data["plan"]["tuning_seeds"] == [5] and data["plan"]["max_scale"] > 0
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "slice", "--duration-s", "20", "--containers", str(out), "--json", str(files / "s.json")])
    assert rc == 0
    assert json.loads((files / "s.json").read_text())["homes"] == data["containers"]
    rc = main(["plan", "containers", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--seeds", "5", "--duration-s", "30", "--at-scale", "2"])
    assert rc == 0 and "devices in all" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "containers", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
              "--seeds", "5,5"])
    assert e.value.code == 2 and "seeds repeat" in capsys.readouterr().err
    (files / "bad.yaml").write_text("containers: {t0: 9, t1: 1, t2: 1}\n")
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "container", "--containers", str(files / "bad.yaml")])
    assert rc == 2 and "bad.yaml: containers: the counts ask for 11 devices" in _one_line_error(capsys)


def test_sim_steering_setting_per_mesh_point(files, capsys):
    """``--sim-steering both`` searches each policy with and without the simulator's steering (the points alternate
    like two policies'); each point's scheduler gets SLICESCHED_SIM_STEERING accordingly; the simulator fidelity
    refuses the option."""
    import argparse

    from bench.compare_mesh import steering_env

    assert steering_env(argparse.Namespace(sim_steering="both"), "slice/steering-off") == (
        "slice", {"SLICESCHED_SIM_STEERING": "0"})
    assert steering_env(argparse.Namespace(sim_steering="both"), "slice/steering-on") == (
        "slice", {"SLICESCHED_SIM_STEERING": "1"})
    assert steering_env(argparse.Namespace(sim_steering="off"), "slice") == ("slice", {"SLICESCHED_SIM_STEERING": "0"})
    assert steering_env(argparse.Namespace(sim_steering=None), "container") == ("container", {})
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "slice", "--sim-steering", "both"])
    assert rc == 2 and "mesh fidelities" in _one_line_error(capsys)


def test_bench_steering_refuses_bad_scales(files, capsys):
    rc = main(["bench", "steering", "--fidelity", "emulated", "--workload", str(files / "w.yaml"),
               "--cluster", str(files / "cluster.yaml"), "--scales", "2,x"])
    assert rc == 2 and "--scales" in _one_line_error(capsys)


def test_a_point_stopped_early_fails_even_if_its_partial_figures_look_fine():
    from bench.bench_compare import passes
    r = {"violation_rate": 0.02, "worst_tenant_violation_rate": 0.03}
    assert passes(r, 0.09)
    assert not passes(dict(r, stopped_early=True), 0.09)


def test_lane_handback_is_the_slice_policys_parameter(files, capsys):
    """The lane hand-off is ``slice``'s ``lane_handback`` parameter, on by default (results carry it with the
    policy's parameters); ``bench compare --lane-handback on|off`` sets it for the policies that take it, at every
    fidelity, and refuses in one line naming the flag when none does."""
    out = files / "hb.json"
    for param, want in (([], True), (["--param", "lane_handback=false"], False)):
        rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
                   "--policy", "slice", "--rate-scale", "2", "--duration-s", "20", *param, "--json", str(out)])
        assert rc == 0
        assert json.loads(out.read_text())["policy"]["params"]["lane_handback"] is want
    from bench.bench_compare import handback_params
    args = argparse.Namespace(lane_handback="off")
    assert handback_params(args, "slice") == {"lane_handback": False}
    assert handback_params(args, "slice/steering-on") == {"lane_handback": False}
    assert handback_params(argparse.Namespace(lane_handback="on"), "slice") == {"lane_handback": True}
    assert handback_params(args, "container") == {}
    assert handback_params(argparse.Namespace(lane_handback=None), "slice") == {}
    capsys.readouterr()
    rc = main(["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
               "--policies", "container", "--fidelity", "real", "--lane-handback", "off"])
    assert rc == 2 and "--lane-handback" in _one_line_error(capsys)


def test_bench_tune_ranks_candidates_against_container_on_the_same_points(files, capsys):
    """A ``container-realloc`` candidate that never moves a device is ``container`` itself: it sustains exactly
    ``container``'s scale on every tuning point; candidates are ranked by their geometric-mean scale."""
    out = files / "tune.json"
    rc = main(["bench", "tune", "--policy", "container-realloc", "--grid", "min_deficit=0.25,100",
               "--grid", "interval_s=10", "--workloads", str(files / "w.yaml"), "--cluster",
               str(files / "cluster.yaml"), "--seeds", "7,8", "--duration-s", "30", "--tolerance", "0.25",
               "--start-scale", "8", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["seeds"] == [7, 8] and r["containers"][str(files / "w.yaml")]["mode"] == "plan"
    cands = {c["params"]["min_deficit"]: c for c in r["candidates"]}
    assert set(cands) == {0.25, 100} and all(c["params"]["interval_s"] == 10 for c in cands.values())
    ref = r["reference"]["max_scale"][str(files / "w.yaml")]
    assert ref > 0 and cands[100]["max_scale"][str(files / "w.yaml")] == ref
    assert cands[100]["x_container"][str(files / "w.yaml")] == 1.0
    assert [c["score"] for c in r["candidates"]] == sorted((c["score"] for c in r["candidates"]), reverse=True)
    assert r["best"] == r["candidates"][0]["params"]
    assert "best: " in capsys.readouterr().out


@pytest.mark.parametrize("grid, field", [("bogus=1", "bogus"), ("min_deficit=x", "must be a number"),
                                         ("min_deficit", "KEY=V1,V2"), ("min_deficit=1,,2", "KEY=V1,V2"),
                                         ("deadline_chunks=maybe", "expected true or false"),
                                         ("step_cap_s=-0.1", "expected seconds"),
                                         ("step_cap_s=fast", "expected seconds")])
def test_bench_tune_refuses_a_bad_grid_naming_it(files, capsys, grid, field):
    rc = main(["bench", "tune", "--policy", "container-realloc", "--grid", grid, "--workloads",
               str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml")])
    err = _one_line_error(capsys)
    assert rc == 2 and "--grid" in err and field in err


def test_bench_tune_takes_the_engines_prefill_order_as_a_grid_key(files, monkeypatch):
    """``--grid deadline_chunks=false,true`` tunes the engine's prefill order, not a policy parameter: the false
    candidate of ``container`` is the reference itself (the same scale on every point), the true one runs its
    points with deadline-aware chunks and the policy never sees the key."""
    import services.cli.simulate as simulate_mod
    seen, real_sim = [], simulate_mod.simulate

    def spy(cluster, w, policy, params=None, *a, **k):
        seen.append((policy, dict(params or {}), k.get("deadline_chunks")))
        return real_sim(cluster, w, policy, params, *a, **k)
    monkeypatch.setattr(simulate_mod, "simulate", spy)
    out = files / "tune.json"
    assert main(["bench", "tune", "--policy", "container", "--grid", "deadline_chunks=false,true", "--workloads",
                 str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"), "--seeds", "7", "--duration-s",
                 "20", "--tolerance", "0.3", "--start-scale", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    w = str(files / "w.yaml")
    cands = {c["params"]["deadline_chunks"]: c for c in r["candidates"]}
    assert cands[False]["max_scale"][w] == r["reference"]["max_scale"][w] > 0
    assert {c for _, _, c in seen} == {True, False} and all("deadline_chunks" not in p for _, p, _ in seen)


def test_a_points_parameters_are_the_candidates_and_the_lane_setting():
    from bench.bench_compare import point_params
    args = argparse.Namespace(policy_params={"slice": {"lease_s": 2.0}}, lane_handback="off")
    assert point_params(args, "slice") == {"lease_s": 2.0, "lane_handback": False}
    assert point_params(args, "container") == {}
    assert point_params(argparse.Namespace(), "slice") == {}


def test_muxserve_whose_weights_cannot_fit_is_a_one_line_error_not_a_hang(files, capsys):
    rc = main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
               "--policy", "muxserve", "--param", "weights_budget=0.01", "--duration-s", "10"])
    assert rc == 2 and "weights_budget 0.01" in _one_line_error(capsys)


def test_bench_tune_keeps_going_past_a_candidate_that_cannot_run(files, capsys):
    out = files / "tune.json"
    rc = main(["bench", "tune", "--policy", "muxserve", "--grid", "weights_budget=0.01,0.5", "--workloads",
               str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"), "--seeds", "7", "--duration-s", "20",
               "--tolerance", "0.25", "--start-scale", "8", "--json", str(out)])
    assert rc == 0
    r = {c["params"]["weights_budget"]: c for c in json.loads(out.read_text())["candidates"]}
    assert r[0.01]["error"] and "weights_budget" in r[0.01]["error"]
    assert r[0.01]["max_scale"][str(files / "w.yaml")] == 0.0
    assert r[0.5]["error"] is None and r[0.5]["max_scale"][str(files / "w.yaml")] > 0
    assert "cannot run: muxserve: weights_budget 0.01" in capsys.readouterr().out


def test_bench_tune_stops_every_search_on_an_interrupt(files, monkeypatch):
    """Once an interrupt has stopped the points (``CHILDREN.stop()``, as Ctrl-C does in the main thread), no search
    starts another point and the run ends with the interruption rather than with the remaining candidates marked
    as unable to run."""
    from bench import bench_compare, bench_tune
    from bench.compare_search import CHILDREN
    calls = []

    def point(args, policy, scale, seed=None, stop_above=None):
        calls.append(policy)
        if len(calls) == 3:
            CHILDREN.stop()
        return {"tokens_per_s": 1.0, "violation_rate": 0.0, "worst_tenant_violation_rate": 0.0}

    monkeypatch.setattr(bench_compare, "run_sim_point", point)
    args = argparse.Namespace(policy="container-realloc", grid=["min_deficit=1,2,3"], workloads=str(files / "w.yaml"),
                              cluster=str(files / "cluster.yaml"), seeds=(7,), containers="homes", duration_s=10.0,
                              plan_duration_s=None, bound="9", start_scale=8.0, tolerance=0.25, max_scale=256.0,
                              jobs=1, json_out=None)
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            bench_tune.tune(args)
        assert len(calls) == 3
    finally:
        CHILDREN.stopping.clear()


def _small_compare(files) -> list[str]:
    """A short ``bench compare`` on the test files (one reporting seed, one tuning seed)."""
    return ["bench", "compare", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
            "--duration-s", "20", "--tolerance", "0.3", "--start-scale", "8", "--seeds", "1", "--tuning-seeds", "7"]


def _spy_engine_option(monkeypatch, key: str) -> tuple[list, list]:
    """(the (policy, ``key``) of every simulated point, the ``SimConfig.<key>`` of every planning simulation)."""
    import services.cli.simulate as simulate_mod
    import shared.sim.planner as planner_mod
    seen, planned = [], []
    real_sim, real_sim_cls = simulate_mod.simulate, planner_mod.Simulator

    def spy(cluster, w, policy, *a, **k):
        seen.append((policy, k.get(key)))
        return real_sim(cluster, w, policy, *a, **k)

    def spy_cls(cluster, tenants, policy, cfg, rng):
        planned.append(getattr(cfg, key))
        return real_sim_cls(cluster, tenants, policy, cfg, rng)
    monkeypatch.setattr(simulate_mod, "simulate", spy)
    monkeypatch.setattr(planner_mod, "Simulator", spy_cls)
    return seen, planned


def test_deadline_chunks_per_policy_in_bench_compare(files, capsys, monkeypatch):
    """``--deadline-chunks container`` runs container's points (and the plan sized for it) with deadline-aware
    chunked prefill and the other policies in arrival order; the JSON says which; a point in a subprocess gets
    ``--deadline-chunks``; a mesh point gets SLICESCHED_DEADLINE_CHUNKS 1 or 0; bad names are one-line errors."""
    from bench import bench_compare
    from bench.compare_mesh import point_env
    seen, planned = _spy_engine_option(monkeypatch, "deadline_chunks")
    out = files / "dc.json"
    base = _small_compare(files)
    assert main([*base, "--policies", "container,slice", "--deadline-chunks", "container", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["deadline_chunks"] == ["container"] and r["containers"]["deadline_chunks"] is True
    assert planned and all(planned)
    assert {p for p, c in seen if c} == {"container"} and {p for p, c in seen if not c} == {"slice"}
    assert "deadline-aware chunked prefill: container" in capsys.readouterr().out
    # the partition planned with the chunks and container's searches cannot be reused by a run without them
    assert main([*base, "--policies", "container,slice", "--reuse", f"container={out}"]) == 2
    assert "container ran with --deadline-chunks there, without here" in _one_line_error(capsys)
    for chunks, needle in (("slice", "slice is not among --policies"), ("pooled-bound", "analytic bound")):
        assert main([*base, "--policies", "container,pooled-bound", "--deadline-chunks", chunks]) == 2
        assert needle in _one_line_error(capsys), chunks
    with pytest.raises(SystemExit) as e:
        main([*base, "--policies", "container", "--deadline-chunks", "container,container"])
    assert e.value.code == 2 and "names repeat" in capsys.readouterr().err
    cmds = []
    monkeypatch.setattr(bench_compare.CHILDREN, "run", lambda cmd, cwd: (
        cmds.append(cmd), argparse.Namespace(returncode=1, stderr="stopped"))[1])
    args = argparse.Namespace(jobs=2, cluster="c.yaml", workload="w.yaml", duration_s=None, homes=None,
                              deadline_chunks=("container",))
    for policy in ("container", "slice"):
        with pytest.raises(RuntimeError):
            bench_compare.run_sim_point(args, policy, 2.0, seed=1)
    assert ["--deadline-chunks" in c for c in cmds] == [True, False]
    args = argparse.Namespace(sim_steering=None, lane_handback=None, deadline_chunks=("slice",))
    assert point_env(args, "slice") == ("slice", {"SLICESCHED_DEADLINE_CHUNKS": "1"})
    assert point_env(args, "container") == ("container", {"SLICESCHED_DEADLINE_CHUNKS": "0"})
    assert point_env(argparse.Namespace(sim_steering=None, lane_handback=None), "slice") == ("slice", {})


def test_plan_containers_with_deadline_chunks(files, monkeypatch):
    """``plan containers --deadline-chunks`` simulates every replica with deadline-aware chunks and says so in the
    file's plan block."""
    import shared.sim.planner as planner_mod
    planned, real_sim_cls = [], planner_mod.Simulator

    def spy_cls(cluster, tenants, policy, cfg, rng):
        planned.append(cfg.deadline_chunks)
        return real_sim_cls(cluster, tenants, policy, cfg, rng)
    monkeypatch.setattr(planner_mod, "Simulator", spy_cls)
    for flag, want in (([], False), (["--deadline-chunks"], True)):
        out = files / f"c{want}.yaml"
        planned.clear()
        assert main(["plan", "containers", "--workload", str(files / "w.yaml"), "--cluster",
                     str(files / "cluster.yaml"), "--seeds", "5", "--duration-s", "20", "--tolerance", "0.3",
                     "-o", str(out), *flag]) == 0
        assert planned and set(planned) == {want}
        assert yaml.safe_load(out.read_text())["plan"]["deadline_chunks"] is want


def test_step_cap_per_policy_in_bench_compare(files, capsys, monkeypatch):
    """``--step-cap container=0.05`` runs container's points (and the plan made for it) with its steps capped and
    the other policies uncapped; the JSON says so; a point in a subprocess gets ``--step-cap-s``; a mesh point gets
    SLICESCHED_STEP_CAP_S; a reuse with another cap and bad values are one-line errors."""
    from bench import bench_compare
    from bench.compare_mesh import point_env
    seen, planned = _spy_engine_option(monkeypatch, "step_cap_s")
    out = files / "cap.json"
    base = _small_compare(files)
    assert main([*base, "--policies", "container,slice", "--step-cap", "container=0.05", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["step_cap_s"] == {"container": 0.05} and r["containers"]["step_cap_s"] == 0.05
    assert planned and set(planned) == {0.05}
    assert {p for p, c in seen if c == 0.05} == {"container"} and {p for p, c in seen if not c} == {"slice"}
    assert "step cap): container 0.05 s" in capsys.readouterr().out
    assert main([*base, "--policies", "container,slice", "--step-cap", "container=0.04",
                 "--reuse", f"container={out}"]) == 2
    assert "container ran with a step cap of 0.05 s there, 0.04 s here" in _one_line_error(capsys)
    assert main([*base, "--policies", "container,slice", "--step-cap", "pooled-bound=0.05"]) == 2
    assert "--step-cap: pooled-bound is not among --policies" in _one_line_error(capsys)
    for bad, needle in (("container", "expected NAME=SECONDS"), ("container=-1", "must be >= 0"),
                        ("container=1,container=2", "names repeat")):
        with pytest.raises(SystemExit) as e:
            main([*base, "--policies", "container", "--step-cap", bad])
        assert e.value.code == 2 and needle in capsys.readouterr().err, bad
    cmds = []
    monkeypatch.setattr(bench_compare.CHILDREN, "run", lambda cmd, cwd: (
        cmds.append(cmd), argparse.Namespace(returncode=1, stderr="stopped"))[1])
    args = argparse.Namespace(jobs=2, cluster="c.yaml", workload="w.yaml", duration_s=None, homes=None,
                              step_cap={"container": 0.05})
    for policy in ("container", "slice"):
        with pytest.raises(RuntimeError):
            bench_compare.run_sim_point(args, policy, 2.0, seed=1)
    assert [c[c.index("--step-cap-s") + 1] if "--step-cap-s" in c else None for c in cmds] == ["0.05", None]
    args = argparse.Namespace(sim_steering=None, lane_handback=None, step_cap={"slice": 0.05})
    assert point_env(args, "slice") == ("slice", {"SLICESCHED_STEP_CAP_S": "0.05"})
    assert point_env(args, "container") == ("container", {"SLICESCHED_STEP_CAP_S": "0.0"})


def test_simulate_and_plan_take_a_step_cap(files, capsys, monkeypatch):
    """``simulate --step-cap-s`` and ``plan containers --step-cap-s`` run every replica with the cap (the result and
    the containers file say which); a negative cap is a one-line usage error."""
    import shared.sim.planner as planner_mod
    planned, real_sim_cls = [], planner_mod.Simulator

    def spy_cls(cluster, tenants, policy, cfg, rng):
        planned.append(cfg.step_cap_s)
        return real_sim_cls(cluster, tenants, policy, cfg, rng)
    monkeypatch.setattr(planner_mod, "Simulator", spy_cls)
    out = files / "capped.yaml"
    assert main(["plan", "containers", "--workload", str(files / "w.yaml"), "--cluster", str(files / "cluster.yaml"),
                 "--seeds", "5", "--duration-s", "20", "--tolerance", "0.3", "-o", str(out),
                 "--step-cap-s", "0.03"]) == 0
    assert planned and set(planned) == {0.03}
    assert yaml.safe_load(out.read_text())["plan"]["step_cap_s"] == 0.03
    js = files / "sim.json"
    assert main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
                 "--policy", "container", "--duration-s", "10", "--step-cap-s", "0.03", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["step_cap_s"] == 0.03
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--cluster", str(files / "cluster.yaml"), "--workload", str(files / "w.yaml"),
              "--policy", "container", "--step-cap-s", "-1"])
    assert e.value.code == 2 and "--step-cap-s" in capsys.readouterr().err
