"""Two real worker processes (driver ``cpu0`` with tenant ``ta``, guest ``cpu1`` with tenant ``tb``) on a real
redis-server; the test stands in for the scheduler (AssignRequest, lease commits in the GMG, LeaseGranted /
LeaseRevoked to both workers) and for the gateway (reads TokenChunks from its tokens stream)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from shared.codec import decode
from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore
from shared.gmg.lease_store import Lease, LeaseStore
from shared.messages import (AssignRequest, InferenceRequest, LeaseGranted, LeaseRevoked, TokenChunk, TokensMsg,
                             tokens_stream, worker_stream)
from shared.model.graph import ModelGraph
from shared.redis_util import command_client
from shared.streams import StreamProducer, entry_payload

REPO = Path(__file__).resolve().parents[2]
DRIVER, GUEST = "cpu0", "cpu1"


def write_configs(tmp: Path, link: str, preset: str = "tiny", sla=(2000, 100)) -> tuple[Path, Path]:
    cluster = {"cluster": {"name": "guest-pair", "headroom_fraction": 0.05},
               "links": {"intra_host": link, "inter_host": "tcp"},
               "devices": [{"id": d, "backend": "cpu", "kind": "cpu", "memory_gb": 0.5, "host": "localhost",
                            "threads": 1} for d in (DRIVER, GUEST)]}
    tenants = {"tenants": [{"name": n, "model": {"preset": preset, "seed": s},
                            "sla": {"ttft_ms": sla[0], "tpot_ms": sla[1]}, "home_devices": [d],
                            "api_keys": [f"sk-test-{n}-0001"]}
                           for n, s, d in (("ta", 11, DRIVER), ("tb", 12, GUEST))]}
    c, t = tmp / "cluster.yaml", tmp / "tenants.yaml"
    c.write_text(yaml.safe_dump(cluster))
    t.write_text(yaml.safe_dump(tenants))
    return c, t


@dataclass
class Outcome:
    """Tokens of one request and the Redis times (ms) of its chunks."""

    tokens: list[int] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)
    finish: str | None = None
    sent_ms: float = 0.0

    @property
    def ttft_ms(self) -> float:
        return self.chunk_ms[0] - self.sent_ms

    @property
    def tpot_ms(self) -> float:
        return (self.chunk_ms[-1] - self.chunk_ms[0]) / max(1, len(self.tokens) - 1)


class GuestPair:
    def __init__(self, tmp: Path, redis_url: str, prefix: str, link: str = "shm", env: dict | None = None,
                 preset: str = "tiny", sla=(2000, 100)) -> None:
        self.tmp, self.url, self.p, self.link = tmp, redis_url, prefix, link
        self.cluster_file, self.tenants_file = write_configs(tmp, link, preset, sla)
        self.cluster = parse_cluster(yaml.safe_load(self.cluster_file.read_text()), self.cluster_file)
        self.tenants = parse_tenants(yaml.safe_load(self.tenants_file.read_text()), self.tenants_file, self.cluster)
        self.env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis = command_client(redis_url)
        self.producer = StreamProducer(self.redis)
        self.store = GMGStore(self.redis, prefix)

    async def start(self, timeout_s: float = 60.0) -> None:
        await self.store.register_cluster(self.cluster, self.tenants)
        env = dict(os.environ, REDIS_URL=self.url, SLICESCHED_PREFIX=self.p, SLICESCHED_CLUSTER=str(self.cluster_file),
                   SLICESCHED_TENANTS=str(self.tenants_file), SLICESCHED_LOG_FORMAT="json",
                   SLICESCHED_KV_POOL_MB="32", **self.env)
        for d in (DRIVER, GUEST):
            log = open(self.tmp / f"worker-{d}.log", "w")
            self.procs[d] = subprocess.Popen([sys.executable, "-m", "services.worker", "--device", d], cwd=REPO,
                                             env=env, stdout=log, stderr=subprocess.STDOUT)
        for d in (DRIVER, GUEST):
            await self.wait_health(d, lambda h: h.get("ready") == "1" and h.get("segment_addr"), timeout_s)

    def log(self, device: str) -> str:
        return (self.tmp / f"worker-{device}.log").read_text()

    async def health(self, device: str) -> dict[str, str]:
        raw = await self.redis.hgetall(f"{self.p}health:worker:{device}")
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def fresh_health(self, device: str) -> dict[str, str]:
        """The health hash as written after now (it is refreshed once a second)."""
        t = time.time()
        return await self.wait_health(device, lambda h: float(h.get("ts") or 0) > t, 5)

    async def wait_health(self, device: str, pred, timeout_s: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs.get(device)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"worker {device} exited {proc.returncode}:\n{self.log(device)[-3000:]}")
            h = await self.health(device)
            if pred(h):
                return h
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{device} health never matched; last {await self.health(device)}\n"
                           f"{self.log(device)[-3000:]}")

    async def grant(self, segments: list[str], duration_s: float = 120.0, share: float = 1.0) -> str:
        """Commit a lease of ``ta``'s segments on the guest in the GMG and tell both workers (as the scheduler)."""
        lid = uuid.uuid4().hex[:12]
        ls = LeaseStore(self.store)
        seg_bytes = {s.name: s.weight_bytes for s in ModelGraph.from_config(self.tenants.get("ta").model.config).segments}
        staged = await ls.stage(GUEST, "ta", {s: seg_bytes[s] for s in segments})
        assert isinstance(staged, int) or staged.reason == "already_resident", staged
        now = time.time()
        res = await ls.commit(Lease(lid, "ta", GUEST, tuple(segments), now, now + duration_s, 4 << 20, home=DRIVER))
        assert isinstance(res, int), res
        msg = dict(lease_id=lid, tenant="ta", home_device=DRIVER, guest_device=GUEST, segments=segments,
                   start_ts=now, end_ts=now + duration_s, share=share, memory_bytes=4 << 20)
        await self.producer.add_many([(worker_stream(self.p, d), LeaseGranted(msg_id=uuid.uuid4().hex, **msg))
                                      for d in (GUEST, DRIVER)])
        return lid

    async def revoke(self, lid: str, reason: str = "test") -> None:
        await LeaseStore(self.store).close(lid, "revoked", reason)
        await self.producer.add_many([(worker_stream(self.p, d), LeaseRevoked(
            msg_id=uuid.uuid4().hex, lease_id=lid, tenant="ta", home_device=DRIVER, guest_device=GUEST,
            reason=reason)) for d in (DRIVER, GUEST)])

    async def submit(self, device: str, tenant: str, prompts: list[list[int]], max_tokens: int,
                     gateway: str) -> dict[str, Outcome]:
        out: dict[str, Outcome] = {}
        items = []
        for i, prompt in enumerate(prompts):
            rid = f"{gateway}-{i}"
            req = InferenceRequest(msg_id=uuid.uuid4().hex, request_id=rid, tenant=tenant, gateway=gateway,
                                   prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, arrival_ts=time.time())
            items.append((worker_stream(self.p, device), AssignRequest(msg_id=uuid.uuid4().hex, request=req,
                                                                       device=device, kv_blocks=8)))
            out[rid] = Outcome(sent_ms=time.time() * 1e3)
        await self.producer.add_many(items)
        return out

    async def collect(self, gateway: str, outcomes: dict[str, Outcome], timeout_s: float = 60.0) -> dict[str, Outcome]:
        """Read ``gateway``'s tokens stream until every request finished."""
        stream, last = tokens_stream(self.p, gateway), "0"
        deadline = time.monotonic() + timeout_s
        while any(o.finish is None for o in outcomes.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"unfinished: {[r for r, o in outcomes.items() if o.finish is None]}")
            res = await self.redis.xread({stream: last}, count=500, block=200)
            for _, entries in res or []:
                for eid, fields in entries:
                    last = eid
                    msg = decode(entry_payload(fields), TokensMsg)
                    assert isinstance(msg, TokenChunk), msg
                    o = outcomes[msg.request_id]
                    if msg.token_ids:
                        o.tokens.extend(msg.token_ids)
                        o.chunk_ms.extend([float(eid.decode().split("-")[0])] * len(msg.token_ids))
                    if msg.finish_reason:
                        o.finish = msg.finish_reason
        return outcomes

    async def wait_tokens(self, gateway: str, n: int, timeout_s: float = 30.0) -> int:
        """Wait until ``gateway``'s tokens stream holds at least ``n`` tokens in all (it reads, never consumes:
        ``collect`` reads the stream again from the start)."""
        stream, last, seen = tokens_stream(self.p, gateway), "0", 0
        deadline = time.monotonic() + timeout_s
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gateway}: {seen} of {n} tokens")
            for _, entries in await self.redis.xread({stream: last}, count=500, block=50) or []:
                for eid, fields in entries:
                    last = eid
                    seen += len(decode(entry_payload(fields), TokensMsg).token_ids or ())
        return seen

    async def run(self, device: str, tenant: str, prompts: list[list[int]], max_tokens: int,
                  timeout_s: float = 60.0) -> dict[int, Outcome]:
        gw = f"gw{uuid.uuid4().hex[:6]}"
        outs = await self.collect(gw, await self.submit(device, tenant, prompts, max_tokens, gw), timeout_s)
        return {int(r.rsplit("-", 1)[1]): o for r, o in outs.items()}

    def kill(self, device: str) -> None:
        self.procs[device].send_signal(signal.SIGKILL)
        self.procs[device].wait(10)

    async def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2  # a clean stop can take seconds of interpreter teardown on a loaded VM
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        await self.redis.aclose()
