"""``slicesched bench cpu``: CPU above idle per request and per token, grouped by role; bad flags named."""
from __future__ import annotations

import pytest

from bench.bench_cpu import per_process, totals
from services.cli.main import main


def test_per_process_subtracts_idle_use_and_divides_by_work():
    idle = ({"gateway": 1.0, "cpu0": 5.0}, {"gateway": 1.1, "cpu0": 5.0}, 10.0)  # gateway idles at 0.01 cores
    load = ({"gateway": 1.1, "cpu0": 5.0, "client": 0.0}, {"gateway": 3.1, "cpu0": 9.0, "client": 0.5}, 20.0)
    rows = per_process(idle, load, requests=100, output_tokens=1000)
    assert set(rows) == {"gateway", "cpu0"}  # client has no idle reading: left out
    g = rows["gateway"]
    assert g["cpu_s"] == pytest.approx(2.0) and g["cores"] == pytest.approx(0.1)
    assert g["idle_cores"] == pytest.approx(0.01)
    assert g["ms_per_request"] == pytest.approx(1e3 * (2.0 - 0.2) / 100)
    assert g["us_per_output_token"] == pytest.approx(1e6 * 1.8 / 1000)
    assert rows["cpu0"]["ms_per_request"] == pytest.approx(40.0)


def test_totals_group_services_into_control_plane_workers_and_client():
    row = {"cpu_s": 1.0, "cores": 0.1, "idle_cores": 0.0, "ms_per_request": 2.0, "us_per_output_token": 3.0}
    names = ("gateway", "scheduler-0", "simulator", "gmg", "redis", "cpu0", "cpu1", "emulated", "client")
    t = totals({n: dict(row) for n in names})
    assert t["control plane"]["cpu_s"] == 5.0 and t["workers"]["cpu_s"] == 3.0 and t["client"]["cpu_s"] == 1.0
    assert t["control plane"]["ms_per_request"] == 10.0


@pytest.mark.parametrize("flag,value", [("--rate", "0"), ("--duration-s", "-1"), ("--idle-s", "-2"),
                                        ("--policy", "nope"), ("--policy", "pooled-bound")])
def test_bad_flags_are_named(flag, value, capsys):
    assert main(["bench", "cpu", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1
