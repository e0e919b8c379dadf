"""A transport peer in its own OS process, driven over stdin/stdout: the far end for tests and the benchmark.

``python -m shared.transport.peer`` reads length-prefixed MessagePack commands on stdin and answers on stdout
(logs go to stderr). The child is a fresh interpreter (nothing inherited, as with multiprocessing's spawn start
method) and nothing is pickled: commands and replies are msgspec Structs. :class:`PeerProcess` is the parent's
side.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import sys
import time
from pathlib import Path

import msgspec
import torch

from shared.transport.base import TensorHandle, TransportLimits, byte_view, torch_dtype

_LEN = struct.Struct("<I")
REPO_ROOT = Path(__file__).resolve().parents[2]


class NcclPeerOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Process-group membership for a peer's nccl transport."""

    rank: int
    world_size: int
    store_addr: str
    peer_ranks: dict[str, int]
    dist_backend: str = "gloo"


class PeerStart(msgspec.Struct, frozen=True, kw_only=True, tag="start"):
    """Create and start the peer's transports."""

    device_id: str
    backends: list[str]
    max_transfer_bytes: int = 256 * 1024**2
    max_inflight_bytes: int = 1024**3
    stale_after_s: float = 30.0
    nccl: NcclPeerOptions | None = None
    torch_device: str = "cpu"
    torch_threads: int = 1  # like a worker (cluster.yaml ``threads``); 2 processes x N threads oversubscribe


class PeerSend(msgspec.Struct, frozen=True, kw_only=True, tag="send"):
    """Send a seeded tensor; the reply carries the handle and the tensor's digest."""

    transfer_id: str
    backend: str
    dst_device: str
    shape: list[int]
    dtype: str
    seed: int
    timeout_s: float = 10.0


class PeerRecv(msgspec.Struct, frozen=True, kw_only=True, tag="recv"):
    """Receive by handle; the reply carries the digest, the recv time and the echo's handle."""

    handle: TensorHandle
    timeout_s: float = 10.0
    use_out: bool = False
    echo_id: str = ""  # when set: send the received tensor back to its source under this transfer id


class PeerStop(msgspec.Struct, frozen=True, kw_only=True, tag="stop"):
    """Close the transports and exit."""


class PeerReply(msgspec.Struct, frozen=True, kw_only=True, tag="reply"):
    """The answer to any command; ``ok=False`` carries the exception's type and message."""

    ok: bool
    error: str = ""
    error_type: str = ""
    pid: int = 0
    digest: str = ""
    seconds: float = 0.0
    handle: TensorHandle | None = None
    info: dict[str, str] = {}


Command = PeerStart | PeerSend | PeerRecv | PeerStop
_enc = msgspec.msgpack.Encoder()
_dec_cmd = msgspec.msgpack.Decoder(Command)
_dec_reply = msgspec.msgpack.Decoder(PeerReply)


