"""``slicesched bench overload``: the live mesh at 1x, 2x and 5x its measured capacity (RELIABILITY row 16).

Capacity is the open-loop Poisson request rate that one tenant sustains with SLA violations (rejections included)
at or under ``--max-violation``, found by doubling then bisecting short probes (or given with ``--capacity-rps``).
Each multiplier then offers ``multiplier x capacity`` for ``--duration-s`` and reports goodput (tokens/s of
requests that met their SLA), 429 and 503 counts with whether each carried a valid Retry-After, the accepted
requests' p99 TTFT/E2E and SLA attainment, lost requests (accepted without a terminal outcome, checked at the
client and in the request's Redis journey), the peak RSS of every service process (VmHWM, reset per phase) and
Redis memory. The mesh is the one ``slicesched up`` starts, on a private Redis; the load generator runs in this
process on the same machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.argtypes import fraction, nonneg_float, nonneg_int, positive_float, positive_int
from shared.config import REPO_CONFIGS, ConfigError, dev_api_keys, load_cluster, load_tenants

RETRY_STATUSES = (429, 503)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-tiny.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-tiny.yaml"))
    p.add_argument("--tenant", default=None, help="tenant to load (default: the first)")
    p.add_argument("--multipliers", default="1,2,5", help="comma-separated multiples of the capacity")
    p.add_argument("--duration-s", type=positive_float, default=30.0, help="seconds of offered load per multiplier")
    p.add_argument("--capacity-rps", type=positive_float, default=None, help="skip the search and use this capacity")
    p.add_argument("--search-s", type=positive_float, default=10.0, help="seconds per capacity probe")
    p.add_argument("--search-start-rps", type=positive_float, default=8.0)
    p.add_argument("--search-steps", type=nonneg_int, default=3, help="bisection steps after the doubling phase")
    p.add_argument("--max-violation", type=fraction, default=0.09, help="violation bound that defines capacity")
    p.add_argument("--prompt-tokens", type=positive_int, default=16)
    p.add_argument("--output-tokens", type=positive_int, default=16)
    p.add_argument("--max-inflight", type=positive_int, default=None, help="SLICESCHED_MAX_INFLIGHT for the gateway")
    p.add_argument("--admit-sla-fraction", type=nonneg_float, default=None,
                   help="SLICESCHED_ADMIT_SLA_FRACTION for the gateway (0 turns the SLA limiter off)")
    p.add_argument("--policy", default="container", help="the mesh's policy (the published figures: container)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None)


@dataclass
class Seen:
    """Response headers of every request of a phase, collected by an aiohttp trace hook."""

    statuses: Counter = field(default_factory=Counter)
    retry_after_ok: Counter = field(default_factory=Counter)
    accepted_ids: list[str] = field(default_factory=list)

    def add(self, status: int, headers) -> None:
        self.statuses[status] += 1
        if status in RETRY_STATUSES and _valid_retry_after(headers.get("Retry-After")):
            self.retry_after_ok[status] += 1
        if status == 200 and headers.get("X-Request-Id"):
            self.accepted_ids.append(headers["X-Request-Id"])


def _valid_retry_after(v: str | None) -> bool:
    return v is not None and v.strip().isdigit() and int(v) >= 1


def arrivals(rate: float, duration_s: float, seed: int, tenant: str, prompt: int, output: int, tag: str):
    """A Poisson arrival process at ``rate`` req/s for ``duration_s`` (seeded, so every run offers the same)."""
    from shared.workload import WorkloadRequest

    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(WorkloadRequest(f"{tag}-{len(out)}", t, tenant, prompt, output))


class Bench:
    """The mesh under test plus the probes run against it."""

    def __init__(self, launcher, tenant, key: str, args: argparse.Namespace) -> None:
        from loadgen.prompts import synthesizer_for
        from loadgen.report import SlaTarget

        self.launcher, self.tenant, self.key, self.args = launcher, tenant, key, args
        self.synth = {tenant.name: synthesizer_for(tenant)}
        self.sla = {tenant.name: SlaTarget(tenant.sla.ttft_ms / 1000, tenant.sla.tpot_ms / 1000)}
        self.prefix = launcher.prefix
        self.probes: list[dict] = []

    # ------------------------------------------------------------ one phase of open-loop load
    async def offer(self, rate: float, duration_s: float, seed: int, tag: str, *, measure: bool,
                    settle_s: float = 0.0) -> dict[str, Any]:
        import aiohttp
        import redis.asyncio as aioredis

        from loadgen.replay import ReplayOptions, replay

        reqs = arrivals(rate, duration_s, seed, self.tenant.name, self.args.prompt_tokens, self.args.output_tokens,
                        tag)
        seen = Seen()
        trace = aiohttp.TraceConfig()

        async def on_end(session, ctx, params) -> None:
            seen.add(params.response.status, params.response.headers)

        trace.on_request_end.append(on_end)
        r = aioredis.Redis.from_url(self.launcher.redis_url, socket_timeout=5)
        pids = await self._pids(r) if measure else {}
        for pid in pids.values():
            _reset_hwm(pid)
        sampler_stop = asyncio.Event()
        sampled = {"used_memory_max": 0}
        sampler = asyncio.create_task(self._sample_redis(r, sampler_stop, sampled))
        opts = ReplayOptions(url=self.launcher.gateway_url, keys={self.tenant.name: self.key},
                             synthesizers=self.synth, timeout_s=120.0, progress=False)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace]) as s:
            res = await replay(reqs, opts, session=s)
        unfinished = await self._wait_journeys(r, seen.accepted_ids)
        sampler_stop.set()
        await sampler
        out = phase_summary(res.records, seen, unfinished, self.tenant.name, self.sla[self.tenant.name], rate,
                            duration_s, settle_s)
        if measure:
            out["peak_rss_mib"] = {name: _hwm_mib(pid) for name, pid in sorted(pids.items())}
            info = await r.info("memory")
            out["redis_used_memory_peak_mib"] = info["used_memory_peak"] / 2**20
            out["redis_used_memory_max_sampled_mib"] = sampled["used_memory_max"] / 2**20
        await r.aclose()
        return out

    async def _pids(self, r) -> dict[str, int]:
        pids = {}
        async for k in r.scan_iter(match=f"{self.prefix}health:*"):
            h = {a.decode(): b.decode() for a, b in (await r.hgetall(k)).items()}
            if h.get("pid", "").isdigit():
                svc = h.get("service", "?")
                pids[svc if svc != "worker" else f"worker {h.get('name', '?')}"] = int(h["pid"])
        if self.launcher.redis_server is not None and self.launcher.redis_server.proc is not None:
            pids["redis-server"] = self.launcher.redis_server.proc.pid
        return pids

    @staticmethod
    async def _sample_redis(r, stop: asyncio.Event, out: dict) -> None:
        while not stop.is_set():
            try:
                out["used_memory_max"] = max(out["used_memory_max"], (await r.info("memory"))["used_memory"])
            except Exception:  # sampling is best effort; a missed sample only lowers the sampled max
                pass
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def _wait_journeys(self, r, rids: list[str], timeout_s: float = 15.0) -> list[str]:
        """Accepted request ids whose Redis journey has no terminal state once the mesh has settled."""
        from shared.requests_state import TERMINAL_STATES, req_key

        deadline = time.monotonic() + timeout_s
        left = list(rids)
        while left:
            pipe = r.pipeline(transaction=False)
            for rid in left:
                pipe.hget(req_key(self.prefix, rid), "state")
            states = await pipe.execute()
            left = [rid for rid, st in zip(left, states) if st is None or st.decode() not in TERMINAL_STATES]
            if not left or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        return left

    # ------------------------------------------------------------ capacity
    def probe(self, rate: float) -> bool:
        """Does the mesh sustain ``rate``? Violations are counted after a settling fifth of the probe, and a
        failing probe is repeated once (a shared machine has bursts of contention)."""
        for attempt in range(2):
            n = len(self.probes)
            res = asyncio.run(self.offer(rate, self.args.search_s, self.args.seed + 1000 + n, f"probe{n}",
                                         measure=False, settle_s=self.args.search_s / 5))
            ok = res["steady_violation_rate"] <= self.args.max_violation
            self.probes.append({"rate": rate, "ok": ok, "steady_violation_rate": res["steady_violation_rate"],
                                "violation_rate": res["violation_rate"], "sent": res["sent"],
                                "accepted": res["accepted"]})
            print(f"  probe {rate:7.2f} req/s: violations {res['steady_violation_rate']:.1%} -> "
                  f"{'ok' if ok else 'over'}", file=sys.stderr, flush=True)
            time.sleep(1.0)
            if ok:
                return True
        return False

    def find_capacity(self) -> float:
        """Double from the start rate until a probe fails, then bisect; the largest passing rate."""
        self.probes = []
        lo, hi, rate = 0.0, None, self.args.search_start_rps
        for _ in range(8):
            if not self.probe(rate):
                hi = rate
                break
            lo, rate = rate, rate * 2
        if hi is None:
            return lo
        while lo == 0.0 and hi > 0.25:  # even the start rate failed: halve until one passes
            rate = hi / 2
            lo, hi = (rate, hi) if self.probe(rate) else (0.0, rate)
        for _ in range(self.args.search_steps):
            rate = (lo + hi) / 2
            lo, hi = (rate, hi) if self.probe(rate) else (lo, rate)
        return lo


def phase_summary(recs, seen: Seen, unfinished: list[str], tenant: str, sla, rate: float, duration_s: float,
                  settle_s: float) -> dict[str, Any]:
    """The figures of one phase from the client's records, the response headers and the unfinished journeys."""
    from loadgen.report import summarize, violates

    summ = summarize(recs, {tenant: sla}, tenants=[tenant])
    g, window = summ["total"], summ["duration_s"]
    accepted = [x for x in recs if x.http_status == 200]
    met = [x for x in accepted if x.status == "ok" and not violates(x, sla)]
    client_lost = [x for x in accepted if x.status == "timeout" or x.error == "stream ended before [DONE]"]
    steady = [x for x in recs if x.arrival_s >= settle_s and x.status != "cancelled"]
    return {
        "offered_rps": rate, "duration_s": duration_s, "sent": len(recs), "window_s": window,
        "accepted": len(accepted), "completed": g["completed"], "violation_rate": g["violation_rate"],
        "steady_violation_rate": sum(violates(x, sla) for x in steady) / len(steady) if steady else 0.0,
        "tokens_per_s": g["tokens_per_s"],
        "goodput_tokens_per_s": sum(x.output_tokens for x in met) / window if window else 0.0,
        "rejected_429": seen.statuses[429], "retry_after_429": seen.retry_after_ok[429],
        "rejected_503": seen.statuses[503], "retry_after_503": seen.retry_after_ok[503],
        "other_errors": sum(n for st, n in seen.statuses.items() if st not in (200, 429, 503)),
        "failed_after_accept": sum(1 for x in accepted if x.status != "ok"),
        "accepted_ttft_s": g["ttft_s"], "accepted_e2e_s": g["e2e_s"], "accepted_tpot_s": g["tpot_s"],
        "accepted_sla_attainment": len(met) / len(accepted) if accepted else None,
        "accepted_over_ttft": sum(1 for x in accepted if x.ttft_s is not None and x.ttft_s > sla.ttft_s),
        "accepted_over_tpot": sum(1 for x in accepted if x.tpot_s is not None and x.tpot_s > sla.tpot_s),
        # client side (no [DONE], no error event) plus journey side (no terminal state in Redis): an upper bound
        "lost": len(client_lost) + len(unfinished), "lost_client": len(client_lost), "lost_journey": unfinished,
        "max_send_lag_s": max((x.send_lag_s for x in recs), default=0.0),
        "reject_reasons": dict(Counter(f"{x.http_status} {re.sub(r'[0-9.]+', 'N', x.error or '')[:70]}"
                                       for x in recs if x.http_status in RETRY_STATUSES).most_common(4)),
    }


