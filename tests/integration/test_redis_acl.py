"""Redis ACL users of the deployment, against a real redis-server.

The server runs the deployment's own ``deploy/redis/redis.conf`` (only port, bind address, data dir and ACL file
path overridden for a loopback test) with the ACL file rendered from the template using the passwords that
``docker-compose.yml`` gives the ``redis-acl`` step; the clients use the REDIS_URL of each compose service. So
this exercises the whole compose credential chain short of Docker itself.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from shared.procutil import free_port, wait_port
from shared.redis_util import blocking_client, command_client
from shared.messages import EventsMsg, WorkerHeartbeat, dead_stream, events_stream
from shared.streams import ACK, StreamConsumer, StreamProducer, ensure_group, safe_trim

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SERVICES = ("gateway", "gmg", "simulator", "scheduler", "worker")


def _support():
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_support_it", REPO / "tests/unit/deploy/deploy_support.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _render_module():
    return _support().load_module(DEPLOY / "redis" / "render_acl.py", "render_acl_it")


@pytest.fixture(scope="module")
def compose_env():
    compose = _support().interpolate(yaml.safe_load((REPO / "docker-compose.yml").read_text()), {})
    return compose["services"]


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory, compose_env):
    """redis-server with deploy/redis/redis.conf and the rendered ACL file; yields (host, port)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed")
    tmp = tmp_path_factory.mktemp("redis-acl")
    acl_env = {k: str(v) for k, v in compose_env["redis-acl"]["environment"].items()}
    rm = _render_module()
    acl = tmp / "users.acl"
    acl.write_text(rm.render_acl((DEPLOY / "redis" / "users.acl.template").read_text(), acl_env))
    # redis-server changes into `dir` while parsing the file, before command-line overrides apply, so the copy
    # swaps that one line; everything else is the deployment's file verbatim.
    conf_text = (DEPLOY / "redis" / "redis.conf").read_text()
    assert conf_text.count("\ndir /data\n") == 1
    conf = tmp / "redis.conf"
    conf.write_text(conf_text.replace("\ndir /data\n", f"\ndir {tmp}\n"))
    port = free_port()
    proc = subprocess.Popen([exe, str(conf), "--port", str(port), "--bind", "127.0.0.1",
                             "--aclfile", str(acl), "--logfile", str(tmp / "redis.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        if not wait_port("127.0.0.1", port, 10):
            log = tmp / "redis.log"
            pytest.fail(f"redis-server did not start: {log.read_text()[-2000:] if log.exists() else proc.poll()}")
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _url_of(compose_env, service: str, server) -> str:
    """The compose service's REDIS_URL, pointed at the test server."""
    u = urlsplit(compose_env[service]["environment"]["REDIS_URL"])
    return urlunsplit((u.scheme, f"{u.username}:{u.password}@{server[0]}:{server[1]}", u.path, "", ""))


def _plain(server, **kw) -> aioredis.Redis:
    """A client without retries, for the refusals."""
    return aioredis.Redis(host=server[0], port=server[1], socket_timeout=5, retry=None, **kw)


@pytest.fixture
def prefix() -> str:
    return f"slicesched:t{uuid.uuid4().hex[:8]}:"


@pytest.mark.parametrize("service", ["gateway", "gmg", "simulator", "scheduler", "worker-cpu0"])
async def test_service_user_runs_what_the_services_need(acl_server, compose_env, service, prefix):
    url = _url_of(compose_env, service, acl_server)
    r = command_client(url, name=f"acl-test-{service}")  # CLIENT SETNAME on every connection
    b = blocking_client(url, block_ms=200, name=f"acl-test-{service}-blk")
    stream, group = f"{prefix}requests", "g"
    try:
        assert await r.ping()
        assert (await r.client_getname()) == f"acl-test-{service}"
        await ensure_group(r, stream, group)
        await ensure_group(r, stream, group)  # BUSYGROUP is handled
        ids = [await r.xadd(stream, {"m": f"x{i}".encode()}) for i in range(3)]
        got = await b.xreadgroup(group, "c1", {stream: ">"}, count=10, block=200)
        assert [e[0].decode() for e in got[0][1]] == [i.decode() for i in ids]
        assert await r.xack(stream, group, ids[0]) == 1
        pending = await r.xpending(stream, group)
        assert pending["pending"] == 2
        assert len(await r.xpending_range(stream, group, "-", "+", 10)) == 2
        claimed = await r.xautoclaim(stream, group, "c2", min_idle_time=0, start_id="0-0", count=10)
        assert len(claimed[1]) == 2
        assert await r.xclaim(stream, group, "c3", min_idle_time=0, message_ids=[ids[1]], justid=True)
        assert (await r.xinfo_stream(stream))["length"] == 3
        assert len(await r.xinfo_groups(stream)) == 1 and await r.xinfo_consumers(stream, group)
        await safe_trim(r, stream)
        h = f"{prefix}device:cpu0"
        await r.hset(h, mapping={"used": 1, "capacity": 10})
        assert (await r.hgetall(h))[b"capacity"] == b"10"
        await r.zadd(f"{prefix}leases:cpu0", {"l1": 5.0})
        await r.set(f"{prefix}epoch", 1)
        assert await r.get(f"{prefix}epoch") == b"1"
        assert await r.expire(f"{prefix}epoch", 30)
        lua = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('TIME')[1]"
        assert int(await r.eval(lua, 1, f"{prefix}k", "v")) > 0
        sha = await r.script_load(lua)
        assert int(await r.evalsha(sha, 1, f"{prefix}k", "w")) > 0
        script = r.register_script("return redis.call('INCR', KEYS[1])")
        assert await script(keys=[f"{prefix}n"]) == 1
        async with r.pipeline(transaction=True) as p:
            p.incr(f"{prefix}n").sadd(f"{prefix}set", "a")
            assert await p.execute() == [2, 1]
    finally:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()
        await b.aclose()


async def test_stream_consumer_runs_as_a_service_user(acl_server, compose_env, prefix):
    """The project's own producer/consumer (PEL read, ack, reclaim, dead letter, trim) under the gmg ACL user."""
    url = _url_of(compose_env, "gmg", acl_server)
    r = command_client(url, name="acl-test-consumer")
    stream, seen = events_stream(prefix), []

    async def handler(d):
        seen.append(d.msg.device)
        return ACK

    def consumer(name):
        return StreamConsumer(cmd=r, blocking=blocking_client(url, block_ms=200), stream=stream, group="gmg",
                              consumer=name, types=EventsMsg, handler=handler, dead_stream=dead_stream(prefix),
                              block_ms=200, min_idle_ms=0)

    try:
        prod = StreamProducer(r)
        for i in range(4):
            await prod.add(stream, WorkerHeartbeat(msg_id=f"h{i}", device=f"cpu{i}", worker_id="w", backend="cpu",
                                                   home_tenant="t", ts=1.0))
        await r.xadd(stream, {b"t": b"WorkerHeartbeat", b"m": b"\xc1not-msgpack"})  # poison entry
        a = consumer("a")
        await a.ensure_group()
        await a.blocking.xreadgroup("gmg", "a", {stream: ">"}, count=2)  # "a" dies holding two entries
        b = consumer("b")
        assert await b.reclaim_once() == 2
        await asyncio.wait_for(b.run(asyncio.Event(), max_messages=4), 10)
        assert sorted(seen) == ["cpu0", "cpu1", "cpu2", "cpu3"]
        assert b.dead_lettered == 1 and await r.xlen(dead_stream(prefix)) == 1
        assert (await r.xpending(stream, "gmg"))["pending"] == 0
        await safe_trim(r, stream)
        await a.blocking.aclose()
        await b.blocking.aclose()
    finally:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()


DENIED = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "no"), ("KEYS", "*"),
    ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("ACL", "SETUSER", "x", "on"), ("INFO",),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"), ("CLIENT", "PAUSE", "10"), ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"), ("MONITOR",), ("SAVE",), ("BGREWRITEAOF",), ("REPLICAOF", "NO", "ONE"),
    ("GET", "other:k"), ("SET", "other:k", "v"), ("XADD", "other:s", "*", "a", "1"), ("HGETALL", "other:h"),
    ("DEL", "other:k"), ("GET", "slicesched"), ("RENAME", "slicesched:a", "other:a"),
]


