"""Three gateway replicas, one tenant offered twice its token quota: the rate the replicas accept together stays
within 10% of the quota (with per-instance counting it would be up to 3x). Slow (two quota windows, about 2.5 min):

    .venv/bin/pytest -m slow tests/e2e/test_gateway_replicas_quota.py -s

The mesh is ``slicesched up`` (one gateway) plus two more gateway processes on the same Redis; the client sends
round robin to the three. Figures go to ``$SLICESCHED_DATA_DIR/gateway-replicas-quota.json`` (default .data/).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import yaml

from shared.config import hash_api_key
from shared.procutil import free_port
from support.mesh import REPO, start_mesh, stop_mesh

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

KEY = f"sk-quota-{uuid.uuid4().hex}"
QUOTA_TPM = 3000
MAX_TOKENS = 8
PROMPT_TOKENS = 13  # BOS + "quota 000123" (byte tokenizer)
COST = PROMPT_TOKENS + MAX_TOKENS
OFFERED = 2.0  # times the quota
WINDOWS = 2  # measured over whole quota windows (60 s each): the sliding window then admits exactly its quota
REPLICAS = 3


def _tenants(path: Path) -> None:
    base = {"model": {"preset": "tiny"}, "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "max_queue": 256}
    path.write_text(yaml.safe_dump({"tenants": [
        base | {"name": "tiny-a", "model": {"preset": "tiny", "seed": 1}, "home_devices": ["cpu0"],
                "api_key_hashes": [hash_api_key(KEY)], "quota": {"tokens_per_min": QUOTA_TPM}},
        base | {"name": "tiny-b", "model": {"preset": "tiny", "seed": 2}, "home_devices": ["cpu1"],
                "api_key_hashes": []}]}))


def _extra_gateway(mesh, conf: Path, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, REDIS_URL=mesh.redis_url, SLICESCHED_PREFIX=mesh.prefix, SLICESCHED_TENANTS=str(conf),
               SLICESCHED_GATEWAY_PORT=str(port), SLICESCHED_ADMIT_SLA_FRACTION="0", SLICESCHED_LOG_FORMAT="json",
               SLICESCHED_METRICS_PORT="0")
    out = open(logs / f"gateway-{port}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], cwd=REPO, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"extra gateway on {port} did not start")


async def _drive(urls: list[str], duration_s: float, rate_rps: float) -> list[tuple[float, str, int]]:
    """Open loop: request i at i / rate, to gateway i % 3; (send time from start, gateway, status)."""
    out: list[tuple[float, str, int]] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int) -> None:
            url = urls[i % len(urls)]
            sent = time.monotonic() - t0
            body = {"model": "tiny-a", "prompt": f"quota {i:06d}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
            try:
                async with s.post(f"{url}/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
                    await r.read()
                    out.append((sent, url, r.status))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                out.append((sent, url, -1))

        tasks, i = [], 0
        while (due := i / rate_rps) < duration_s:
            await asyncio.sleep(max(0.0, due - (time.monotonic() - t0)))
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
    return out


async def test_three_replicas_accept_the_tenants_quota_not_three_times_it(tmp_path):
    conf = tmp_path / "tenants.yaml"
    _tenants(conf)
    mesh = await asyncio.to_thread(start_mesh, tmp_path / "mesh", extra_args=["--tenants", str(conf)],
                                   env={"SLICESCHED_ADMIT_SLA_FRACTION": "0"})
    extra = []
    try:
        for _ in range(REPLICAS - 1):
            extra.append(await asyncio.to_thread(_extra_gateway, mesh, conf, tmp_path / "mesh" / "logs"))
        urls = [mesh.gateway] + [u for _, u in extra]
        duration = 60.0 * WINDOWS
        rate = OFFERED * QUOTA_TPM / COST / 60.0
        calls = await _drive(urls, duration, rate)
    finally:
        for p, _ in extra:
            p.terminate()
        for p, _ in extra:
            p.wait(timeout=30)
        await asyncio.to_thread(stop_mesh, mesh)
    ok = [c for c in calls if c[2] == 200]
    statuses = Counter(c[2] for c in calls)
    accepted_tpm = len(ok) * COST / WINDOWS
    per_window = [sum(COST for t, _, st in ok if st == 200 and w * 60 <= t < (w + 1) * 60) for w in range(WINDOWS)]
    figures = {"replicas": REPLICAS, "quota_tokens_per_min": QUOTA_TPM, "offered_x_quota": OFFERED,
               "request_cost_tokens": COST, "duration_s": duration, "offered_requests": len(calls),
               "accepted_requests": len(ok), "accepted_tokens_per_min": accepted_tpm,
               "accepted_over_quota": round(accepted_tpm / QUOTA_TPM, 3), "accepted_tokens_per_window": per_window,
               "accepted_per_gateway": [sum(1 for _, u, st in ok if u == url) for url in urls],
               "statuses": {str(k): v for k, v in sorted(statuses.items())},
               "per_instance_counting_would_allow_tokens_per_min": REPLICAS * QUOTA_TPM,
               "date": time.strftime("%Y-%m-%d", time.gmtime())}
    out = Path(os.environ.get("SLICESCHED_DATA_DIR", REPO / ".data")) / "gateway-replicas-quota.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    assert set(statuses) <= {200, 429}, statuses  # nothing but accepted or refused by the quota
    assert abs(accepted_tpm / QUOTA_TPM - 1.0) <= 0.10, figures
    assert all(n > 0 for n in figures["accepted_per_gateway"]), figures  # every replica took its share
