"""Process launcher behind ``slicesched up``: a private Redis (or a private Redis Cluster, or ``REDIS_URL``), then
every service as its own process; waits until all report healthy and the gateway's ``/ready`` says it can serve
every tenant; restarts a crashed service with backoff; stops everything on Ctrl-C/SIGTERM (services drain first,
Redis last). Children get SIGTERM if the launcher itself dies."""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis as syncredis
from redis.exceptions import RedisClusterException

from shared.config import DEFAULT_POLICY, ClusterConfig
from shared.procutil import LocalRedisCluster, RedisServer, free_port
from shared.redis_util import is_cluster, sync_client
from shared.service import health_key


# Benchmarks that measure scheduling or prediction turn the gateway's adaptive SLA admission limit off, so that
# requests are not refused early on the gateway's own latency estimate (which would count as violations).
MEASURE_ENV = {"SLICESCHED_ADMIT_SLA_FRACTION": "0"}


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of process ``pid`` in seconds, from ``/proc/PID/stat``; None if it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    service: str
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        logf.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Launcher:
    """Starts and supervises the mesh on one machine."""

    def __init__(self, cluster: ClusterConfig, *, cluster_file: str, tenants_file: str, data_dir: Path,
                 gateway_host: str = "127.0.0.1", gateway_port: int = 8000, prefix: str = "slicesched:",
                 policy: str = DEFAULT_POLICY, redis_url: str | None = None, log_format: str = "json",
                 extra_env: dict[str, str] | None = None, out=sys.stdout, redis_cluster: int = 0) -> None:
        self.cluster, self.data_dir, self.prefix = cluster, data_dir, prefix
        self.cluster_file, self.tenants_file = cluster_file, tenants_file
        self.gateway_host = gateway_host
        self._auto_port = not gateway_port  # a free port was picked here: another one is tried if it is taken
        self.gateway_port = gateway_port or free_port(gateway_host)
        self.policy, self.log_format, self.out = policy, log_format, out
        self.redis_url = redis_url
        self.redis_server: RedisServer | None = None
        self.redis_cluster = redis_cluster  # > 0: start a private Redis Cluster with this many masters
        self.local_cluster: LocalRedisCluster | None = None
        self.cluster_mode = False
        self.children: list[Child] = []
        self.extra_env = extra_env or {}
        self._stopping = False

    @property
    def gateway_url(self) -> str:
        return f"http://{self.gateway_host}:{self.gateway_port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"REDIS_URL": self.redis_url or "", "SLICESCHED_PREFIX": self.prefix,
                    "SLICESCHED_CLUSTER": self.cluster_file, "SLICESCHED_TENANTS": self.tenants_file,
                    "SLICESCHED_LOG_FORMAT": self.log_format, "SLICESCHED_GATEWAY_HOST": self.gateway_host,
                    "SLICESCHED_GATEWAY_PORT": str(self.gateway_port), "SLICESCHED_METRICS_PORT": "0",
                    "SLICESCHED_POLICY": self.policy, "PYTHONUNBUFFERED": "1",
                    "SLICESCHED_REDIS_CLUSTER": "1" if self.cluster_mode else "0"})
        env.update(self.extra_env)
        return env

    def plan(self) -> list[Child]:
        py, env, logs = sys.executable, self._env(), self.data_dir / "logs"
        kids = [Child("gmg", "gmg", [py, "-m", "services.gmg"], env, logs / "gmg.log"),
                Child("simulator", "simulator", [py, "-m", "services.simulator"], env, logs / "simulator.log"),
                Child("scheduler", "scheduler-0", [py, "-m", "services.scheduler"], env, logs / "scheduler.log")]
        emulated = [d.id for d in self.cluster.devices if d.backend == "emulated"]
        for d in self.cluster.devices:
            if d.backend != "emulated":
                kids.append(Child("worker", d.id, [py, "-m", "services.worker", "--device", d.id], env,
                                  logs / f"worker-{d.id}.log"))
        if emulated:
            kids.append(Child("worker", "emulated", [py, "-m", "services.worker.emulated", "--devices",
                                                     ",".join(emulated)], env, logs / "worker-emulated.log"))
        kids.append(Child("gateway", "gateway", [py, "-m", "services.gateway"], env, logs / "gateway.log"))
        return kids

    # ------------------------------------------------------------ start / wait / stop
    def start(self, timeout_s: float = 180.0) -> None:
        """Start Redis (unless given) and every service, and wait until all are healthy; on any failure whatever
        was started is stopped again (no orphans) and the error raised."""
        try:
            if not self.redis_url and self.redis_cluster:
                self.local_cluster = LocalRedisCluster(self.data_dir / "redis-cluster",
                                                       masters=self.redis_cluster).start()
                self.redis_url = self.local_cluster.url
            elif not self.redis_url:
                self.redis_server = RedisServer(self.data_dir / "redis").start()
                self.redis_url = self.redis_server.url
            self.cluster_mode = is_cluster(self.redis_url)  # asked once here; the services are told
            self.children = self.plan()
            for c in self.children:
                c.start()
            for attempt in range(3):
                try:
                    self.wait_healthy(timeout_s)
                    return
                except RuntimeError:
                    gw = next(c for c in self.children if c.service == "gateway")
                    if not (self._auto_port and attempt < 2 and not gw.alive() and "address already in use" in gw.tail()):
                        raise
                    # the free port picked at construction was taken meanwhile: pick another, start the gateway again
                    self.gateway_port = free_port(self.gateway_host)
                    gw.env = self._env()
                    gw.start()
        except BaseException:
            self.stop(drain_s=2.0)
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        r = sync_client(self.redis_url, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                dead = [c for c in self.children if not c.alive()]
                if dead:
                    c = dead[0]
                    raise RuntimeError(f"service {c.name} exited with code {c.proc.returncode} during start-up; "
                                       f"last log lines ({c.log_path}):\n{c.tail()}")
                waiting = [c for c in self.children if not self._healthy(r, c)]
                if not waiting:
                    return
                time.sleep(0.2)
            names = ", ".join(c.name for c in self.children if not self._healthy(r, c))
            why = f"; gateway /ready: {self._ready_body()}" if "gateway" in names else ""
            raise RuntimeError(f"services not healthy after {timeout_s:.0f} s: {names}{why}")
        finally:
            r.close()

    def _healthy(self, r: syncredis.Redis, c: Child) -> bool:
        if c.service == "gateway":  # ready = a live worker for every tenant (the first request can succeed)
            try:
                with urllib.request.urlopen(f"{self.gateway_url}/ready", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False
        names = [c.name] if c.name != "emulated" else [d.id for d in self.cluster.devices if d.backend == "emulated"]
        for n in names:
            try:
                ready, pid = r.hmget(health_key(self.prefix, c.service, n), "ready", "pid")
            except (syncredis.RedisError, RedisClusterException):
                return False
            # the key must be this child's: one left by a killed earlier run lives on for its TTL
            if ready != b"1" or c.proc is None or pid != str(c.proc.pid).encode():
                return False
        return True

    def _ready_body(self) -> str:
        """The gateway's ``/ready`` answer (which tenants cannot be served, and why), for error messages."""
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/ready", timeout=2) as resp:
                return resp.read(2000).decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.read(2000).decode(errors="replace")
        except OSError as e:
            return f"unreachable ({e})"

    def supervise_once(self) -> None:
        """Restart services that died (at most 5 times a minute each)."""
        for c in self.children:
            if self._stopping or c.alive():
                continue
            now = time.time()
            c.restarts = [t for t in c.restarts if now - t < 60]
            if len(c.restarts) >= 5:
                continue
            c.restarts.append(now)
            print(f"slicesched: {c.name} exited with code {c.proc.returncode if c.proc else '?'}; restarting",
                  file=sys.stderr, flush=True)
            c.start()

    def stop(self, drain_s: float = 20.0) -> None:
        self._stopping = True
        order = [c for c in self.children if c.service == "gateway"] + \
                [c for c in self.children if c.service == "worker"] + \
                [c for c in self.children if c.service not in ("gateway", "worker")]
        for group in (order[:1], order[1:]):
            for c in group:
                if c.alive():
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + drain_s
            for c in group:
                if c.proc is None:
                    continue
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(timeout=5)
        if self.redis_server is not None:
            self.redis_server.stop()
        if self.local_cluster is not None:
            self.local_cluster.stop()

    def cpu_seconds(self, client: bool = False) -> dict[str, float]:
        """CPU time (user + system, all threads) each running service and the private Redis have used so far, by
        name; empty where ``/proc`` is not readable (not Linux). Differences of two readings give a window's use.
        ``client``: also this process (where a bench runs its load generator), as ``client``."""
        procs = [(c.name, c.proc) for c in self.children if c.proc is not None]
        if self.redis_server is not None and self.redis_server.proc is not None:
            procs.append(("redis", self.redis_server.proc))
        for i, n in enumerate(self.local_cluster.nodes if self.local_cluster is not None else []):
            if n.proc is not None:
                procs.append((f"redis{i}", n.proc))
        out = {}
        for name, proc in procs:
            cpu = process_cpu_s(proc.pid)
            if cpu is not None:
                out[name] = cpu
        if client and out:
            r = resource.getrusage(resource.RUSAGE_SELF)
            out["client"] = r.ru_utime + r.ru_stime
        return out

    def _redis_kind(self) -> str:
        if self.local_cluster is not None:
            return f" (Redis Cluster: {self.local_cluster.masters} masters + {self.local_cluster.replicas} replica each)"
        return " (Redis Cluster)" if self.cluster_mode else ""

    def banner(self, dev_keys: dict[str, list[str]], models: dict[str, str] | None = None) -> str:
        lines = [f"SliceScheduler is up: gateway {self.gateway_url}  (Ctrl-C stops everything)",
                 f"  redis: {self.redis_url}{self._redis_kind()}  prefix: {self.prefix}  policy: {self.policy}",
                 f"  logs:  {self.data_dir / 'logs'}"]
        for t, keys in dev_keys.items():
            for k in keys:
                served = f" serves {models[t]}" if models and t in models else ""
                lines.append(f"  tenant {t}:{served} as model {t!r}, dev API key {k}")
        lines.append(f"  try: curl -s {self.gateway_url}/v1/completions -H 'Authorization: Bearer "
                     f"{next(iter(next(iter(dev_keys.values()), [''])), '')}' -H 'Content-Type: application/json' "
                     f"-d '{{\"model\": \"{next(iter(dev_keys), '')}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
        lines.append(f"SLICESCHED_READY gateway={self.gateway_url} redis={self.redis_url}")
        return "\n".join(lines)
