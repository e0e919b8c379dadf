"""``slicesched inspect`` against a real redis-server populated by the real GMG store, lease store, stream consumer
and the scheduler's request-hash layout: every view's JSON, the human tables, errors and ``--watch``."""
from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from services.cli.main import main
from services.gmg.core import GMGCore
from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Reservation
from shared.gmg.lease_store import Lease, LeaseStore
from shared.messages import InferenceRequest, RequestsMsg, WorkerHeartbeat, dead_stream, requests_stream
from shared.redis_util import blocking_client
from shared.requests_state import req_key, tenant_stats_key
from shared.service import health_key
from shared.streams import ACK, DEFER, StreamConsumer, StreamProducer

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.1},
                         "devices": [{"id": "d0", "backend": "cpu", "memory_bytes": 100_000_000},
                                     {"id": "d1", "backend": "emulated", "memory_bytes": 100_000_000}]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 500, "tpot_ms": 50}, "home_devices": ["d0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 800, "tpot_ms": 80}, "home_devices": ["d1"]}]})


def _req(rid: str, tenant: str = "a") -> InferenceRequest:
    return InferenceRequest(msg_id=rid, request_id=rid, tenant=tenant, gateway="gw1", prompt_ids=[1, 2, 3],
                            max_tokens=4)


async def _populate(redis, redis_url: str, prefix: str) -> dict:
    """A small mesh's worth of state, written by the real store/stream code."""
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    now = time.time()
    core = GMGCore(store.keys, ["d0", "d1"])
    core.load({}, {}, {}, now)
    hb = WorkerHeartbeat(msg_id="h", device="d0", worker_id="w0", backend="cpu", home_tenant="a", ts=now,
                         capacity_bytes=100_000_000, weight_bytes=12_000_000, kv_used_bytes=4096,
                         kv_total_bytes=50_000_000, running=2, queued=1, busy_ratio=0.25)
    op, batch = core.on_event(hb, now)
    await store.apply(op, batch)
    await store.reserve([Reservation("d0", "weights:a:home", "weights", "a", 12_000_000),
                         Reservation("d0", "kv:r-done", "kv", "a", 65_536)])
    leases = LeaseStore(store)
    await leases.stage("d1", "a", {"mlp[0]": 1_000_000})
    await leases.commit(Lease("L1", "a", "d1", ("mlp[0]",), now, now + 30, 2_000_000, home="d0"))
    await redis.hset(f"{prefix}sim:forecast:d0", mapping={  # the simulator's layout (docs/redis-schema.md)
        "ts": f"{now:.3f}", "horizon_s": "2", "label": "simulated", "state": "up", "tenant": "a", "busy_ratio": "0.350",
        "busy": "0.000-0.500,1.000-1.200", "idle": "0.500-1.000,1.200-2.000", "next_idle_s": "0.5000",
        "peak_bytes": "12065536", "free_now": "77934464", "memory": "0.000:12065536,1.500:12000000"})
    await redis.hset(f"{prefix}sim:rates", mapping={"ts": f"{now:.3f}", "window_s": "10", "a": "2.5000",
                                                    "a:mean_input": "12.0", "a:mean_output": "30.0"})
    await redis.hset(f"{prefix}sim:corrections", mapping={"d0/mlp": "1.1000|0.0500|40"})
    await redis.hset(tenant_stats_key(prefix, "a"), mapping={"queued": 3, "running": 2, "ts": now})
    for rid, state in (("r-done", "done"), ("r2", "done"), ("r3", "done"), ("r4", "failed")):
        await redis.hset(req_key(prefix, rid), mapping={"tenant": "a", "gateway": "gw1", "state": state,
                                                        "device": "d0", "queued_ts": now - 1.0,
                                                        "assigned_ts": now - 0.9, "running_ts": now - 0.8,
                                                        f"{state}_ts": now - 0.1, "kv_blocks": 1})
    # streams: one pending (deferred) request, one acked, one poison entry that names a request
    prod, stream = StreamProducer(redis), requests_stream(prefix)
    await prod.add(stream, _req("r-pending"))
    await prod.add(stream, _req("r-acked"))
    poison = InferenceRequest(msg_id="x", request_id="r-done", tenant="a", gateway="gw1", prompt_ids=[],
                              max_tokens=1)
    from shared.codec import encode
    raw = bytearray(encode(poison))
    raw = bytes(raw).replace(b"InferenceRequest", b"NoSuchMessage!!!")  # decodes as msgpack, wrong schema
    await redis.xadd(stream, {b"t": b"NoSuchMessage", b"m": raw})

    async def handler(d):
        return DEFER if d.msg.request_id == "r-pending" else ACK

    cons = StreamConsumer(cmd=redis, blocking=blocking_client(redis_url, block_ms=100), stream=stream,
                          group="scheduler", consumer="s0", types=RequestsMsg, handler=handler,
                          dead_stream=dead_stream(prefix), block_ms=100)
    await asyncio.wait_for(cons.run(asyncio.Event(), max_messages=2), timeout=10)
    while cons.dead_lettered < 1:
        await asyncio.sleep(0.05)
    await cons.blocking.aclose()
    return {"now": now}


def _json(capsys, redis_url, prefix, *argv) -> dict:
    capsys.readouterr()  # drop log lines written while populating
    rc = main(["inspect", "--redis-url", redis_url, "--prefix", prefix, *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


async def test_devices_view(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    doc = _json(capsys, redis_url, prefix, "devices")
    assert doc["kind"] == "devices" and [d["id"] for d in doc["devices"]] == ["d0", "d1"]
    d0, d1 = doc["devices"]
    assert d0["state"] == "ready" and d0["home_tenant"] == "a" and d0["backend"] == "cpu"
    assert d0["heartbeat_age_s"] is not None and 0 <= d0["heartbeat_age_s"] < 30
    assert d0["memory"]["capacity_bytes"] == 100_000_000 and d0["memory"]["limit_bytes"] == 90_000_000
    assert d0["memory"]["reserved_bytes"] == 12_000_000 + 65_536
    assert d0["memory"]["free_bytes"] == 90_000_000 - 12_065_536
    assert d0["memory"]["used_bytes"] == 12_004_096 and d0["memory"]["kv_used_bytes"] == 4096
    assert d0["busy_ratio"] == 0.25 and d0["running"] == 2 and d0["queued"] == 1
    assert d0["reservations"] == {"count": 2, "bytes_by_kind": {"kv": 65_536, "weights": 12_000_000}}
    assert {x["segment"] for x in d0["resident"]} >= {"embed", "attn[0]", "mlp[0]", "head"}
    assert d0["resident_bytes"] == sum(x["bytes"] for x in d0["resident"]) > 0
    assert d1["state"] == "down" and d1["heartbeat_age_s"] is None and d1["leases_active"] == 1
    assert {"tenant": "a", "segment": "mlp[0]", "bytes": 1_000_000} in d1["resident"]


async def test_tenants_view_from_request_hashes(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    doc = _json(capsys, redis_url, prefix, "tenants")
    a, b = doc["tenants"]
    assert a["name"] == "a" and a["home_devices"] == ["d0"] and a["sla"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert a["queued"] == 3 and a["running"] == 2 and a["stats_age_s"] < 30
    assert a["recent_states"] == {"done": 3, "failed": 1}
    assert a["sla_attainment"] == 0.75 and a["sla_source"] == "request_hashes"
    assert b["name"] == "b" and b["queued"] is None and b["sla_attainment"] is None and b["sla_source"] is None
    assert doc["gateways_scraped"] == 0 and doc["requests_scanned"] == 4


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


async def test_tenants_sla_attainment_from_gateway_metrics(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    _Metrics.body = (b'slicesched_requests_total{tenant="a",outcome="ok"} 18.0\n'
                     b'slicesched_requests_total{tenant="a",outcome="error"} 1.0\n'
                     b'slicesched_requests_total{tenant="a",outcome="rejected_quota"} 1.0\n'
                     b'slicesched_requests_total{tenant="a",outcome="cancelled"} 5.0\n'
                     b'slicesched_sla_violations_total{tenant="a"} 4.0\n')
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        await redis.hset(health_key(prefix, "gateway", "gw1"), mapping={"port": srv.server_address[1], "ready": 1})
        doc = _json(capsys, redis_url, prefix, "tenants")
    finally:
        srv.shutdown()
    a = doc["tenants"][0]
    assert doc["gateways_scraped"] == 1
    assert a["requests"] == {"cancelled": 5, "error": 1, "ok": 18, "rejected_quota": 1}
    assert a["sla_violations"] == 4 and a["sla_source"] == "gateway_metrics"
    assert a["sla_attainment"] == pytest.approx(1 - 4 / 20)  # cancelled requests do not count


async def test_leases_and_forecasts_views(redis, redis_url, prefix, capsys):
    st = await _populate(redis, redis_url, prefix)
    leases = _json(capsys, redis_url, prefix, "leases")["leases"]
    assert len(leases) == 1
    lease = leases[0]
    assert (lease["id"], lease["tenant"], lease["guest"], lease["home"]) == ("L1", "a", "d1", "d0")
    assert lease["segments"] == ["mlp[0]"] and lease["nbytes"] == 2_000_000 and lease["state"] == "active"
    assert 0 < lease["remaining_s"] <= 30
    doc = _json(capsys, redis_url, prefix, "forecasts")
    fc = doc["forecasts"]
    assert [f["device"] for f in fc] == ["d0"]
    f = fc[0]["fields"]
    assert f["busy"] == [[0.0, 0.5], [1.0, 1.2]] and f["idle"] == [[0.5, 1.0], [1.2, 2.0]]
    assert f["memory"] == [[0.0, 12_065_536], [1.5, 12_000_000]] and f["peak_bytes"] == 12_065_536
    assert f["label"] == "simulated" and f["busy_ratio"] == 0.35
    assert fc[0]["ts"] == pytest.approx(st["now"], abs=0.01) and fc[0]["age_s"] >= 0
    assert doc["rates"] == {"a": {"rate_rps": 2.5, "mean_input": 12.0, "mean_output": 30.0}}
    assert doc["corrections"] == {"d0/mlp": {"factor": 1.1, "error": 0.05, "samples": 40}}
    assert main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "forecasts"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and "35.0%" in out and "ARRIVALS/S" in out and "d0/mlp" in out


async def test_empty_prefix_gives_empty_views(redis_url, prefix, capsys):
    for view, key in (("devices", "devices"), ("tenants", "tenants"), ("leases", "leases"),
                      ("forecasts", "forecasts"), ("streams", "streams")):
        assert _json(capsys, redis_url, prefix, view)[key] == []
    assert main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "leases"]) == 0
    assert "(no active leases)" in capsys.readouterr().out


async def test_streams_view(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    doc = _json(capsys, redis_url, prefix, "streams")
    by_name = {s["name"]: s for s in doc["streams"]}
    req = by_name[requests_stream(prefix)]
    assert req["length"] == 3 and req["entries_added"] == 3
    (g,) = req["groups"]
    assert g["name"] == "scheduler" and g["consumers"] == 1 and g["pending"] == 1 and g["lag"] == 0
    assert g["oldest_pending_id"] is not None and g["oldest_pending_idle_ms"] >= 0
    assert g["max_deliveries"] == 1 and g["consumers_detail"][0]["name"] == "s0"
    assert f"{prefix}{{gmg}}:changes" in by_name  # streams without groups are listed too
    dl = doc["dead_letters"]
    assert dl["count"] == 1 and dl["by_reason"] == {"undecodable": 1}
    assert dl["by_stream"] == {requests_stream(prefix): 1}
    assert dl["recent"][0]["request_id"] == "r-done" and dl["recent"][0]["group"] == "scheduler"


async def test_request_journey(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    doc = _json(capsys, redis_url, prefix, "request", "r-done")
    capsys.readouterr()
    assert doc["found"] and doc["state"] == "done" and doc["tenant"] == "a"
    assert [e["event"] for e in doc["timeline"]] == ["queued", "assigned", "running", "done"]
    assert doc["timeline"][0]["t_ms"] == 0 and doc["timeline"][-1]["t_ms"] == pytest.approx(900, abs=1)
    assert doc["fields"]["device"] == "d0" and doc["fields"]["kv_blocks"] == 1
    assert len(doc["dead_letters"]) == 1 and doc["dead_letters"][0]["reason_kind"] == "undecodable"
    assert main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "request", "r-done"]) == 0
    out = capsys.readouterr().out
    events = [line.split()[0] for line in out.split("EVENT", 1)[1].splitlines()[1:5]]
    assert events == ["queued", "assigned", "running", "done"]


async def test_unknown_request_is_exit_1_one_line(redis_url, prefix, capsys):
    rc = main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "request", "nope"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "nope" in err and "Traceback" not in err


def test_redis_unreachable_is_exit_2_one_line(capsys):
    from shared.procutil import free_port

    rc = main(["inspect", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "devices"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot read Redis" in err and "Traceback" not in err
    rc = main(["inspect", "--redis-url", "", "devices"])
    assert rc == 2 and "REDIS_URL" in capsys.readouterr().err


async def test_human_tables_are_aligned(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    capsys.readouterr()
    for view in ("devices", "tenants", "leases", "forecasts", "streams"):
        assert main(["inspect", "--redis-url", redis_url, "--prefix", prefix, view]) == 0
        lines = capsys.readouterr().out.split("\n\n")[0].splitlines()
        header = lines[0]
        assert header.split()[0] in ("DEVICE", "TENANT", "LEASE", "STREAM") and len(lines) >= 2
        starts = [header.index(" " + h) + 1 for h in header.split()[1:]]
        for line in lines[1:]:  # every column boundary is the same two-space gap in every row
            assert all(line[s - 2:s] == "  " for s in starts if s < len(line)), (view, line)
    assert main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "devices"]) == 0
    out = capsys.readouterr().out
    assert "d0" in out and "ready" in out and "85.8MiB" in out  # limit 90e6 bytes


async def test_watch_json_prints_one_object_per_refresh(redis, redis_url, prefix, capsys, monkeypatch):
    await _populate(redis, redis_url, prefix)
    ticks = []

    def fake_sleep(s):
        ticks.append(s)
        if len(ticks) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("services.cli.inspect.time.sleep", fake_sleep)
    capsys.readouterr()
    rc = main(["inspect", "--redis-url", redis_url, "--prefix", prefix, "--json", "--watch", "0.5", "devices"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and ticks == [0.5, 0.5, 0.5] and len(lines) == 3
    assert all(json.loads(x)["kind"] == "devices" for x in lines)


async def test_refused_read_is_exit_2_one_line(redis, redis_url, prefix, capsys):
    await _populate(redis, redis_url, prefix)
    user = f"ro{prefix.rstrip(':')}"
    await redis.execute_command("ACL", "SETUSER", user, "on", ">pw", "~other:*", "+@all")
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        capsys.readouterr()
        rc = main(["inspect", "--redis-url", url, "--prefix", prefix, "devices"])
        err = capsys.readouterr().err
    finally:
        await redis.execute_command("ACL", "DELUSER", user)
    assert rc == 2 and err.count("\n") == 1 and "refused" in err and "pw@" not in err, err
