"""``slicesched bench overhead``: time per output token through the full mesh (gateway -> Redis -> scheduler ->
worker -> Redis -> gateway -> client) against the same model's in-process decode step, at several batch sizes."""
from __future__ import annotations

from services.launcher import MEASURE_ENV

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shared.argtypes import positive_int
from shared.config import REPO_CONFIGS, dev_api_keys, load_cluster, load_tenants


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-tiny.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-tiny.yaml"))
    p.add_argument("--tenant", default=None, help="tenant to measure (default: the first)")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=positive_int, default=64, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=positive_int, default=16)
    p.add_argument("--policy", default="container",
                   help="the mesh's policy (container: the serving path alone, no leases; docs/benchmarks.md)")
    p.add_argument("--repeat", type=positive_int, default=3, help="rounds per batch size (median reported)")
    p.add_argument("--json", dest="json_out", default=None)


def _in_process(tenant, batch: int, tokens: int, prompt_len: int) -> float:
    """Median decode-step time (s) of the engine alone at ``batch`` running sequences, one CPU thread."""
    import torch

    from shared.model.engine import Engine, SamplingParams
    from shared.model.loader import build_model

    torch.set_num_threads(1)
    model, tok = build_model(tenant.model)
    eng = Engine(model, tok, kv_blocks=4096, max_batch_tokens=max(256, batch * prompt_len))
    for i in range(batch):
        eng.add(f"r{i}", [tok.bos_token_id] + [65 + i % 26] * (prompt_len - 1),
                SamplingParams(max_tokens=tokens, ignore_eos=True))
    times = []
    while eng.has_work():
        r = eng.step()
        if r.prefill_tokens == 0 and r.decode_tokens == batch:
            times.append(r.step_ms / 1e3)
    return statistics.median(times)


async def _mesh_round(url: str, key: str, model: str, batch: int, tokens: int, prompt_len: int) -> list[float]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> float:
        body = {"model": model, "prompt": "A" * (prompt_len - 1), "max_tokens": tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first, n = None, 0
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and first is None:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        # TPOT as the field defines it: (E2E - TTFT) / (output tokens - 1)
        return (end - first) / max(1, n - 1)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        return list(await asyncio.gather(*(one(s, i) for i in range(batch))))


def run(args: argparse.Namespace) -> int:
    from services.launcher import Launcher

    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    tenant = tenants.get(args.tenant) if args.tenant else tenants.tenants[0]
    key = dev_api_keys(args.tenants)[tenant.name][0]
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for b in batches:
        results[b] = {"in_process_step_ms": statistics.median(
            _in_process(tenant, b, args.tokens, args.prompt_tokens) for _ in range(args.repeat)) * 1e3}
        print(f"in-process batch {b}: {results[b]['in_process_step_ms']:.3f} ms/step", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="slicesched-bench-") as tmp:
        launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()),
                            tenants_file=str(Path(args.tenants).resolve()), data_dir=Path(tmp), gateway_port=0,
                            extra_env=MEASURE_ENV, policy=args.policy)
        launcher.start()
        try:
            for b in batches:
                asyncio.run(_mesh_round(launcher.gateway_url, key, tenant.name, 1, 8, args.prompt_tokens))  # warm-up
                rounds = [statistics.median(asyncio.run(_mesh_round(launcher.gateway_url, key, tenant.name, b,
                                                                    args.tokens, args.prompt_tokens)))
                          for _ in range(args.repeat)]
                tpot = statistics.median(rounds) * 1e3
                step = _mesh_step_ms(launcher.redis_url, tenant.home_devices[0], b)
                results[b].update(mesh_tpot_ms=tpot, added_ms_per_token=tpot - results[b]["in_process_step_ms"],
                                  mesh_worker_step_ms=step, token_path_ms=tpot - step)
                print(f"mesh batch {b}: {tpot:.3f} ms/token", file=sys.stderr)
        finally:
            launcher.stop(drain_s=10)
    out = {"tenant": tenant.name, "model": tenant.model.preset, "output_tokens": args.tokens,
           "prompt_tokens": args.prompt_tokens, "policy": args.policy,
           "batches": {str(k): v for k, v in results.items()},
           "machine": _machine(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print("| batch | in-process decode step (ms) | mesh time per output token (ms) | added by the mesh (ms/token) "
          "| worker step inside the mesh (ms) | token path beyond the step (ms) |")
    print("|---|---|---|---|---|---|")
    for b, r in results.items():
        print(f"| {b} | {r['in_process_step_ms']:.3f} | {r['mesh_tpot_ms']:.3f} | {r['added_ms_per_token']:.3f} "
              f"| {r['mesh_worker_step_ms']:.3f} | {r['token_path_ms']:.3f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


def _mesh_step_ms(redis_url: str, device: str, batch: int) -> float:
    """Decode-step compute time the worker measured inside the mesh: the sum of its segment times per step, for
    steps of ``batch`` rows (from its StepReports on the events stream)."""
    import redis as syncredis

    from services.worker.core import tokens_bucket
    from shared.codec import decode
    from shared.messages import EventsMsg, StepReport, events_stream

    r = syncredis.Redis.from_url(redis_url)
    bucket, total_ms, steps = tokens_bucket(batch), 0.0, 0
    try:
        for _id, f in r.xrange(events_stream("slicesched:"), count=500_000):
            m = decode(f[b"m"], EventsMsg)
            if isinstance(m, StepReport) and m.device == device:
                for st in m.segments:
                    if st.tokens_bucket == bucket:
                        total_ms += st.total_ms
                        steps += st.count if st.segment == "embed" else 0
    finally:
        r.close()
    return total_ms / max(1, steps)


def _machine() -> str:
    import os
    import platform

    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, Python {platform.python_version()}"
