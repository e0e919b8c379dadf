"""The gateway as a process (``python -m services.gateway``): config errors, loopback bind, logs, SIGTERM drain;
and draining in-process: in-flight requests finish, new ones get 503."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gateway_harness import KEY_A, Responder, make_gateway

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
TENANTS_YAML = """tenants:
  - name: pa
    model: {preset: tiny}
    sla: {ttft_ms: 2000, tpot_ms: 100}
    home_devices: [cpu0]
    api_keys: ["sk-process-test-0001"]
"""


def _env(tmp_path: Path, redis_url: str, prefix: str, **extra) -> dict:
    (tmp_path / "tenants.yaml").write_text(TENANTS_YAML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLICESCHED_")}
    env.update(REDIS_URL=redis_url, SLICESCHED_PREFIX=prefix, SLICESCHED_TENANTS=str(tmp_path / "tenants.yaml"),
               SLICESCHED_GATEWAY_PORT="0", SLICESCHED_LOG_FORMAT="json", SLICESCHED_DRAIN_S="2")
    env.update(extra)
    return env


def _listening_address(port: int) -> str | None:
    """Local address of the TCP socket listening on ``port``, from /proc/net/tcp (state 0A = LISTEN)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            return ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return None


@pytest.mark.parametrize("override, needle", [
    ({"SLICESCHED_TENANTS": "/nonexistent/tenants.yaml"}, "/nonexistent/tenants.yaml"),
    ({"REDIS_URL": ""}, "REDIS_URL"),
    ({"SLICESCHED_MAX_BODY_BYTES": "lots"}, "SLICESCHED_MAX_BODY_BYTES"),
    ({"SLICESCHED_REQUEST_IDLE_TIMEOUT_S": "-1"}, "SLICESCHED_REQUEST_IDLE_TIMEOUT_S"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, redis_url, prefix, override, needle):
    env = _env(tmp_path, redis_url, prefix, **override)
    p = subprocess.run([sys.executable, "-m", "services.gateway"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr


async def test_process_serves_on_loopback_logs_json_and_stops_on_sigterm(tmp_path, redis_url, prefix):
    env = _env(tmp_path, redis_url, prefix)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.gateway", cwd=REPO, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    lines = []
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            raw = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
            assert raw, "gateway exited early"
            ev = json.loads(raw)
            lines.append(ev)
            if ev["event"] == "gateway_listening":
                port, host = ev["port"], ev["host"]
        assert host == "127.0.0.1" and _listening_address(port) == "127.0.0.1"
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            for _ in range(50):  # ready once the first heartbeat reached Redis
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert r.status == 200
            async with s.get(url + "/v1/models", headers={"Authorization": "Bearer sk-process-test-0001"}) as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "pa"
            async with s.post(url + "/v1/completions", json={"model": "zz", "prompt": "x"},
                              headers={"Authorization": "Bearer sk-process-test-0001"}) as r:
                assert r.status == 404
                rid = r.headers["X-Request-Id"]
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), timeout=15)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines += [json.loads(ln) for ln in rest.decode().splitlines() if ln.strip()]
    assert all(ev["service"] == "gateway" for ev in lines)
    rejected = [ev for ev in lines if ev.get("request_id") == rid]
    assert rejected and rejected[0]["event"] == "request_rejected" and rejected[0]["tenant"] == "pa"
    assert any(ev["event"] == "gateway_stopped" for ev in lines)


async def test_drain_finishes_inflight_and_refuses_new(redis, redis_url, prefix):
    svc = make_gateway(redis_url, prefix, drain_s=5.0)
    await svc.start()
    responder, stop = Responder(redis_url, prefix), asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    url = f"http://127.0.0.1:{svc.port}"
    hdr = {"Authorization": f"Bearer {KEY_A}"}
    try:
        async with aiohttp.ClientSession() as s:
            async def slow():
                async with s.post(url + "/v1/completions", headers=hdr,
                                  json={"model": "ta", "prompt": "SLOW", "max_tokens": 10}) as r:
                    return r.status, await r.json()

            inflight = asyncio.create_task(slow())
            while svc.admission.total_inflight < 1:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(svc.stop())
            await asyncio.sleep(0.05)
            async with s.post(url + "/v1/completions", headers=hdr, json={"model": "ta", "prompt": "x"}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
                assert r.headers["Retry-After"]
            async with s.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            st, body = await inflight
            assert st == 200 and body["choices"][0]["text"] == "abcdefghij"
            await asyncio.wait_for(stopping, timeout=5)
    finally:
        stop.set()
        await svc.stop()
        await task
