"""``slicesched bench transport``: latency and bandwidth of each tensor transport backend vs message size.

The sender is this process, the receiver a peer process (``python -m shared.transport.peer``) on the same host.
Per iteration: ``send`` is timed here, the handle goes to the peer over a pipe (in the mesh it goes over Redis;
that hop is not counted), and the peer times its ``recv`` into a preallocated tensor. ``latency`` is send + recv
time; bandwidth is bytes / median latency. CUDA backends are measured only where a GPU is present.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import socket
import time

import msgspec
import numpy as np
import torch

from shared.config import ConfigError
from shared.transport.base import TRANSPORTS, TransportLimits
from shared.transport.peer import NcclPeerOptions, PeerProcess, PeerRecv, PeerStart

BACKENDS = ("shm", "tcp", "cuda_ipc", "nccl", "nccl-gloo")
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """``4K``/``64K``/``1M``/``16M``/``1G`` or a byte count; a multiple of 4 (sent as float32)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError("command line", "--sizes", f"bad size {text!r} (examples: 4K, 64K, 1M, 16M)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n <= 0 or n % 4:
        raise ConfigError("command line", "--sizes", f"size {text!r} must be a positive multiple of 4 bytes")
    return n


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``slicesched bench transport``."""
    parser.add_argument("--backends", default="shm,tcp", help=f"comma list of {', '.join(BACKENDS)}")
    parser.add_argument("--sizes", default="4K,64K,1M,16M", help="comma list of message sizes")
    parser.add_argument("--iters", type=int, default=100, help="timed iterations per backend and size")
    parser.add_argument("--warmup", type=int, default=10, help="untimed iterations first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in each process (workers run with cluster.yaml's threads, default 1)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")


def _machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core CPU ({platform.machine()}, {platform.system()}), {gpu}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(backend: str) -> str | None:
    if backend in ("cuda_ipc", "nccl") and not torch.cuda.is_available():
        return "not measured: no GPU on this machine"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return "not measured: NCCL point-to-point needs two GPUs (one rank per GPU)"
    return None


async def _bench_backend(backend: str, sizes: list[int], iters: int, warmup: int, threads: int) -> list[dict]:
    largest = max(sizes)
    limits = TransportLimits(max_transfer_bytes=largest, max_inflight_bytes=4 * largest, stale_after_s=60)
    cuda = backend in ("cuda_ipc", "nccl")
    device = "cuda:0" if backend == "cuda_ipc" else ("cuda:1" if backend == "nccl" else "cpu")
    peer = await PeerProcess.spawn()
    name = "nccl" if backend.startswith("nccl") else backend
    start = PeerStart(device_id="recv", backends=[name], max_transfer_bytes=limits.max_transfer_bytes,
                      max_inflight_bytes=limits.max_inflight_bytes, torch_device=device, torch_threads=threads)
    if name == "nccl":
        ranks = {"send": 0, "recv": 1}
        opts = NcclPeerOptions(rank=1, world_size=2, store_addr=f"127.0.0.1:{_free_port()}", peer_ranks=ranks,
                               dist_backend="gloo" if backend == "nccl-gloo" else "nccl")
        start = msgspec.structs.replace(start, nccl=opts)
        tr = TRANSPORTS.get("nccl")("send", limits, rank=0, world_size=2, store_addr=opts.store_addr,
                                    peer_ranks=ranks, dist_backend=opts.dist_backend,
                                    torch_device="cuda:0" if cuda else "cpu")
        started, _ = await asyncio.gather(peer.call(start), tr.start())
    else:
        tr = TRANSPORTS.get(name)("send", limits)
        started = await peer.call(start)
    if not started.ok:
        raise RuntimeError(f"peer failed to start {backend}: {started.error}")
    rows = []
    try:
        for size in sizes:
            x = torch.randn(size // 4, device="cuda:0" if cuda else "cpu")
            send_s, recv_s, iter_s = [], [], []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                h = await tr.send(x, "recv", f"b{size}-{i}", 30.0)
                t1 = time.perf_counter()
                reply = await peer.call(PeerRecv(handle=h, timeout_s=30.0, use_out=True))
                if not reply.ok:
                    raise RuntimeError(f"{backend} recv failed: {reply.error}")
                if i >= warmup:
                    send_s.append(t1 - t0)
                    recv_s.append(reply.seconds)
                    iter_s.append(time.perf_counter() - t0)
            lat = np.array(send_s) + np.array(recv_s)
            p50 = float(np.percentile(lat, 50))
            rows.append({"bytes": size, "iters": iters, "p50_ms": p50 * 1e3, "p99_ms": _ms(lat, 99),
                         "send_p50_ms": _ms(send_s, 50), "recv_p50_ms": _ms(recv_s, 50), "gbps": size / p50 / 1e9,
                         "iteration_p50_ms": _ms(iter_s, 50)})
            print(f"{backend:>9} {_fmt(size):>6}  p50 {rows[-1]['p50_ms']:8.3f} ms  p99 {rows[-1]['p99_ms']:8.3f} ms  "
                  f"{rows[-1]['gbps']:7.3f} GB/s", flush=True)
    finally:
        await peer.stop()
        await tr.close()
    return rows


def _ms(seconds, q: float) -> float:
    return float(np.percentile(seconds, q)) * 1e3


def _fmt(n: int) -> str:
    for unit, div in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Measure each requested backend, print a table, write ``--json``."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ConfigError("command line", "--backends", f"unknown backend {b!r}; valid: {', '.join(BACKENDS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or not backends:
        raise ConfigError("command line", "--sizes/--backends", "give at least one size and one backend")
    if args.iters <= 0 or args.warmup < 0 or args.threads <= 0:
        raise ConfigError("command line", "--iters", "iters and threads must be positive, warmup non-negative")
    torch.set_num_threads(args.threads)
    command = (f"slicesched bench transport --backends {','.join(backends)} --sizes {args.sizes} "
               f"--iters {args.iters} --warmup {args.warmup} --threads {args.threads}")
    if args.json_out:
        command += f" --json {args.json_out}"
    result = {"benchmark": "transport", "command": command,
              "machine": _machine(), "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
              "iters": args.iters, "warmup": args.warmup, "load_average_1m_at_start": os.getloadavg()[0],
              "method": "latency = sender send() + receiver recv() into a preallocated tensor, receiver in another "
                        "process on this host; handle delivery between them not counted; GB/s = bytes / p50",
              "results": {}}
    for b in backends:
        why = _unavailable(b)
        if why:
            print(f"{b:>9}  {why}")
            result["results"][b] = {"status": why}
            continue
        rows = asyncio.run(_bench_backend(b, sizes, args.iters, args.warmup, args.threads))
        result["results"][b] = {"status": "measured", "sizes": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
