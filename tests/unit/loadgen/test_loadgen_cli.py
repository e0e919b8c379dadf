"""The ``loadgen`` command: build/show output, one-line errors with exit 2, Ctrl-C during replay."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from loadgen.cli import main

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).parent))
from test_loadgen_replay import KEYS, start  # noqa: E402  (the fake gateway)


def trace(tmp: Path, n: int = 40) -> Path:
    p = tmp / "trace.jsonl"
    p.write_text("".join(f'{{"timestamp": {i * 250}, "input_length": {10 + i}, "output_length": 4}}\n'
                         for i in range(n)))
    return p


def tenants(tmp: Path, names=("good", "limited")) -> Path:
    p = tmp / "tenants.yaml"
    p.write_text("tenants:\n" + "".join(
        f"  - {{name: {n}, model: tiny, sla: {{ttft_ms: 5000, tpot_ms: 1000}}, home_devices: [cpu0], "
        f"api_keys: [{KEYS[n]}]}}\n" for n in names))
    return p


def test_build_then_show(tmp_path, capsys):
    out = tmp_path / "wl" / "w.yaml"
    rc = main(["workload", "build", "--trace", str(trace(tmp_path)), "--tenants", str(tenants(tmp_path)),
               "--alpha", "1.0", "--seed", "5", "--duration-s", "10", "--max-output-tokens", "3", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "good" in text and "limited" in text and f"wrote {out}" in text and "mean rate" in text
    doc = yaml.safe_load(out.read_text())
    assert doc["tenants"] == "../tenants.yaml" and doc["traces"][0] == {"path": "../trace.jsonl", "format": "jsonl"}
    assert doc["alpha"] == 1.0 and doc["seed"] == 5 and doc["caps"] == {"max_output_tokens": 3}
    assert main(["workload", "show", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    # 4 req/s for 10 s split 2:1 by alpha 1 over two tenants
    assert st["total"]["requests"] == pytest.approx(40, abs=12)
    assert st["tenants"]["good"]["requests"] > st["tenants"]["limited"]["requests"]
    assert st["tenants"]["good"]["mean_output_tokens"] == 3


def test_build_csv_columns(tmp_path, capsys):
    f = tmp_path / "g.csv"
    f.write_text("ts,p,c\n" + "".join(f"{i * 0.5},{20},{5}\n" for i in range(20)))
    out = tmp_path / "w.yaml"
    rc = main(["workload", "build", "--trace", str(f), "--format", "csv", "--columns", "time=ts,input=p,output=c",
               "--tenants", str(tenants(tmp_path)), "--alpha", "native", "--seed", "1", "--duration-s", "5",
               "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert yaml.safe_load(out.read_text())["traces"][0]["columns"] == {"time": "ts", "input": "p", "output": "c"}


@pytest.mark.parametrize("args,needle", [
    (["workload", "show", "nope.yaml"], "nope.yaml: (file): file not found"),
    (["workload", "build", "--trace", "{bad}", "--format", "csv", "--tenants", "{ten}", "--alpha", "1", "--seed",
      "1", "--duration-s", "5", "-o", "{out}"], "format csv needs --columns"),
    (["workload", "build", "--trace", "{bad}", "--format", "csv", "--columns", "time=ts,input=p,output=zz",
      "--tenants", "{ten}", "--alpha", "1", "--seed", "1", "--duration-s", "5", "-o", "{out}"],
     "line 1, column zz: no such column"),
    (["workload", "build", "--trace", "{bad}", "--tenants", "{ten}", "--alpha", "x", "--seed", "1",
      "--duration-s", "5", "-o", "{out}"], "expected a number or 'native'"),
])
def test_errors_are_one_line_exit_2(tmp_path, capsys, args, needle):
    bad = tmp_path / "bad.csv"
    bad.write_text("ts,p,c\n1,2,3\n")
    ten = tenants(tmp_path)
    args = [a.format(bad=bad, ten=ten, out=tmp_path / "o.yaml") for a in args]
    with pytest.raises(SystemExit) if "--alpha" in args and "x" in args else _noop():
        rc = main(args)
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


class _noop:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_ctrl_c_writes_partial_results(tmp_path):
    loop = asyncio.new_event_loop()
    box: dict = {}
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        box["srv"] = loop.run_until_complete(start([]))
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    try:
        ten = tenants(tmp_path, names=("good", "slow"))
        w = tmp_path / "w.yaml"
        tr = trace(tmp_path, 400)
        w.write_text(f"tenants: {ten.name}\ntraces: [{tr.name}]\nalpha: 0\nseed: 1\nduration_s: 100\n")
        out = tmp_path / "out"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen([sys.executable, "-m", "loadgen.cli", "replay", "--workload", str(w), "--url",
                                 box["srv"].url, "--out", str(out), "--grace-s", "0.5", "--no-progress"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 20
        while time.time() < deadline and "replay_start" not in (proc.stderr.readline() or ""):
            pass
        time.sleep(2.5)  # past the first few arrivals of both tenants
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(box["srv"].stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert proc.returncode == 130, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] is True and summary["not_sent"] > 0
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["status"] for r in recs if r["tenant"] == "slow"} == {"cancelled"}, (recs, stderr)
    assert {r["status"] for r in recs if r["tenant"] == "good"} == {"ok"}
    assert "PARTIAL" in (out / "summary.md").read_text() and "PARTIAL" in stdout
