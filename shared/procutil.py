"""Process helpers shared by the launcher, benchmarks and tests: free ports, a private redis-server."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
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
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install -y redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
                "--dir", str(self.data_dir), "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
                "--logfile", str(self.data_dir / "redis.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if not wait_port("127.0.0.1", self.port, timeout_s):
            self.stop()
            raise RuntimeError(f"redis-server did not start on port {self.port}; see {self.data_dir / 'redis.log'}")
        return self

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
