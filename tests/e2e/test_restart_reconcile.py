"""Restarts of the launched mesh (``slicesched up``) on one private Redis data dir reconcile with the config. One
flow of three starts (each start costs tens of seconds here, so the phases share them): a second start with a
changed cluster and tenants file shows only what is configured (no ghost tenant, device, residency or reservation);
a third start after a SIGKILL of the whole mesh under load ends every in-flight request and drops what is no
longer configured; dead gateways' and removed devices' streams expire; after every start the first request sent
once the launcher reports ready succeeds."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from services.cli.main import main as cli_main
from shared.requests_state import TERMINAL_STATES
from support.mesh import start_mesh, stop_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # three mesh starts: past the suite's 120 s default

EXPIRY = {"SLICESCHED_STREAM_EXPIRY_S": "2"}


def _cluster(tmp: Path, name: str, ids: list[str]) -> str:
    f = tmp / name
    f.write_text(yaml.safe_dump({"devices": [{"id": d, "backend": "cpu", "kind": "cpu", "memory_gb": 0.25,
                                              "threads": 1} for d in ids]}))
    return str(f)


def _tenants(tmp: Path, name: str, specs: list[tuple[str, dict, str]]) -> str:
    f = tmp / name
    f.write_text(yaml.safe_dump({"tenants": [
        {"name": n, "model": m, "sla": {"ttft_ms": 5000, "tpot_ms": 500}, "home_devices": [d],
         "api_keys": [f"sk-test-{n}-000001"]} for n, m, d in specs]}))
    return str(f)


def _key(tenant: str) -> str:
    return f"sk-test-{tenant}-000001"


async def _complete(url: str, tenant: str, max_tokens: int = 4) -> tuple[int, dict]:
    body = {"model": tenant, "prompt": "restart", "max_tokens": max_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(f"{url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {_key(tenant)}"}) as r:
            return r.status, await r.json()


async def _stream(url: str, tenant: str, out: dict) -> None:
    body = {"model": tenant, "prompt": "in flight", "max_tokens": 1900, "stream": True, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(f"{url}/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {_key(tenant)}"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        out["tokens"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        out["cut"] = True  # the mesh was killed under it


def _inspect(mesh, capsys, view: str) -> dict:
    capsys.readouterr()
    assert cli_main(["inspect", "--redis-url", mesh.redis_url, "--prefix", mesh.prefix, view, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _first_requests_succeed(mesh, tenants: list[str]) -> None:
    """Sent right after the launcher printed its banner: every configured tenant answers."""
    for status, body in asyncio.run(_all(mesh.gateway, tenants)):
        assert status == 200, body
        assert body["usage"]["completion_tokens"] >= 1


async def _all(url: str, tenants: list[str]) -> list:
    return await asyncio.gather(*(_complete(url, t) for t in tenants))


def _only_configured(mesh, capsys, tenants: dict[str, str]) -> None:
    """``inspect`` shows exactly the configured tenants and devices; each device holds only its home tenant's
    weights, and its reservations are that tenant's weights, sized as the worker measures them."""
    assert {t["name"] for t in _inspect(mesh, capsys, "tenants")["tenants"]} == set(tenants)
    homes = {d: t for t, d in tenants.items()}
    deadline = time.monotonic() + 20  # the first requests' KV is released when their RequestFinished is seen
    while True:
        devices = {d["id"]: d for d in _inspect(mesh, capsys, "devices")["devices"]}
        kinds = {d: row["reservations"]["bytes_by_kind"] for d, row in devices.items()}
        if all(set(k) == {"weights"} for k in kinds.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(devices) == set(homes)
    for d, row in devices.items():
        assert row["home_tenant"] == homes[d] and row["state"] == "ready"
        assert {x["tenant"] for x in row["resident"]} == {homes[d]}, row["resident"]
        assert kinds[d] == {"weights": row["memory"]["weights_used_bytes"]}, (d, kinds[d], row["memory"])
        assert row["memory"]["reserved_bytes"] == row["memory"]["weights_used_bytes"]
        assert row["reservations"]["count"] == 1


def _reconciled(data: Path) -> list[dict]:
    """The GMG's ``gmg_reconciled`` log lines (what each start removed)."""
    lines = (data / "logs" / "gmg.log").read_text().splitlines()
    return [d for d in (json.loads(x) for x in lines if x.startswith("{")) if d.get("event") == "gmg_reconciled"]


def _keys(r, pattern: str) -> set[str]:
    return {k.decode() for k in r.scan_iter(match=pattern, count=1000)}


def _sigkill_everything(mesh) -> None:
    """SIGKILL every process of the mesh at once: services, the private redis-server, then the launcher."""
    r = mesh.redis()
    redis_pid = int(r.info("server")["process_id"])
    pids = mesh.service_pids()
    assert len(pids) >= 6
    for pid in [*pids, redis_pid, mesh.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    mesh.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
              for p in [*pids, redis_pid]) and time.monotonic() < deadline:
        time.sleep(0.1)


def _kill_under_load(mesh) -> tuple[set[str], set[str]]:
    """Six long generations (three per tenant) decoding, then a SIGKILL of the whole mesh; returns the ids of the
    gateways that died with it and the journeys (``req:`` keys) of the requests in flight."""
    r = mesh.redis()
    gateways = {k.decode().rsplit(":", 1)[-1] for k in r.scan_iter(match=f"{mesh.prefix}health:gateway:*")}
    assert len(gateways) == 1

    inflight: set[str] = set()

    async def load() -> list[dict]:
        outs = [{"tokens": 0, "cut": False} for _ in range(6)]
        tasks = [asyncio.create_task(_stream(mesh.gateway, ("m", "nu")[i % 2], o)) for i, o in enumerate(outs)]
        deadline = time.monotonic() + 60
        while not all(o["tokens"] >= 2 for o in outs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(o["tokens"] >= 2 for o in outs), outs
        inflight.update(k for k in _keys(r, f"{mesh.prefix}req:*") if r.hget(k, "state") not in (b"done",))
        _sigkill_everything(mesh)
        await asyncio.gather(*tasks)
        return outs

    assert all(o["cut"] for o in asyncio.run(load()))
    assert len(inflight) == 6, inflight
    return gateways, inflight


def test_restarts_follow_the_config(tmp_path, capsys):
    data = tmp_path / "data"
    # 1. the scenario, first start: three tenants on three devices
    c1 = _cluster(tmp_path, "c1.yaml", ["cpu0", "cpu1", "cpu2"])
    t1 = _tenants(tmp_path, "t1.yaml", [("m", {"preset": "tiny-2l", "seed": 1}, "cpu0"),
                                        ("m2", {"preset": "tiny-2l", "seed": 2}, "cpu1"),
                                        ("old", {"preset": "tiny-2l", "seed": 3}, "cpu2")])
    mesh = start_mesh(data, extra_args=["--cluster", c1, "--tenants", t1], env=EXPIRY)
    try:
        _first_requests_succeed(mesh, ["m", "m2", "old"])
    finally:
        assert stop_mesh(mesh) == 0

    # 2. stopped, started again with another cluster and tenants file: a tenant and a device removed, a tenant
    # added, a tenant's model changed; then killed (SIGKILL, every process) under load
    c2 = _cluster(tmp_path, "c2.yaml", ["cpu0", "cpu1"])
    t2 = _tenants(tmp_path, "t2.yaml", [("m", {"preset": "tiny", "seed": 1}, "cpu0"),  # another model
                                        ("nu", {"preset": "tiny", "seed": 4}, "cpu1")])
    mesh = start_mesh(data, extra_args=["--cluster", c2, "--tenants", t2], env=EXPIRY)
    try:
        _first_requests_succeed(mesh, ["m", "nu"])
        _only_configured(mesh, capsys, {"m": "cpu0", "nu": "cpu1"})
        done = _reconciled(data)[-1]
        assert (done["removed_tenants"], done["removed_devices"], done["changed_models"]) == ("m2,old", "cpu2", "m")
        r, p = mesh.redis(), mesh.prefix
        for t in ("m2", "old"):
            assert not r.exists(f"{p}{{gmg}}:tenant:{t}", f"{p}{{gmg}}:model:{t}:graph", f"{p}sched:tenant:{t}")
        assert not {f.decode() for f in r.hkeys(f"{p}sim:rates")} & {"m2", "old"}
        deadline = time.monotonic() + 15  # cpu2's worker stream goes once its expiry passes
        while _keys(r, f"{p}*cpu2*") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _keys(r, f"{p}*cpu2*")
        dead_gateways, killed = _kill_under_load(mesh)
    finally:
        if mesh.proc.poll() is None:
            stop_mesh(mesh)

    # 3. after the SIGKILL, started with nu removed and c added
    t3 = _tenants(tmp_path, "t3.yaml", [("m", {"preset": "tiny", "seed": 1}, "cpu0"), ("c", "tiny", "cpu1")])
    mesh = start_mesh(data, extra_args=["--cluster", c2, "--tenants", t3], env=EXPIRY)
    try:
        _first_requests_succeed(mesh, ["m", "c"])
        r, p = mesh.redis(), mesh.prefix
        deadline = time.monotonic() + 30  # every request of the killed mesh ends (RELIABILITY.md: none hangs)
        while time.monotonic() < deadline:
            states = {k: (r.hget(k, "state") or b"").decode() for k in killed}
            if all(st in TERMINAL_STATES for st in states.values()):
                break
            time.sleep(0.5)
        assert all(st in TERMINAL_STATES for st in states.values()), states
        removed = {st for k, st in states.items() if r.hget(k, "tenant") == b"nu"}
        assert removed and removed <= {"failed", "rejected"}, states  # the removed tenant's requests end in errors
        assert _reconciled(data)[-1]["removed_tenants"] == "nu"
        deadline = time.monotonic() + 15  # a request ends (terminal state) before the scheduler sees its finish
        while any(r.scard(k) for k in _keys(r, f"{p}sched:assigned:*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(not r.scard(k) for k in _keys(r, f"{p}sched:assigned:*"))
        _only_configured(mesh, capsys, {"m": "cpu0", "c": "cpu1"})
        deadline = time.monotonic() + 15  # the killed gateway's tokens stream expires (heartbeat-based)
        while time.monotonic() < deadline:
            streams = _keys(r, f"{p}tokens:*")
            if not any(st.endswith(g) for st in streams for g in dead_gateways):
                break
            time.sleep(0.5)
        live = {k.decode().rsplit(":", 1)[-1] for k in r.scan_iter(match=f"{p}health:gateway:*")}
        assert streams <= {f"{p}tokens:{g}" for g in live}, (streams, live)
    finally:
        assert stop_mesh(mesh) == 0
