"""Exposure at the default config (RELIABILITY row 21) and key hygiene in the logs, on a mesh started exactly like
``make up`` (default cluster.yaml and tenants.yaml with their plain-text dev keys).

Every listening TCP socket and bound UDP socket of the launcher's process tree (Redis and every service) must be on
loopback, read from /proc/net/{tcp,tcp6,udp,udp6} and each process's open sockets; Redis must run with
protected-mode on and bind only loopback addresses. The dev keys, used for requests, must appear in no file the
run writes (service logs, Redis log and AOF).
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from shared.config import REPO_CONFIGS, dev_api_keys

pytestmark = pytest.mark.e2e

LISTEN = "0A"


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack += children.get(pid, [])
    return seen


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _addr(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_ip)
    # the kernel prints each 32-bit word in host (little-endian) order
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _is_loopback(ip) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _bound_sockets() -> dict[str, tuple[str, object, int]]:
    """inode -> (table, address, port) for TCP listeners and bound UDP sockets in this network namespace."""
    out = {}
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            hex_ip, hex_port = local.split(":")
            port = int(hex_port, 16)
            if (table.startswith("tcp") and state == LISTEN) or (table.startswith("udp") and port):
                out[inode] = (table, _addr(hex_ip), port)
    return out


def test_helpers_decode_kernel_addresses():
    assert str(_addr("0100007F")) == "127.0.0.1" and str(_addr("00000000")) == "0.0.0.0"
    assert _is_loopback(_addr("00000000000000000000000001000000"))  # ::1
    assert _is_loopback(_addr("0000000000000000FFFF00000100007F"))  # ::ffff:127.0.0.1
    assert not _is_loopback(_addr("00000000000000000000000000000000"))  # ::


def test_every_listener_of_the_mesh_is_on_loopback(mesh):
    pids = _descendants(mesh.proc.pid)
    assert set(mesh.service_pids()) <= pids  # every service is in the launcher's tree
    sockets = _bound_sockets()
    mine = {(pid, inode): sockets[inode] for pid in pids for inode in _socket_inodes(pid) if inode in sockets}
    exposed = [(pid, t, str(ip), port) for (pid, _), (t, ip, port) in mine.items() if not _is_loopback(ip)]
    assert exposed == []
    ports = {port for (_t, _ip, port) in mine.values()}
    assert urlsplit(mesh.gateway).port in ports and urlsplit(mesh.redis_url).port in ports
    r = mesh.redis()
    metrics_ports = {int(r.hget(k, "port") or 0) for k in r.scan_iter(match=f"{mesh.prefix}health:*")} - {0}
    assert metrics_ports and metrics_ports <= ports  # each service's /metrics + /health endpoint was seen


def test_redis_runs_protected_on_loopback(mesh):
    r = mesh.redis()
    assert r.config_get("protected-mode")["protected-mode"] == "yes"
    binds = r.config_get("bind")["bind"].split()
    assert binds and all(_is_loopback(ipaddress.ip_address(b.lstrip("-"))) for b in binds)


async def test_dev_keys_never_reach_a_file_of_the_run(mesh):
    keys = dev_api_keys(REPO_CONFIGS / "tenants-tiny.yaml")
    assert keys["tiny-a"] and keys["tiny-b"]
    async with aiohttp.ClientSession() as s:
        for tenant, tk in keys.items():
            for model in ("tiny-a", "tiny-b"):  # own model (200) and the other tenant's (403)
                body = {"model": model, "prompt": "key hygiene", "max_tokens": 2}
                async with s.post(f"{mesh.gateway}/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {tk[0]}"}) as resp:
                    assert resp.status == (200 if model == tenant else 403)
    logs = mesh.data_dir / "logs"
    assert any(p.stat().st_size for p in logs.glob("*.log"))
    hits = [(p.name, k) for p in mesh.data_dir.rglob("*") if p.is_file()
            for ks in keys.values() for k in ks if k.encode() in p.read_bytes()]
    assert hits == []
