"""``slicesched bench transport``: argument checks and a tiny real run between two processes."""
from __future__ import annotations

import json

import pytest
import torch

from bench.bench_transport import parse_size
from services.cli.main import main
from shared.config import ConfigError


def test_sizes_parse():
    assert [parse_size(s) for s in ("4K", "64k", "1M", "16MiB", "1G", "4096")] == \
        [4096, 65536, 1 << 20, 16 << 20, 1 << 30, 4096]
    for bad in ("", "4X", "-1K", "6", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad)


@pytest.mark.parametrize("argv", [["--backends", "shm,bogus"], ["--sizes", "4Q"], ["--iters", "0"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert main(["bench", "transport", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "command line" in err[0]


def test_tiny_run_writes_the_result_file(tmp_path):
    out = tmp_path / "transport.json"
    rc = main(["bench", "transport", "--backends", "shm,cuda_ipc", "--sizes", "4K,64K", "--iters", "5",
               "--warmup", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["results"]["shm"]["sizes"]
    assert [r["bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["iters"] == 5 and 0 < r["p50_ms"] <= r["p99_ms"] and r["gbps"] > 0
    assert data["command"].startswith("slicesched bench transport --backends shm,cuda_ipc")
    if not torch.cuda.is_available():
        assert data["results"]["cuda_ipc"] == {"status": "not measured: no GPU on this machine"}