@pytest.mark.parametrize("cmd", DENIED, ids=[" ".join(c) for c in DENIED])
async def test_service_user_is_refused_dangerous_commands_and_other_prefixes(acl_server, compose_env, cmd):
    url = _url_of(compose_env, "gateway", acl_server)
    r = aioredis.Redis.from_url(url, socket_timeout=5, retry=None)
    try:
        if cmd[0] == "DEBUG":  # enable-debug-command no refuses it before the ACL is consulted
            with pytest.raises(ResponseError, match="DEBUG command not allowed"):
                await r.execute_command(*cmd)
        else:
            with pytest.raises(NoPermissionError):
                await r.execute_command(*cmd)
    finally:
        await r.aclose()


async def test_acl_alone_denies_every_refused_command_for_every_service_user(acl_server, compose_env):
    """ACL DRYRUN asks the ACL only (no other server setting), for each service user and refused command."""
    pw = compose_env["redis-acl"]["environment"]["REDIS_PASSWORD_ADMIN"]
    admin = _plain(acl_server, username="admin", password=pw)
    try:
        for user in SERVICES:
            assert await admin.execute_command("ACL", "DRYRUN", user, "XADD", "slicesched:s", "*", "a", "1") == b"OK"
            for cmd in DENIED:
                verdict = (await admin.execute_command("ACL", "DRYRUN", user, *cmd)).decode()
                assert verdict != "OK" and "no permissions" in verdict, (user, cmd, verdict)
    finally:
        await admin.aclose()


