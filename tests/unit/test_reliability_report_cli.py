"""`python -m tests.reliability.report`: pytest's own options pass through with --run, in order (the documented
`--run -k row6`), and are refused without it."""
from __future__ import annotations

import json

import pytest

from reliability import report


def test_pytest_arguments_pass_through_in_order(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(report.subprocess, "call", lambda cmd, **kw: calls.append((cmd, kw)) or 0)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([]))
    out = tmp_path / "page.md"
    assert report.main(["--run", "-k", "row6 or row7", "--results", str(results), "-x", "--out", str(out)]) == 0
    (cmd, kw), = calls
    assert cmd[-3:] == ["-k", "row6 or row7", "-x"] and "tests/reliability" in cmd
    assert kw["env"]["SLICESCHED_RELIABILITY_RESULTS"] == str(results)
    assert out.read_text().startswith("# Reliability")


def test_pytest_arguments_without_run_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as ei:
        report.main(["--results", str(tmp_path / "r.json"), "-k", "row6"])
    assert ei.value.code == 2 and "pytest arguments need --run" in capsys.readouterr().err