def _reset_hwm(pid: int) -> None:
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _ms(q: dict, k: str = "p99") -> str:
    v = q.get(k) if q else None
    return "–" if v is None else f"{v * 1000:.0f}"


def render_table(result: dict[str, Any]) -> str:
    """Markdown: one row per multiplier, then peak RSS per service."""
    rows = result["phases"]
    lines = ["| load | offered req/s | sent | accepted | goodput tok/s | 429 (Retry-After) | 503 (Retry-After) | "
             "accepted p99 TTFT ms | accepted p99 E2E ms | accepted SLA attainment | lost | Redis peak MiB |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for m, ph in rows.items():
        att = ph["accepted_sla_attainment"]
        lines.append(f"| {m}x | {ph['offered_rps']:.1f} | {ph['sent']} | {ph['accepted']} | "
                     f"{ph['goodput_tokens_per_s']:.0f} | {ph['rejected_429']} ({ph['retry_after_429']}) | "
                     f"{ph['rejected_503']} ({ph['retry_after_503']}) | {_ms(ph['accepted_ttft_s'])} | "
                     f"{_ms(ph['accepted_e2e_s'])} | {'–' if att is None else f'{att:.1%}'} | {ph['lost']} | "
                     f"{ph['redis_used_memory_peak_mib']:.1f} |")
    names = sorted({n for ph in rows.values() for n in ph["peak_rss_mib"]})
    lines += ["", "| peak RSS (VmHWM, MiB) | " + " | ".join(f"{m}x" for m in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    for n in names:
        vals = [ph["peak_rss_mib"].get(n) for ph in rows.values()]
        lines.append(f"| {n} | " + " | ".join("–" if v is None else f"{v:.0f}" for v in vals) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from services.launcher import Launcher

    try:
        mults = [float(x) for x in args.multipliers.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("arguments", "--multipliers", f"expected numbers separated by commas, got "
                                                        f"{args.multipliers!r}") from None
    if not mults or any(m <= 0 for m in mults) or args.duration_s <= 0:
        raise ConfigError("arguments", "--multipliers/--duration-s", "must be positive")
    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    try:
        tenant = tenants.get(args.tenant) if args.tenant else tenants.tenants[0]
    except KeyError:
        raise ConfigError(tenants.source, "tenants", f"no tenant named {args.tenant!r}") from None
    keys = dev_api_keys(args.tenants).get(tenant.name) or []
    if not keys:
        raise ConfigError(tenants.source, f"{tenant.name}.api_keys", "the bench needs a plain-text dev key")
    env = {}
    if args.max_inflight is not None:
        env["SLICESCHED_MAX_INFLIGHT"] = str(args.max_inflight)
    if args.admit_sla_fraction is not None:
        env["SLICESCHED_ADMIT_SLA_FRACTION"] = str(args.admit_sla_fraction)
    from services.gateway.core import GatewayLimits
    limits = GatewayLimits.from_env({**os.environ, **env})  # what the gateway will run with (a bad value: now)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="slicesched-overload-") as tmp:
        launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()),
                            tenants_file=str(Path(args.tenants).resolve()), data_dir=Path(tmp), gateway_port=0,
                            extra_env=env, policy=args.policy)
        launcher.start()
        try:
            bench = Bench(launcher, tenant, keys[0], args)
            asyncio.run(bench.offer(args.search_start_rps / 2, 5.0, args.seed + 999, "warmup", measure=False))
            if args.capacity_rps:
                capacity = args.capacity_rps
            else:
                print("searching for capacity ...", file=sys.stderr, flush=True)
                capacity = bench.find_capacity()
            print(f"capacity: {capacity:.2f} req/s", file=sys.stderr, flush=True)
            phases = {}
            for i, m in enumerate(sorted(mults)):
                label = f"{m:g}"
                phases[label] = asyncio.run(bench.offer(m * capacity, args.duration_s, args.seed + i, f"x{label}",
                                                        measure=True))
                ph = phases[label]
                print(f"  {label}x: sent {ph['sent']}, accepted {ph['accepted']}, goodput "
                      f"{ph['goodput_tokens_per_s']:.0f} tok/s, lost {ph['lost']}", file=sys.stderr, flush=True)
                time.sleep(2.0)
        finally:
            launcher.stop(drain_s=10)
    result = {"tenant": tenant.name, "sla_ms": {"ttft": tenant.sla.ttft_ms, "tpot": tenant.sla.tpot_ms},
              "bounds": {"max_queue": tenant.max_queue, "quota": vars(tenant.quota),
                         "max_inflight": limits.max_inflight, "admit_sla_fraction": limits.admit_sla_fraction},
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "policy": args.policy,
              "capacity_rps": capacity, "max_violation": args.max_violation, "probes": bench.probes, "phases": phases,
              "machine": f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, no GPU",
              "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(["slicesched", *sys.argv[1:]])}
    print(f"capacity {capacity:.2f} req/s (violations <= {args.max_violation:.0%}), tenant {tenant.name}, "
          f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens")
    print(render_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
