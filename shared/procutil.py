"""Process helpers shared by the launcher, benchmarks and tests: free ports, a private redis-server, a private
Redis Cluster (masters with one replica each)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


@dataclass
class RedisServer:
    """A private ``redis-server`` on a free loopback port, with AOF in ``data_dir`` (DESIGN §8)."""

    data_dir: Path
    port: int = 0
    appendonly: bool = True
    appendfsync: str = "everysec"
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()  # e.g. the cluster options
    wrap: tuple[str, ...] = ()  # a command prefix, e.g. ("ip", "netns", "exec", "ns0") to run it in a namespace
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install -y redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        # protected mode refuses every non-loopback client without a password: only on loopback (a private test
        # network of namespaces binds another address, where no one else is)
        protected = "yes" if self.host in ("127.0.0.1", "::1", "localhost") else "no"
        args = [*self.wrap, exe, "--port", str(self.port), "--bind", self.host, "--protected-mode", protected,
                "--dir", str(self.data_dir), "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
                "--logfile", str(self.data_dir / "redis.log"), *self.extra_args]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if not self._wait_up(timeout_s):
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}; see {self.data_dir / 'redis.log'}")
        return self

    def _wait_up(self, timeout_s: float) -> bool:
        if not self.wrap:
            return wait_port(self.host, self.port, timeout_s)
        deadline = time.monotonic() + timeout_s  # in another namespace: ask redis-cli there
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.cli("PING", check=False).strip() == "PONG":
                return True
            time.sleep(0.05)
        return False

    def cli(self, *args: str, check: bool = True) -> str:
        """Run ``redis-cli`` against this server (in its namespace, if any); its output."""
        out = subprocess.run([*self.wrap, "redis-cli", "-h", self.host, "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout

    def stop(self, timeout_s: float = 5.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)  # redis-server flushes the AOF and exits on SIGTERM
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


@dataclass
class LocalRedisCluster:
    """A private Redis Cluster: ``masters`` (at least 3) masters with ``replicas`` replicas each, one
    ``redis-server --cluster-enabled yes`` per node on free ports of ``host``, each with its own directory under
    ``data_dir`` (AOF as :class:`RedisServer`), joined by ``redis-cli --cluster create``. A master that fails for
    ``node_timeout_ms`` is replaced by its replica; slots of other masters stay served meanwhile
    (``cluster-require-full-coverage no``)."""

    data_dir: Path
    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 2000
    appendonly: bool = True
    appendfsync: str = "everysec"
    host: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A node's URL: the cluster clients find the others from it."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 60.0) -> "LocalRedisCluster":
        if self.masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, not {self.masters}")
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli not found on PATH (apt-get install -y redis-tools)")
        opts = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
                "--repl-diskless-sync-delay", "0")  # a replica syncs at once (default: waits 5 s for others)
        try:
            for i in range(self.masters * (1 + self.replicas)):
                bus = ("--cluster-port", str(free_port()))  # not port + 10000, which may be taken or too high
                self.nodes.append(RedisServer(self.data_dir / f"node{i}", appendonly=self.appendonly,
                                              appendfsync=self.appendfsync, host=self.host, extra_args=opts + bus,
                                              wrap=self.wrap).start())
            addrs = [f"{n.host}:{n.port}" for n in self.nodes]
            self.nodes[0].cli("--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                              "--cluster-yes")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:ok`` and ``CLUSTER SLOTS`` lists every running node
        (it lists a replica only once it has synced; each master here serves one slot range)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            ids = [x for x in live[0].cli("CLUSTER", "SLOTS", check=False).split()
                   if len(x) == 40 and all(c in "0123456789abcdef" for c in x)] if live else []
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in live) and \
                    len(set(ids)) == len(live):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster in {self.data_dir} not ok after {timeout_s:.0f} s")
            time.sleep(0.1)

    def node_at(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _live(self) -> RedisServer:
        return next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)

    def _table(self) -> list[list[str]]:
        """``CLUSTER NODES`` as seen by a running node, one split line per node."""
        return [line.split() for line in self._live().cli("CLUSTER", "NODES").splitlines() if line.strip()]

    def _port(self, row: list[str]) -> int:
        return int(row[1].split("@")[0].rsplit(":", 1)[1])

    def master_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot now (asked of a running node)."""
        return self.master_of_slot(int(self._live().cli("CLUSTER", "KEYSLOT", key).strip()))

    def master_of_slot(self, slot: int) -> RedisServer:
        for row in self._table():
            if "master" not in row[2] or "fail" in row[2]:
                continue
            for rng in row[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return self.node_at(self._port(row))
        raise RuntimeError(f"no master serves slot {slot}")

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        rows = self._table()
        mid = next(r[0] for r in rows if self._port(r) == master.port)
        return [self.node_at(self._port(r)) for r in rows if r[3] == mid and "fail" not in r[2]]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
