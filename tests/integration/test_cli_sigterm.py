"""A bench killed with SIGTERM (a CI timeout, ``kill``) stops the private redis-server and the service it started
instead of leaving them running: the ``slicesched`` command unwinds on SIGTERM like on Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:  # the parent pid
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigterm_stops_the_benchs_private_redis(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "bench", "whatif", "--queries", "1000000",
                             "--warmup", "0"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        redis_pid, deadline = None, time.monotonic() + 60
        while redis_pid is None and time.monotonic() < deadline:
            for child in _children(proc.pid):
                try:
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
                except FileNotFoundError:
                    continue
                if b"redis-server" in cmd:  # redis rewrites its title to "redis-server HOST:PORT"
                    redis_pid = child
            time.sleep(0.1)
        if redis_pid is None:
            kids = {k: Path(f"/proc/{k}/cmdline").read_bytes()[:80] for k in _children(proc.pid)}
            status = Path(f"/proc/{proc.pid}/status").read_text()[:300]
            proc.kill()
            pytest.fail(f"the bench never started its redis-server (children {kids}, {status}, exit {proc.wait()}): "
                        f"{proc.stderr.read()[-2000:]}")
        deadline = time.monotonic() + 60  # well into the run: the simulator service is up too (slow on a busy machine)
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # queries are flowing
        started = _children(proc.pid)
        assert len(started) >= 2, started  # redis-server and the simulator service
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)], "processes the bench started outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _children(proc.pid) + ([redis_pid] if redis_pid else []):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
