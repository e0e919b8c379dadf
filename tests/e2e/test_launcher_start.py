"""The launcher's start-up: a picked gateway port taken before the gateway binds is replaced by another, and a
start that fails leaves no process behind (Redis included)."""
from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from services.launcher import Launcher
from shared.config import REPO_CONFIGS, load_cluster

pytestmark = pytest.mark.e2e


def _launcher(tmp_path: Path, port: int) -> Launcher:
    cluster_file = REPO_CONFIGS / "cluster-tiny.yaml"
    return Launcher(load_cluster(cluster_file), cluster_file=str(cluster_file),
                    tenants_file=str(REPO_CONFIGS / "tenants-tiny.yaml"), data_dir=tmp_path, gateway_port=port)


def _all_stopped(lz: Launcher) -> bool:
    procs = [c.proc for c in lz.children if c.proc is not None]
    if lz.redis_server is not None and lz.redis_server.proc is not None:
        procs.append(lz.redis_server.proc)
    return bool(procs) and all(p.poll() is not None for p in procs)


def test_a_picked_port_taken_meanwhile_is_replaced(tmp_path):
    lz = _launcher(tmp_path, 0)
    taken = lz.gateway_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            lz.start(timeout_s=120)
            assert lz.gateway_port != taken
            with urllib.request.urlopen(f"{lz.gateway_url}/health", timeout=5) as r:
                assert r.status == 200
        finally:
            lz.stop(drain_s=5)
    assert _all_stopped(lz)


def test_a_failed_start_stops_everything_it_started(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        lz = _launcher(tmp_path, squatter.getsockname()[1])  # a port the operator chose: not replaced
        with pytest.raises(RuntimeError, match="gateway"):
            lz.start(timeout_s=120)
    assert _all_stopped(lz), "a failed start left processes running"
