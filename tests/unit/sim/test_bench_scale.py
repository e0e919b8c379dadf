"""The scale benchmark's generated configs load as the repository's do, `bench simspeed` runs a workload file with
containers and reports CPU time, and the scale plot is drawn from a run's JSON (small PNG)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.bench_scale import plot, summary_row
from bench.scale_configs import write_scale_configs
from loadgen.workload import read_workload_spec
from services.cli.main import main as cli_main
from shared.config import ConfigError, load_cluster, load_tenants

TRACES = Path(os.environ.get("SLICESCHED_TRACES", Path(__file__).resolve().parents[4] / "shared" / "traces"))


def test_generated_configs_load_and_spread_the_tenants(tmp_path):
    cfg = write_scale_configs(tmp_path, 40, 8, rate_scale=2.0)
    cluster = load_cluster(cfg.cluster)
    tenants = load_tenants(cfg.tenants, cluster)
    assert len(cluster.devices) == 40 and len({d.host for d in cluster.devices}) == 5
    assert [len(t.home_devices) for t in tenants.tenants] == [5] * 8
    assert len({h for t in tenants.tenants for h in t.home_devices}) == 40
    assert [t.model.preset for t in tenants.tenants][:4] == ["llama-7b", "llama-7b", "llama-7b", "llama-13b"]
    spec = read_workload_spec(cfg.workload)
    assert spec.rate_scale == pytest.approx(2.0 * 40 / 32) and spec.alpha == 1.3
    with pytest.raises(ConfigError):
        write_scale_configs(tmp_path / "x", 4, 8)


@pytest.mark.skipif(not (TRACES / "azure_llm_2023_conv.csv").is_file(), reason="Azure traces not present")
def test_simspeed_runs_a_workload_file_with_containers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLICESCHED_TRACES", str(TRACES))
    cfg = write_scale_configs(tmp_path, 16, 4)
    out = tmp_path / "s.json"
    assert cli_main(["bench", "simspeed", "--cluster", str(cfg.cluster), "--workload", str(cfg.workload),
                     "--policy", "slice", "--containers", "sized", "--duration-s", "30", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["devices"] == 16 and res["tenants"] == 4 and res["requests"] > 0 and res["events"] > 0
    assert res["rate_scale"] == pytest.approx(0.5) and res["containers"] == "sized"
    assert res["cpu_s"] > 0 and res["wall_s"] > 0 and "start" in res["loadavg_1m"]
    assert "simspeed (slice" in capsys.readouterr().out


def test_scale_plot_from_a_runs_json(tmp_path):
    def point(d, t, p99, wall):
        return {"devices": d, "tenants": t,
                "decisions": {"result": {"p50_ms": p99 / 3, "p99_ms": p99, "admission_p99_ms": 2.0,
                                         "committed": 10, "committed_p99_ms": p99,
                                         "committed_phases_p99_ms": {"snapshot": 0.5, "decide": 1.0}}},
                "whatif": {"result": {"rpc_ms": {"p99": 3.0}, "compute_ms": {"p99": 1.0}}},
                "simulate": {"result": {"requests": d * 900, "wall_s": wall, "cpu_s": wall * 0.9,
                                        "workload_build_s": 1.0, "loadavg_1m": {"end": 1.0}}}}
    result = {"points": [point(32, 16, 3.0, 16.0), point(256, 64, 6.0, 90.0), point(1024, 256, 9.0, 330.0),
                         point(1024, 64, 8.0, 300.0)],
              "date": "2026-12-03 20:00 UTC", "machine": "x86_64 2 CPUs, host", "sim_duration_s": 3600.0}
    assert summary_row(result["points"][2])["decision_p99_ms"] == 9.0
    png = plot(result, tmp_path / "scale.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) <= 150_000
