"""``slicesched bench guest``: what guest execution costs and gains on this machine.

1. Per-call cost of the segment RPC: a guest process echoes hidden states back (no compute); round trip per
   server kind (threaded blocking sockets vs asyncio) and tensor path (inline bytes vs the shm/tcp transport).
2. Step time of a tenant's decode batch alone (``Engine.step``), split in two micro-batches but all at home, and
   with every MLP segment leased to an idle guest process (``pipelined_step``, two micro-batches).
Both processes use one torch thread, as ``cpu`` workers do with ``threads: 1``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shared.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``slicesched bench guest``."""
    parser.add_argument("--presets", default="tiny,small", help="model presets for the step benchmark")
    parser.add_argument("--batches", default="16,32", help="decode batch sizes for the step benchmark")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per configuration")
    parser.add_argument("--rpc-rows", default="8,16,64,256", help="hidden-state rows per RPC (tiny: 1 KiB per row)")
    parser.add_argument("--rpc-iters", type=int, default=300, help="timed calls per RPC configuration")
    parser.add_argument("--prefill-tokens", type=int, default=64,
                        help="also time prefill steps of --batches prompts of this many tokens (0: skip)")
    parser.add_argument("--skip-rpc", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("command line", field, f"expected a comma list of integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise ConfigError("command line", field, "values must be positive")
    return out


class Peer:
    """A guest process started with ``bench.bench_guest_peer``."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.bench_guest_peer", *args], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]  # the peer logs to stderr
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"bench peer did not start: {line!r}")
        self.addr = line.split()[1]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _loop_thread():
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def _transport(backend: str, loop):
    import asyncio

    from bench.bench_guest_peer import DRIVER
    if backend == "none":
        return None
    from shared.transport import ShmTransport, TcpTransport
    t = ShmTransport(DRIVER) if backend == "shm" else TcpTransport(DRIVER, bind_host="127.0.0.1", port=0)
    asyncio.run_coroutine_threadsafe(t.start(), loop).result(10)
    return t


def bench_rpc(rows_list: list[int], iters: int) -> list[dict]:
    """Round trip of echo calls per (server, path, rows)."""
    from bench.bench_guest_peer import GUEST
    from services.worker.segment_server import SegmentClient, TensorMover

    loop = _loop_thread()
    out = []
    for server, backend in (("thread", "none"), ("asyncio", "none"), ("thread", "shm"), ("thread", "tcp")):
        inline_max = 1 << 30 if backend == "none" else 0
        peer = Peer("--mode", "echo", "--server", server, "--backend", backend, "--inline-max", str(inline_max))
        transport = _transport(backend, loop)
        mover = TensorMover("bench-driver", transport, loop, inline_max_bytes=inline_max)
        client = SegmentClient(peer.addr)
        try:
            for rows in rows_list:
                x = torch.randn(rows, 256)
                times = []
                for i in range(iters + 30):
                    t0 = time.perf_counter()
                    cid = client.call("bench", "t", "mlp[0]", 0, x, mover, GUEST, 5.0)
                    res, payload = client.result(cid, time.monotonic() + 5)
                    y = mover.unpack(res.shape, res.dtype, res.handle, payload)
                    if i >= 30:
                        times.append((time.perf_counter() - t0) * 1e6)
                assert torch.equal(y, x)
                times.sort()
                out.append({"server": server, "path": "inline" if backend == "none" else backend, "rows": rows,
                            "bytes": x.numel() * 4, "p50_us": round(statistics.median(times), 1),
                            "p90_us": round(times[int(0.9 * len(times))], 1), "iters": iters})
                print(json.dumps(out[-1]), flush=True)
        finally:
            client.close()
            peer.close()
            if transport is not None:
                import asyncio
                asyncio.run_coroutine_threadsafe(transport.close(), loop).result(10)
    return out


def _engine(preset: str, batch: int, prefill: int = 0):
    from shared.model.config import PRESETS
    from shared.model.engine import Engine, SamplingParams
    from shared.model.llama import LlamaModel
    from shared.model.tokenizer import load_tokenizer

    cfg = PRESETS[preset]
    model = LlamaModel(cfg, seed=0)
    eng = Engine(model, load_tokenizer(None, cfg), kv_blocks=batch * (40 + prefill // 16), block_size=16,
                 max_batch_tokens=max(4096, batch * prefill), max_running=batch)
    if not prefill:
        for i in range(batch):
            eng.add(f"r{i}", [3 + (i * 7 + j) % 200 for j in range(32)],
                    SamplingParams(max_tokens=500, ignore_eos=True))
        eng.step()  # prefill; the timed steps decode
    return eng


def _timed(step):
    def run() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    return run


class _Prefill:
    """A step that prefills ``batch`` fresh prompts of ``tokens`` tokens (then drops them)."""

    def __init__(self, eng, batch: int, tokens: int, step) -> None:
        self.eng, self.batch, self.tokens, self.step, self.n = eng, batch, tokens, step, 0

    def __call__(self) -> float:
        from shared.model.engine import SamplingParams
        ids = [f"p{self.n}-{i}" for i in range(self.batch)]
        self.n += 1
        for i, rid in enumerate(ids):
            self.eng.add(rid, [3 + (i * 5 + j) % 200 for j in range(self.tokens)], SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        self.step()
        dt = time.perf_counter() - t0
        for rid in ids:
            self.eng.cancel(rid)
        return dt


def bench_steps(presets: list[str], batches: list[int], steps: int, prefill: int = 0) -> list[dict]:
    """Median step time alone / split at home / leased; decode steps, or prefill steps of ``prefill`` tokens."""
    from services.worker.driver import DriverLink, DriverOptions, LeaseRemote
    from services.worker.segment_server import SegmentClient, TensorMover
    from shared.messages import LeaseGranted
    from shared.model.pipeline import pipelined_step

    out = []
    for preset in presets:
        peer = Peer("--mode", "mlp", "--preset", preset, "--seed", "0")
        try:
            for batch in batches:
                row: dict = {"preset": preset, "batch": batch, "kind": f"prefill {prefill}" if prefill else "decode",
                             "steps": steps}
                for mode in ("alone", "split_local", "leased"):
                    eng = _engine(preset, batch, prefill)
                    link = None
                    if mode == "leased":
                        segs = [s for s in eng.model.segments if s.startswith("mlp")]
                        msg = LeaseGranted(msg_id="b", lease_id="bench", tenant="t", home_device="bench-driver",
                                           guest_device="bench-guest", segments=segs, start_ts=0, end_ts=1e12)
                        link = DriverLink(msg, state="ready", client=SegmentClient(peer.addr))
                        remote = LeaseRemote({s: link for s in segs}, TensorMover("bench-driver"),
                                             torch.device("cpu"), DriverOptions(timeout_floor_ms=2000))
                        step = lambda: pipelined_step(eng, remote, 2)  # noqa: E731
                    elif mode == "split_local":
                        step = lambda: pipelined_step(eng, None, 2)  # noqa: E731
                    else:
                        step = eng.step
                    timed = _Prefill(eng, batch, prefill, step) if prefill else _timed(step)
                    for _ in range(5):
                        timed()
                    times = [timed() * 1e3 for _ in range(steps)]
                    row[f"{mode}_ms"] = round(statistics.median(times), 2)
                    if link is not None:
                        row["fallbacks"] = link.fallbacks
                        link.client.close()
                row["speedup"] = round(row["alone_ms"] / row["leased_ms"], 3)
                out.append(row)
                print(json.dumps(row), flush=True)
        finally:
            peer.close()
    return out


def run(args: argparse.Namespace) -> int:
    """Run the selected parts; print one JSON line per result; optionally write them all to ``--json``."""
    rows = _ints(args.rpc_rows, "--rpc-rows")
    batches = _ints(args.batches, "--batches")
    presets = [p for p in args.presets.split(",") if p]
    from shared.model.config import PRESETS
    bad = [p for p in presets if p not in PRESETS]
    if bad:
        raise ConfigError("command line", "--presets", f"unknown {bad}; valid: {', '.join(PRESETS)}")
    if args.steps <= 0 or args.rpc_iters <= 0:
        raise ConfigError("command line", "--steps/--rpc-iters", "must be positive")
    torch.set_num_threads(1)  # one torch thread per process, as a cpu worker with threads: 1
    result = {"machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), no GPU" if not torch.cuda.is_available()
              else torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
              "torch": torch.__version__, "threads_per_process": 1}
    if not args.skip_rpc:
        result["rpc"] = bench_rpc(rows, args.rpc_iters)
    if not args.skip_steps:
        result["steps"] = bench_steps(presets, batches, args.steps)
        if args.prefill_tokens > 0:
            result["steps"] += bench_steps(presets, batches, max(5, args.steps // 4), args.prefill_tokens)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
