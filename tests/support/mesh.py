"""Start the mesh exactly as ``make up`` does (``slicesched up``: private Redis, one process per service); with
``redis_cluster=N``, as ``slicesched up --redis-cluster N`` does (a private Redis Cluster of N masters)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis as syncredis

from shared.redis_util import sync_client

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Mesh:
    proc: subprocess.Popen
    gateway: str
    redis_url: str
    prefix: str
    data_dir: Path

    def redis(self) -> syncredis.Redis:
        return sync_client(self.redis_url, socket_timeout=5)

    def pid_of(self, service: str, name: str) -> int:
        v = self.redis().hget(f"{self.prefix}health:{service}:{name}", "pid")
        return int(v) if v else 0

    def service_pids(self) -> list[int]:
        r = self.redis()
        return [int(r.hget(k, "pid")) for k in r.scan_iter(match=f"{self.prefix}health:*") if r.hget(k, "pid")]


TINY = ["--cluster", str(REPO / "configs" / "cluster-tiny.yaml"), "--tenants", str(REPO / "configs" / "tenants-tiny.yaml")]


def start_mesh(tmp: Path, *, extra_args: list[str] | None = None, env: dict | None = None,
               timeout_s: float = 240, redis_cluster: int = 0) -> Mesh:
    """``slicesched up`` on the tiny random-weight tenants (configs/*-tiny.yaml) unless ``extra_args`` name a
    cluster or tenants file; ``redis_cluster`` N starts a private Redis Cluster of N masters."""
    prefix = "e2e:"
    extra = list(extra_args or [])
    for flag, value in zip(TINY[::2], TINY[1::2]):
        if flag not in extra:
            extra += [flag, value]
    if redis_cluster:
        extra += ["--redis-cluster", str(redis_cluster)]
    e = dict(os.environ)
    e.pop("REDIS_URL", None)
    e.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", "--port", "0", "--data-dir", str(tmp),
                             "--prefix", prefix, *extra], cwd=REPO, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line.rstrip())
        if line.startswith("SLICESCHED_READY"):
            kv = dict(p.split("=", 1) for p in line.split()[1:])
            return Mesh(proc, kv["gateway"], kv["redis"], prefix, tmp)
    proc.kill()
    raise RuntimeError("mesh did not start:\n" + "\n".join(lines[-40:]))


def stop_mesh(mesh: Mesh, timeout_s: float = 60) -> int:
    if mesh.proc.poll() is None:
        mesh.proc.send_signal(signal.SIGTERM)
    try:
        return mesh.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(mesh.proc.pid, signal.SIGKILL)
        return -9
