"""``slicesched inspect`` against the launched mesh (``slicesched up``): every view's ``--json`` after real traffic."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from services.cli.main import main
from support.mesh import REPO

pytestmark = pytest.mark.e2e

KEYS = {"tiny-a": "sk-dev-tiny-a-0001", "tiny-b": "sk-dev-tiny-b-0001"}


def inspect(mesh, capsys, *argv: str) -> tuple[int, dict | None, str]:
    """Run the CLI in this process (one interpreter start for all views) and parse its JSON."""
    capsys.readouterr()
    rc = main(["inspect", "--redis-url", mesh.redis_url, "--prefix", mesh.prefix, *argv, "--json"])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


async def _complete(url: str, tenant: str, i: int) -> str:
    body = {"model": tenant, "prompt": f"inspect me {i}", "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Request-Id"]


async def test_every_view_after_real_traffic(mesh, capsys):
    rids = await asyncio.gather(*(_complete(mesh.gateway, t, i) for i in range(2) for t in KEYS))
    rc, dev, err = inspect(mesh, capsys, "devices")
    assert rc == 0, err
    by_id = {d["id"]: d for d in dev["devices"]}
    assert set(by_id) == {"cpu0", "cpu1"}
    for d, tenant in (("cpu0", "tiny-a"), ("cpu1", "tiny-b")):
        row = by_id[d]
        assert row["state"] == "ready" and row["home_tenant"] == tenant and row["heartbeat_age_s"] < 10
        assert row["memory"]["reserved_bytes"] >= row["memory"]["weights_used_bytes"] > 0
        assert row["resident"] and {x["tenant"] for x in row["resident"]} == {tenant}
        assert row["exec"]["finished_total"] >= 2

    rc, ten, err = inspect(mesh, capsys, "tenants")
    assert rc == 0, err
    names = {t["name"]: t for t in ten["tenants"]}
    assert set(names) == {"tiny-a", "tiny-b"}
    assert ten["gateways_scraped"] == 1
    for t in names.values():
        assert t["requests"].get("ok", 0) >= 2 and t["sla_source"] == "gateway_metrics"
        assert 0.0 <= t["sla_attainment"] <= 1.0 and t["sla"]["ttft_ms"] > 0 and t["queued"] is not None

    rc, st, err = inspect(mesh, capsys, "streams")
    assert rc == 0, err
    streams = {s["name"]: s for s in st["streams"]}
    p = mesh.prefix
    assert {g["name"] for g in streams[f"{p}requests"]["groups"]} == {"scheduler"}
    assert {g["name"] for g in streams[f"{p}events"]["groups"]} >= {"gmg", "scheduler"}
    for d in ("cpu0", "cpu1"):
        assert [g["name"] for g in streams[f"{p}worker:{d}"]["groups"]] == ["worker"]
    assert any(n.startswith(f"{p}tokens:") for n in streams)
    assert st["dead_letters"]["count"] == 0

    rc, leases, err = inspect(mesh, capsys, "leases")
    assert rc == 0 and leases["leases"] == [], err
    rc, fc, err = inspect(mesh, capsys, "forecasts")
    assert rc == 0 and isinstance(fc["forecasts"], list), err

    deadline = time.monotonic() + 15
    while True:  # the scheduler records "done" when the worker's RequestFinished event arrives
        rc, doc, err = inspect(mesh, capsys, "request", rids[0])
        assert rc == 0, err
        if doc["state"] == "done" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert doc["state"] == "done" and doc["timeline"][-1]["event"] == "done"
    assert [e["event"] for e in doc["timeline"]][:3] == ["queued", "assigned", "running"]
    assert doc["devices"] and doc["devices"][0]["status"] == "finished"
    # the installed entry point: an unknown id is one line on stderr and exit code 1
    p = subprocess.run([sys.executable, "-m", "services.cli.main", "inspect", "--prefix", mesh.prefix, "request",
                        "no-such-request"], cwd=REPO, env=dict(os.environ, REDIS_URL=mesh.redis_url),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "no-such-request" in p.stderr, p.stderr