@pytest.mark.parametrize("service", ["gateway", "gmg", "simulator", "scheduler", "worker-cpu1"])
async def test_every_service_user_is_confined(acl_server, compose_env, service):
    r = aioredis.Redis.from_url(_url_of(compose_env, service, acl_server), socket_timeout=5, retry=None)
    try:
        for cmd in (("FLUSHALL",), ("CONFIG", "GET", "dir"), ("KEYS", "*"), ("SET", "other:k", "1")):
            with pytest.raises(NoPermissionError):
                await r.execute_command(*cmd)
        # inside a Lua script the same rules hold
        with pytest.raises(ResponseError, match="can't access"):
            await r.eval("return redis.call('GET', 'other:k')", 0)
        with pytest.raises(ResponseError, match="can't run this command"):
            await r.eval("return redis.call('FLUSHALL')", 0)
    finally:
        await r.aclose()


async def test_unauthenticated_client_gets_noauth(acl_server):
    """On the wire: a client that never authenticates is answered NOAUTH, whatever it sends."""
    reader, writer = await asyncio.open_connection(*acl_server)
    try:
        for cmd in (b"PING", b"GET slicesched:x", b"FLUSHALL"):
            writer.write(cmd + b"\r\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 5)
            assert line.startswith(b"-NOAUTH"), line
    finally:
        writer.close()
        await writer.wait_closed()
    r = _plain(acl_server)
    try:
        with pytest.raises(AuthenticationError, match="authenticated|NOAUTH"):
            await r.ping()
    finally:
        await r.aclose()


async def test_wrong_credentials_are_refused(acl_server, compose_env):
    gw = urlsplit(compose_env["gateway"]["environment"]["REDIS_URL"])
    worker_pw = urlsplit(compose_env["worker-cpu0"]["environment"]["REDIS_URL"]).password
    cases = [{"password": gw.password},  # the default user is off, whatever the password
             {"username": "gateway", "password": "not-the-password"},
             {"username": "gateway", "password": worker_pw},
             {"username": "nobody", "password": gw.password}]
    for kw in cases:
        r = _plain(acl_server, **kw)
        try:
            with pytest.raises(AuthenticationError, match="WRONGPASS|invalid username-password"):
                await r.ping()
        finally:
            await r.aclose()


async def test_probe_user_can_only_ping(acl_server, compose_env):
    pw = compose_env["redis"]["environment"]["REDISCLI_AUTH"]
    r = _plain(acl_server, username="probe", password=pw)
    try:
        assert await r.ping()
        for cmd in (("GET", "slicesched:x"), ("XADD", "slicesched:s", "*", "a", "1"), ("INFO",)):
            with pytest.raises(NoPermissionError):
                await r.execute_command(*cmd)
    finally:
        await r.aclose()


def test_compose_healthcheck_command_works(acl_server, compose_env):
    """The compose healthcheck's own redis-cli line, run against the server with the probe password."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not installed")
    test = compose_env["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    line = test[1].replace("redis-cli ", f"redis-cli -h {acl_server[0]} -p {acl_server[1]} ", 1)
    good = subprocess.run(["sh", "-c", line], env={"PATH": "/usr/bin:/bin",
                                                   "REDISCLI_AUTH": compose_env["redis"]["environment"]["REDISCLI_AUTH"]},
                          timeout=10)
    bad = subprocess.run(["sh", "-c", line], env={"PATH": "/usr/bin:/bin", "REDISCLI_AUTH": "wrong-password-xx"},
                         timeout=10)
    assert good.returncode == 0 and bad.returncode != 0


async def test_server_runs_with_the_deployment_settings(acl_server, compose_env):
    pw = compose_env["redis-acl"]["environment"]["REDIS_PASSWORD_ADMIN"]
    r = _plain(acl_server, username="admin", password=pw)
    try:
        cfg = await r.config_get("*")
        assert cfg["appendonly"] == "yes" and cfg["appendfsync"] == "everysec"
        assert cfg["protected-mode"] == "yes" and cfg["maxmemory-policy"] == "noeviction"
        users = await r.acl_list()
        default = next(u for u in users if u.startswith("user default "))
        assert " off " in default + " " and "nopass" not in default
        assert {u.split()[1] for u in users} == {"default", "admin", "probe", *SERVICES}
    finally:
        await r.aclose()


@pytest.mark.e2e
def test_mesh_serves_requests_with_the_compose_settings(acl_server, compose_env, tmp_path):
    """Every compose app service, started as a process with its compose environment (its own ACL user, JSON logs,
    the compose config directory), serves completions through this Redis; the compose healthcheck commands pass;
    SIGTERM stops each within its stop_grace_period. Only addresses and ports differ from the containers."""
    order = ["gmg", "simulator", "scheduler", "worker-cpu0", "worker-cpu1", "gateway"]
    conf_dir = REPO / "deploy" / "compose" / "cpu"
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    try:
        for name in order:
            svc = compose_env[name]
            env = {k: str(v) for k, v in svc["environment"].items()}
            env.update(REDIS_URL=_url_of(compose_env, name, acl_server), SLICESCHED_GATEWAY_HOST="127.0.0.1",
                       SLICESCHED_CLUSTER=str(conf_dir / "cluster.yaml"),
                       SLICESCHED_TENANTS=str(conf_dir / "tenants.yaml"),
                       PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
            ports[name] = free_port()
            env["SLICESCHED_GATEWAY_PORT" if name == "gateway" else "SLICESCHED_METRICS_PORT"] = str(ports[name])
            assert svc["command"][0] == "python"
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen([sys.executable, *svc["command"][1:]], env=env, cwd=REPO,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                               start_new_session=True)
        deadline = time.monotonic() + 150
        for name in order:
            check = compose_env[name]["healthcheck"]["test"]
            container_port = "8000" if name == "gateway" else compose_env[name]["environment"]["SLICESCHED_METRICS_PORT"]
            cmd = [sys.executable, *[a.replace(f":{container_port}/", f":{ports[name]}/") for a in check[2:]]]
            while subprocess.run(cmd, capture_output=True, timeout=30).returncode != 0:
                assert procs[name].poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{name} not healthy: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                time.sleep(0.5)
        base = f"http://127.0.0.1:{ports['gateway']}"
        tenants = yaml.safe_load((conf_dir / "tenants.yaml").read_text())["tenants"]
        for t in tenants:
            body = json.dumps({"model": t["name"], "prompt": "hello", "max_tokens": 8}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={
                "Authorization": f"Bearer {t['api_keys'][0]}", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                out = json.load(resp)
            assert resp.status == 200 and 1 <= out["usage"]["completion_tokens"] <= 8, out
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        for t in tenants:
            counted = [line for line in metrics.splitlines() if line.startswith("slicesched_requests_total{")
                       and f'tenant="{t["name"]}"' in line and 'outcome="ok"' in line]
            assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, metrics
        for name in reversed(order):
            procs[name].send_signal(signal.SIGTERM)
        for name in order:
            grace = _support().parse_duration_s(compose_env[name]["stop_grace_period"])
            try:
                code = procs[name].wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running {grace:g} s after SIGTERM (compose would SIGKILL it)")
            assert code == 0, f"{name} exited {code}: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for name in order:
        lines = (tmp_path / f"{name}.log").read_text().splitlines()
        assert lines, f"{name} logged nothing"
        for line in lines:
            try:
                json.loads(line)
            except ValueError:
                pytest.fail(f"{name}: a log line that is not JSON (containers log JSON): {line[:300]!r}")
        text = "\n".join(lines)
        for refusal in ("NOPERM", "no permissions", "NOAUTH", "WRONGPASS"):
            assert refusal not in text, f"{name} was refused by Redis: {refusal}"
