"""``slicesched bench whatif`` end to end on a private redis-server: the RPC through the real simulator service, and
the evaluation alone in process (``--in-process``)."""
from __future__ import annotations

import json

import pytest

from services.cli.main import main


@pytest.mark.parametrize("in_process", [False, True])
def test_bench_whatif_times_every_query(tmp_path, in_process):
    out = tmp_path / "w.json"
    argv = ["bench", "whatif", "--queries", "40", "--warmup", "5", "--candidates", "4", "--json", str(out)]
    rc = main(argv + (["--in-process"] if in_process else []))
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["queries"] == 40 and r["devices"] == 32
    assert r["outcomes"] == 40 * 4  # one outcome per candidate, none lost
    c = r["compute_ms"]
    assert 0 < c["p50"] <= c["p99"]
    if in_process:
        assert r["mode"] == "in_process" and "rpc_ms" not in r
        assert c["p99"] <= c["max"] == pytest.approx(r["slowest"][0][1], abs=1e-3)
        assert len(r["slowest"]) == 20
    else:
        assert r["mode"] == "rpc"
        assert 0 < r["rpc_ms"]["p50"] <= r["rpc_ms"]["p99"] <= r["rpc_ms"]["max"]
        assert r["rpc_ms"]["p50"] >= c["p50"]  # a round trip includes the evaluation


def test_bench_whatif_refuses_nonpositive_counts(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["bench", "whatif", "--queries", "0", "--in-process"])
    assert ei.value.code == 2
    assert "argument --queries: must be positive" in capsys.readouterr().err
