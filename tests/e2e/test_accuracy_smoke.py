"""``slicesched bench accuracy`` end to end on the real CPU mesh (a few seconds of arrivals)."""
from __future__ import annotations

import json

import pytest

from services.cli.main import main

pytestmark = pytest.mark.e2e  # starts the whole mesh: ~30 s on 2 cores


def test_accuracy_bench_runs_the_mesh_and_reports(tmp_path):
    out, raw = tmp_path / "acc.json", tmp_path / "raw.json"
    rc = main(["bench", "accuracy", "--duration-s", "4", "--calibration-s", "2", "--json", str(out),
               "--raw-out", str(raw), "--machine-noise-s", "0.6"])
    assert rc == 0
    res = json.loads(out.read_text())
    phases = json.loads(raw.read_text())["phases"]
    # the machine's steadiness, timed before the mesh started, per window length; saved with the measurements
    assert [n["window_s"] for n in res["machine_noise"]] == [0.05, 0.2]
    assert json.loads(raw.read_text())["machine_noise"] == res["machine_noise"]
    assert all(n["windows"] >= 3 and n["min"] <= 1.0 <= n["max"] for n in res["machine_noise"])
    assert set(phases) == {"calibration", "run"}
    run = phases["run"]
    assert run["requests"] and all(r["status"] == "ok" for r in run["requests"])
    assert run["segments"] and run["memory"] and run["worker_requests"]
    # every measured request has a prediction, and the memory timelines line up within 5 % of capacity
    assert res["calibrated"]["detail"]["ttft"]["requests"] == len(run["requests"])
    assert res["memory_error_pct_capacity"] < 0.05
    for key in ("segment_mape", "ttft_median_ape", "tpot_median_ape"):
        assert res[key] >= 0
