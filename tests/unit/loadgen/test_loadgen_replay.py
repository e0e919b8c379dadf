"""The replay client against a small in-test server that imitates the gateway's streaming completions API."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from loadgen.prompts import ByteLevelSynthesizer
from loadgen.replay import ReplayOptions, replay
from loadgen.runner import run_replay
from shared.workload import WorkloadRequest

KEYS = {"good": "sk-good-000001", "limited": "sk-limited-0001", "broken": "sk-broken-00001", "slow": "sk-slow-0000001",
        "cut": "sk-cut-00000001"}
TOKEN_DELAY = 0.01


def make_app(seen: list[dict], release: asyncio.Event) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "auth": request.headers.get("Authorization")})
        model = body["model"]
        if request.headers.get("Authorization") != f"Bearer {KEYS.get(model)}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if model == "limited":
            return web.json_response({"error": {"message": "tenant queue full"}}, status=429,
                                     headers={"Retry-After": "1"})
        if model == "broken":
            return web.json_response({"error": {"message": "worker crashed"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if model == "slow":  # stalls until the test releases it (before shutting the server down)
            try:
                await asyncio.wait_for(release.wait(), 5)
            except asyncio.TimeoutError:
                pass
        n = body["max_tokens"]
        await resp.write(b": keep-alive\n\n")
        await resp.write(b'data: {"choices": [{"index": 0, "text": ""}]}\n\n')  # empty chunk: not a token
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY)
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}",
                     "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if model == "cut" and i == 1:
                return resp  # the stream ends without [DONE]
        usage = {"prompt_tokens": len(body["prompt"]) + 1, "completion_tokens": n, "total_tokens": n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


class Server:
    """The fake gateway on a free port; ``stop()`` releases stalled handlers, then shuts down."""

    def __init__(self, runner: web.AppRunner, url: str, release: asyncio.Event) -> None:
        self.runner, self.url, self.release = runner, url, release

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


async def start(seen: list[dict]) -> Server:
    release = asyncio.Event()
    runner = web.AppRunner(make_app(seen, release))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return Server(runner, f"http://127.0.0.1:{port}", release)


def opts(url: str, **kw) -> ReplayOptions:
    synth = ByteLevelSynthesizer()
    return ReplayOptions(url=url, keys=KEYS, synthesizers={k: synth for k in KEYS}, progress=False, **kw)


async def test_outcomes_are_recorded():
    seen: list[dict] = []
    srv = await start(seen)
    url = srv.url
    try:
        reqs = [WorkloadRequest("good-0", 0.0, "good", 40, 8), WorkloadRequest("limited-0", 0.02, "limited", 5, 4),
                WorkloadRequest("broken-0", 0.04, "broken", 5, 4), WorkloadRequest("slow-0", 0.06, "slow", 5, 4),
                WorkloadRequest("cut-0", 0.08, "cut", 5, 6), WorkloadRequest("good-1", 0.3, "good", 2, 1)]
        res = await replay(reqs, opts(url, timeout_s=0.8))
    finally:
        await srv.stop()
    by = {r.id: r for r in res.records}
    assert not res.partial and res.not_sent == 0 and set(by) == {r.request_id for r in reqs}
    g = by["good-0"]
    assert g.status == "ok" and g.http_status == 200 and g.output_tokens == 8 and len(g.itl) == 7
    assert 0 < g.ttft_s < g.e2e_s and g.tpot_s == pytest.approx((g.e2e_s - g.ttft_s) / 7)
    assert all(x >= TOKEN_DELAY * 0.5 for x in g.itl) and g.ttft_s >= TOKEN_DELAY * 0.5
    assert by["good-1"].status == "ok" and by["good-1"].output_tokens == 1 and by["good-1"].tpot_s is None
    lim = by["limited-0"]
    assert (lim.status, lim.http_status, lim.error) == ("rejected", 429, "tenant queue full")
    brk = by["broken-0"]
    assert (brk.status, brk.http_status, brk.error) == ("failed", 500, "worker crashed")
    slow = by["slow-0"]
    assert slow.status == "timeout" and slow.http_status == 200 and slow.e2e_s == pytest.approx(0.8, abs=0.3)
    cut = by["cut-0"]
    assert cut.status == "failed" and "before [DONE]" in cut.error and cut.output_tokens == 2
    body = next(s["body"] for s in seen if s["body"]["model"] == "good" and s["body"]["max_tokens"] == 8)
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and len(body["prompt"].encode()) == 39
    assert all(s["auth"] == f"Bearer {KEYS[s['body']['model']]}" for s in seen)
    # open loop: sends follow the schedule, not the responses
    assert max(r.send_lag_s for r in res.records) < 0.1


async def test_stop_cancels_in_flight_and_marks_partial():
    seen: list[dict] = []
    srv = await start(seen)
    url = srv.url
    stop = asyncio.Event()
    try:
        reqs = [WorkloadRequest(f"slow-{i}", 0.01 * i, "slow", 5, 4) for i in range(3)]
        reqs += [WorkloadRequest("good-9", 30.0, "good", 5, 4)]
        asyncio.get_running_loop().call_later(0.3, stop.set)
        res = await replay(reqs, opts(url, timeout_s=60, grace_s=0.2), stop=stop)
    finally:
        await srv.stop()
    assert res.partial and res.not_sent == 1
    assert sorted(r.id for r in res.records) == ["slow-0", "slow-1", "slow-2"]
    assert {r.status for r in res.records} == {"cancelled"}


def test_run_replay_writes_outputs(tmp_path):
    """The whole command path: workload file → replay against the server → requests.jsonl and summaries."""
    seen: list[dict] = []
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    def serve():
        asyncio.set_event_loop(loop)
        box["srv"] = loop.run_until_complete(start(seen))
        ready.set()
        loop.run_forever()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    assert ready.wait(10)
    try:
        tenants = tmp_path / "tenants.yaml"
        tenants.write_text("tenants:\n" + "".join(
            f"  - {{name: {n}, model: tiny, sla: {{ttft_ms: 5000, tpot_ms: 1000}}, home_devices: [cpu0], "
            f"api_keys: [{KEYS[n]}]}}\n" for n in ("good", "limited")))
        (tmp_path / "t.jsonl").write_text("".join(
            f'{{"timestamp": {i * 50}, "input_length": 12, "output_length": 3}}\n' for i in range(10)))
        w = tmp_path / "w.yaml"
        w.write_text("tenants: tenants.yaml\ntraces: [t.jsonl]\nalpha: 0\nseed: 1\nduration_s: 0.5\n")
        out = tmp_path / "out"
        summary = run_replay(str(w), box["srv"].url, str(out), progress=False, timeout_s=10)
    finally:
        asyncio.run_coroutine_threadsafe(box["srv"].stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == summary["total"]["requests"] > 0
    assert {x["status"] for x in lines if x["tenant"] == "good"} == {"ok"}
    assert {x["status"] for x in lines if x["tenant"] == "limited"} == {"rejected"}
    assert set(lines[0]) >= {"id", "tenant", "arrival_s", "sent_ts", "ttft_s", "tpot_s", "e2e_s", "itl",
                             "output_tokens", "status", "http_status", "error"}
    saved = json.loads((out / "summary.json").read_text())
    assert saved["tenants"]["limited"]["rejected"] == saved["tenants"]["limited"]["requests"]
    assert saved["tenants"]["good"]["violation_rate"] == 0.0 and saved["partial"] is False
    assert "| good |" in (out / "summary.md").read_text()
