"""The mesh under test: a private redis-server the harness controls (kill, restart, pause), optionally behind a
:class:`~reliability.proxy.FaultProxy`, or a private Redis Cluster (3 masters, one replica each) when
``SLICESCHED_REL_REDIS=cluster`` (or ``redis="cluster"``), and the whole mesh started by ``slicesched up`` with
``REDIS_URL`` pointing at it. Services are found, signalled and awaited through their health keys; their logs are
read for error events."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis as syncredis
from redis.exceptions import RedisClusterException

from reliability.proxy import FaultProxy
from shared.messages import GROUP_SCHEDULER, GROUP_WORKER, requests_stream, worker_stream
from shared.procutil import LocalRedisCluster, RedisServer
from shared.redis_util import sync_client
from shared.requests_state import tenant_stats_key
from support.mesh import Mesh, start_mesh, stop_mesh

DEVICES = ("cpu0", "cpu1")
TENANT_DEVICE = {"tiny-a": "cpu0", "tiny-b": "cpu1"}
KEYS = {"tiny-a": "sk-dev-tiny-a-0001", "tiny-b": "sk-dev-tiny-b-0001"}
REL_REDIS = os.environ.get("SLICESCHED_REL_REDIS", "server")  # server | cluster
REDIS_ERRORS = (syncredis.RedisError, RedisClusterException)
SERVICES = (("gmg", "gmg"), ("simulator", "simulator"), ("scheduler", "scheduler-0"), ("worker", "cpu0"),
            ("worker", "cpu1"))


@dataclass
class Rig:
    """Owns the Redis process, the optional proxy and the launched mesh; everything here is synchronous."""

    tmp: Path
    redis_server: RedisServer | None
    mesh: Mesh
    proxy: FaultProxy | None = None
    events: list[tuple[float, str]] = field(default_factory=list)
    cluster: LocalRedisCluster | None = None

    @classmethod
    def start(cls, tmp: Path, *, appendfsync: str = "everysec", appendonly: bool = True, proxy: bool = False,
              env: dict | None = None, redis: str = REL_REDIS) -> "Rig":
        if redis == "cluster":
            if proxy:
                raise ValueError("the fault proxy sits in front of one redis-server, not a cluster")
            cluster = LocalRedisCluster(tmp / "redis-cluster", appendonly=appendonly, appendfsync=appendfsync).start()
            try:
                mesh = start_mesh(tmp / "mesh", env={"REDIS_URL": cluster.url, **(env or {})})
            except Exception:
                cluster.stop()
                raise
            rig = cls(tmp, None, mesh, None, cluster=cluster)
            rig.wait_ready(120)
            return rig
        server = RedisServer(tmp / "redis", appendonly=appendonly, appendfsync=appendfsync).start()
        px = FaultProxy("127.0.0.1", server.port).start() if proxy else None
        try:
            mesh = start_mesh(tmp / "mesh", env={"REDIS_URL": px.url if px else server.url, **(env or {})})
        except Exception:
            if px:
                px.stop()
            server.stop()
            raise
        rig = cls(tmp, server, mesh, px)
        rig.wait_ready(120)
        return rig

    def stop(self) -> None:
        try:
            stop_mesh(self.mesh)
        finally:
            if self.proxy:
                self.proxy.stop()
            if self.redis_server is not None:
                self.redis_server.stop()
            if self.cluster is not None:
                self.cluster.stop()

    # ------------------------------------------------------------ Redis
    @property
    def prefix(self) -> str:
        return self.mesh.prefix

    @property
    def redis_url(self) -> str:
        """The harness's own, direct connection (never through the proxy)."""
        return self.cluster.url if self.cluster is not None else self.redis_server.url

    def r(self) -> syncredis.Redis:
        return sync_client(self.redis_url, socket_timeout=5, socket_connect_timeout=2)

    def kill_redis(self) -> float:
        self.redis_server.kill()
        return self.mark("redis_killed")

    def restart_redis(self, *, appendonly: bool, appendfsync: str) -> float:
        """Start redis-server again on the same port and data directory (it replays the AOF if there is one)."""
        self.redis_server.appendonly, self.redis_server.appendfsync = appendonly, appendfsync
        self.redis_server.start()
        return self.mark("redis_restarted")

    def set_persistence(self, *, appendonly: bool, appendfsync: str) -> None:
        r = self.r()
        r.config_set("appendfsync", appendfsync)
        r.config_set("appendonly", "yes" if appendonly else "no")
        if appendonly:  # wait for the AOF rewrite that turning AOF on starts
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and int(r.info("persistence").get("aof_rewrite_in_progress", 0)):
                time.sleep(0.1)
        self.redis_server.appendonly, self.redis_server.appendfsync = appendonly, appendfsync

    # ------------------------------------------------------------ processes
    def pid(self, service: str, name: str) -> int:
        try:
            v = self.r().hget(f"{self.prefix}health:{service}:{name}", "pid")
        except REDIS_ERRORS:
            return 0
        return int(v) if v else 0

    def signal(self, service: str, name: str, sig: int) -> int:
        pid = self.pid(service, name)
        if not pid:
            raise RuntimeError(f"no pid for {service}:{name}")
        os.kill(pid, sig)
        self.mark(f"{signal.Signals(sig).name} {service}:{name} pid={pid}")
        return pid

    def wait_new_pid(self, service: str, name: str, old: int, timeout_s: float = 90) -> float:
        """Seconds until a process other than ``old`` reports ready for ``service:name``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                h = self.r().hgetall(f"{self.prefix}health:{service}:{name}")
            except REDIS_ERRORS:
                h = {}
            if h.get(b"pid") and int(h[b"pid"]) != old and h.get(b"ready") == b"1":
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"{service}:{name} was not restarted within {timeout_s:.0f} s")

    def wait_ready(self, timeout_s: float = 90) -> float:
        """Every service healthy, both devices ready with a fresh heartbeat, the gateway's /health 200."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < timeout_s:
            try:
                r = self.r()
                missing = [f"{s}:{n}" for s, n in SERVICES
                           if r.hget(f"{self.prefix}health:{s}:{n}", "ready") != b"1"]
                for d in DEVICES:
                    h = r.hgetall(f"{self.prefix}{{gmg}}:device:{d}")
                    if h.get(b"state") != b"ready" or time.time() - float(h.get(b"heartbeat_ts") or 0) > 2.5:
                        missing.append(f"device:{d}")
                with urllib.request.urlopen(f"{self.mesh.gateway}/health", timeout=2) as resp:
                    if resp.status != 200:
                        missing.append("gateway")
                if not missing:
                    return time.monotonic() - t0
                last = ", ".join(missing)
            except (OSError, *REDIS_ERRORS) as e:
                last = repr(e)
            time.sleep(0.25)
        raise TimeoutError(f"mesh not ready after {timeout_s:.0f} s: {last}")

    def wait_idle(self, timeout_s: float = 90) -> float:
        """No request queued, running or pending anywhere (scheduler stats, requests and worker groups)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.busy() == 0:
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError(f"mesh still busy after {timeout_s:.0f} s: {self.busy_detail()}")

    def busy_detail(self) -> dict:
        r = self.r()
        out = {}
        for t in TENANT_DEVICE:
            st = r.hgetall(tenant_stats_key(self.prefix, t))
            out[f"{t}.queued"] = int(st.get(b"queued") or 0)
            out[f"{t}.running"] = int(st.get(b"running") or 0)
        for stream, group in [(requests_stream(self.prefix), GROUP_SCHEDULER)] + \
                             [(worker_stream(self.prefix, d), GROUP_WORKER) for d in DEVICES]:
            try:
                out[f"{stream}.pending"] = int(r.xpending(stream, group)["pending"])
            except syncredis.ResponseError:
                out[f"{stream}.pending"] = 0
        return out

    def busy(self) -> int:
        try:
            return sum(self.busy_detail().values())
        except REDIS_ERRORS:
            return -1

    # ------------------------------------------------------------ logs
    def mark(self, what: str) -> float:
        now = time.time()
        self.events.append((now, what))
        return now

    def log_events(self, *names: str, since: float = 0.0) -> dict[str, int]:
        """Counts of structlog events (or substrings of raw lines) in every service log since ``since``."""
        counts = {n: 0 for n in names}
        for path in sorted((self.mesh.data_dir / "logs").glob("*.log")):
            with open(path, errors="replace") as f:
                for line in f:
                    ts = since and _line_ts(line)
                    if since and ts is not None and ts < since:
                        continue
                    for n in names:
                        if n in line:
                            counts[n] += 1
        return counts


def _line_ts(line: str) -> float | None:
    if not line.startswith("{"):
        return None
    try:
        stamp = json.loads(line).get("timestamp")
    except ValueError:
        return None
    if not stamp:
        return None
    import datetime as dt

    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
