"""The guest process of ``slicesched bench guest``: a segment server in its own process (one torch thread, like a
``cpu`` worker), serving either an echo (pure RPC cost) or the real guest path (:class:`GuestHost` with a lease of
every MLP segment of a seeded model, weights regenerated from the seed). Prints ``READY <addr> <transport addr>``
and serves until its stdin closes.

``python -m bench.bench_guest_peer --mode echo|mlp --server thread|asyncio --backend none|shm|tcp``
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch

from services.worker.device_lock import DeviceLock
from services.worker.guest import GuestHost, StagedWeights
from services.worker.segment_server import AsyncSegmentServer, Reply, SegmentServer, TensorMover
from services.worker.segment_wire import SegmentCall, SegmentResult, wire_dtype
from shared.model.config import PRESETS
from shared.model.llama import LlamaModel

GUEST, DRIVER = "bench-guest", "bench-driver"


class Echo:
    """Sends the hidden states straight back: what one call costs without any compute."""

    def __init__(self, mover: TensorMover) -> None:
        self.mover = mover

    def handle(self, msg, payload: bytearray) -> Reply:
        if not isinstance(msg, SegmentCall):
            return []
        t = self.mover.unpack(msg.shape, msg.dtype, msg.handle, payload)
        handle, body = self.mover.pack(t, DRIVER)
        return [(SegmentResult(call_id=msg.call_id, shape=list(t.shape), dtype=wire_dtype(t), handle=handle), body)]


def make_transport(backend: str):
    """The guest side of the tensor transport for ``--backend``."""
    if backend == "shm":
        from shared.transport import ShmTransport
        return ShmTransport(GUEST)
    if backend == "tcp":
        from shared.transport import TcpTransport
        return TcpTransport(GUEST, bind_host="127.0.0.1", port=0)
    return None


async def serve(args: argparse.Namespace) -> None:
    """Start the transport and the server, print READY, serve until stdin closes."""
    torch.set_num_threads(1)
    loop = asyncio.get_running_loop()
    transport = make_transport(args.backend)
    if transport is not None:
        await transport.start()
    mover = TensorMover(GUEST, transport, loop, inline_max_bytes=args.inline_max)
    if args.mode == "echo":
        handler = Echo(mover)
    else:
        cfg = PRESETS[args.preset]
        model = LlamaModel(cfg, seed=args.seed)
        handler = GuestHost(GUEST, {"t": cfg}, DeviceLock(), StagedWeights("cpu"),
                            lambda lease, seg: model.segment_state_dict(seg), mover)
        segs = [s for s in model.segments if s.startswith("mlp")]
        handler.grant("bench", "t", DRIVER, segs, time.time() + 86400, 1.0)
        while handler.leases["bench"].state == "staging":
            await asyncio.sleep(0.01)
    if args.server == "asyncio":
        server = AsyncSegmentServer(handler)
        addr = await server.start()
    else:
        server = SegmentServer(handler, torch_threads=1)
        addr = server.start()
    print("READY", addr, flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin
    if isinstance(server, AsyncSegmentServer):
        await server.close()
    else:
        server.close()
    if transport is not None:
        await transport.close()


def main() -> int:
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries READY only
    ap = argparse.ArgumentParser(prog="python -m bench.bench_guest_peer")
    ap.add_argument("--mode", choices=("echo", "mlp"), default="echo")
    ap.add_argument("--server", choices=("thread", "asyncio"), default="thread")
    ap.add_argument("--backend", choices=("none", "shm", "tcp"), default="none")
    ap.add_argument("--inline-max", type=int, default=1 << 20)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(serve(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
