"""``slicesched bench cpu`` end to end on the real CPU mesh (a few seconds of arrivals)."""
from __future__ import annotations

import json

import pytest

from services.cli.main import main

pytestmark = pytest.mark.e2e  # starts the whole mesh: ~20 s on 2 cores


def test_cpu_bench_reports_every_process_of_the_mesh(tmp_path):
    out = tmp_path / "cpu.json"
    rc = main(["bench", "cpu", "--rate", "2", "--duration-s", "3", "--idle-s", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["ok"] == res["requests"] > 0 and res["output_tokens"] > 0
    procs = res["processes"]
    assert {"gateway", "scheduler-0", "simulator", "gmg", "redis", "cpu0", "cpu1", "client"} <= set(procs)
    assert all(p["cpu_s"] >= 0 and p["ms_per_request"] >= 0 for p in procs.values())
    assert procs["cpu0"]["cpu_s"] + procs["cpu1"]["cpu_s"] > 0  # the workers computed the tokens
    assert set(res["totals"]) == {"workers", "control plane", "client"}
    cp = sum(p["cpu_s"] for n, p in procs.items() if n in ("gateway", "scheduler-0", "simulator", "gmg", "redis"))
    assert res["totals"]["control plane"]["cpu_s"] == pytest.approx(cp)
    cmds = res["redis_commands_per_request"]
    assert cmds["xadd"] > 1 and cmds["xreadgroup"] > 0  # requests in, tokens out, through the streams
