"""Faults on the launched mesh: a worker killed mid-stream, and a clean stop with no orphan processes."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from support.mesh import start_mesh, stop_mesh

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def _stream(url: str, key: str, model: str, max_tokens: int, out: dict | None = None) -> dict:
    out = {"tokens": 0, "error": None, "done": False, "end_ts": None} if out is None else out
    body = {"model": model, "prompt": "kill test", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
                elif line.startswith(b"data: "):
                    d = json.loads(line[6:])
                    if "error" in d:
                        out["error"] = d["error"]
                    else:
                        out["tokens"] += 1
    out["end_ts"] = time.monotonic()
    return out


async def test_sigkill_worker_mid_stream_ends_requests_clearly(tmp_path):
    mesh = start_mesh(tmp_path)
    try:
        pid = mesh.pid_of("worker", "cpu0")
        assert pid and _alive(pid)
        live = [{"tokens": 0, "error": None, "done": False, "end_ts": None} for _ in range(4)]
        tasks = [asyncio.create_task(_stream(mesh.gateway, "sk-dev-tiny-a-0001", "tiny-a", 1900, o)) for o in live]
        other = asyncio.create_task(_stream(mesh.gateway, "sk-dev-tiny-b-0001", "tiny-b", 32))
        deadline = time.monotonic() + 30  # kill once every stream is decoding (a fixed sleep races a fast machine)
        while not all(o["tokens"] >= 2 for o in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not any(o["done"] or o["error"] for o in live), live
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        for r in results:
            assert r["error"] is not None, r  # a clear error, not a silent truncation
            assert r["error"]["code"] == "worker_failed"
            assert r["end_ts"] - killed <= 10.0
        assert (await other)["tokens"] > 0  # the other tenant is unaffected
        # the launcher restarts the worker and tenant tiny-a is served again
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = mesh.pid_of("worker", "cpu0")
            if new and new != pid:
                break
            await asyncio.sleep(0.5)
        r = await _stream(mesh.gateway, "sk-dev-tiny-a-0001", "tiny-a", 8)
        assert r["done"] and r["error"] is None and r["tokens"] >= 1
    finally:
        pids = mesh.service_pids()
        code = stop_mesh(mesh)
    assert code == 0
    time.sleep(0.5)
    assert pids and not [p for p in pids if _alive(p)], "orphan service processes after stop"