def digest(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and raw bytes: equal digests mean bit-identical tensors."""
    h = hashlib.sha256(f"{t.dtype}:{list(t.shape)}:".encode())
    h.update(byte_view(t.cpu()).numpy().tobytes())
    return h.hexdigest()


def seeded_tensor(shape: list[int], dtype: str, seed: int, device: str = "cpu") -> torch.Tensor:
    """A reproducible tensor with a spread of values (negative, fractional, large) in any supported dtype."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1000).to(torch_dtype(dtype)).to(device)


# ---------------------------------------------------------------- child side
class _Peer:
    def __init__(self) -> None:
        self.transports: dict = {}
        self.device = "cpu"
        self.outs: dict[tuple, torch.Tensor] = {}  # reused like a worker's activation buffers

    async def handle(self, cmd: Command) -> PeerReply:
        if isinstance(cmd, PeerStart):
            return await self._start(cmd)
        if isinstance(cmd, PeerSend):
            t = seeded_tensor(cmd.shape, cmd.dtype, cmd.seed, self.device)
            started = time.perf_counter()
            h = await self.transports[cmd.backend].send(t, cmd.dst_device, cmd.transfer_id, cmd.timeout_s)
            return PeerReply(ok=True, handle=h, digest=digest(t), seconds=time.perf_counter() - started)
        if isinstance(cmd, PeerRecv):
            tr = self.transports[cmd.handle.backend]
            out = None
            if cmd.use_out:
                key = (tuple(cmd.handle.shape), cmd.handle.dtype)
                out = self.outs.get(key)
                if out is None:
                    out = self.outs[key] = torch.empty(key[0], dtype=torch_dtype(key[1]), device=self.device)
            started = time.perf_counter()
            t = await tr.recv(cmd.handle, cmd.timeout_s, out)
            took = time.perf_counter() - started
            echo = await tr.send(t, cmd.handle.src_device, cmd.echo_id, cmd.timeout_s) if cmd.echo_id else None
            return PeerReply(ok=True, digest=digest(t), seconds=took, handle=echo)
        for tr in self.transports.values():
            await tr.close()
        return PeerReply(ok=True)

    async def _start(self, cmd: PeerStart) -> PeerReply:
        from shared.transport.base import TRANSPORTS

        limits = TransportLimits(cmd.max_transfer_bytes, cmd.max_inflight_bytes, cmd.stale_after_s)
        self.device = cmd.torch_device
        torch.set_num_threads(cmd.torch_threads)
        info = {}
        for name in cmd.backends:
            cls = TRANSPORTS.get(name)
            if name == "nccl":
                n = cmd.nccl
                tr = cls(cmd.device_id, limits, rank=n.rank, world_size=n.world_size, store_addr=n.store_addr,
                         peer_ranks=n.peer_ranks, dist_backend=n.dist_backend, torch_device=cmd.torch_device)
            else:
                tr = cls(cmd.device_id, limits)
            await tr.start()
            self.transports[name] = tr
            if name == "tcp":
                info["tcp_endpoint"] = tr.endpoint
        return PeerReply(ok=True, pid=os.getpid(), info=info)


async def _child_main() -> None:
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints must not corrupt the frame stream
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    peer = _Peer()
    while True:
        try:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            cmd = _dec_cmd.decode(await reader.readexactly(n))
        except asyncio.IncompleteReadError:
            return
        try:
            reply = await peer.handle(cmd)
        except Exception as e:  # reported to the parent, which decides what a failure means
            reply = PeerReply(ok=False, error=str(e), error_type=type(e).__name__)
        body = _enc.encode(reply)
        os.write(out_fd, _LEN.pack(len(body)) + body)
        if isinstance(cmd, PeerStop):
            os._exit(0)  # transports are closed; skip the interpreter's slow teardown of torch


# ---------------------------------------------------------------- parent side
class PeerProcess:
    """Starts ``python -m shared.transport.peer`` and exchanges commands with it."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._lock = asyncio.Lock()

    @classmethod
    async def spawn(cls, env: dict[str, str] | None = None) -> "PeerProcess":
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shared.transport.peer",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    env=child_env, cwd=str(REPO_ROOT))
        return cls(proc)

    async def call(self, cmd: Command, timeout_s: float = 60.0) -> PeerReply:
        """Send one command and wait for its reply."""
        async with self._lock:
            body = _enc.encode(cmd)
            self.proc.stdin.write(_LEN.pack(len(body)) + body)
            await self.proc.stdin.drain()
            async with asyncio.timeout(timeout_s):
                (n,) = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))
                return _dec_reply.decode(await self.proc.stdout.readexactly(n))

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    async def stop(self) -> None:
        """Ask the child to close its transports and exit; kill it if it does not."""
        if self.proc.returncode is None:
            try:
                await self.call(PeerStop(), timeout_s=10.0)
                await asyncio.wait_for(self.proc.wait(), 10.0)
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, BrokenPipeError):
                self.kill()
        await self.proc.wait()


if __name__ == "__main__":
    asyncio.run(_child_main())
