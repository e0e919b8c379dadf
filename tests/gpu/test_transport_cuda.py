"""CUDA transports between two real processes on one GPU host (skipped without CUDA).

cuda_ipc: every dtype both ways, keep-alive released on ack, expired keep-alive refused, same-process loopback.
shm/tcp with CUDA tensors (device-to-host on send, host-to-device into ``out``). nccl: needs two GPUs.
"""
from __future__ import annotations

import asyncio
import socket
import time

import msgspec
import pytest
import torch

from shared.transport import DTYPES, CudaIpcTransport, ShmTransport, TcpTransport, TransferExpired, TransportLimits
from shared.transport.peer import NcclPeerOptions, PeerProcess, PeerRecv, PeerSend, PeerStart, digest, seeded_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SHAPES = [[], [0], [1], [7, 3], [4, 4096], [64, 1024, 8]]


@pytest.fixture
async def peer():
    p = await PeerProcess.spawn()
    yield p
    p.kill()
    await p.proc.wait()


async def _started(p: PeerProcess, backends: list[str], device: str = "cuda:0", **kw) -> None:
    reply = await p.call(PeerStart(device_id="gpu1", backends=backends, torch_device=device, **kw))
    assert reply.ok, reply.error


async def test_cuda_ipc_round_trip_every_dtype(peer):
    await _started(peer, ["cuda_ipc"])
    tr = CudaIpcTransport("gpu0")
    try:
        n = 0
        for dtype in DTYPES:
            for shape in SHAPES:
                x = seeded_tensor(shape, dtype, seed=n, device="cuda:0")
                h = await tr.send(x, "gpu1", f"to-{n}", 10.0)
                x.zero_()  # the sender may reuse its tensor at once: the handle points at a copy
                reply = await peer.call(PeerRecv(handle=h, echo_id=f"back-{n}", use_out=n % 2 == 0))
                assert reply.ok, reply.error
                expected = seeded_tensor(shape, dtype, seed=n, device="cuda:0")
                assert reply.digest == digest(expected)
                back = await tr.recv(reply.handle, 10.0, out=torch.empty_like(expected))
                assert torch.equal(back, expected)
                n += 1
        deadline = time.monotonic() + 2.0
        while tr._kept and time.monotonic() < deadline:  # the peer acked every transfer
            await asyncio.sleep(0.05)
        assert not tr._kept and tr._kept_bytes == 0
    finally:
        await peer.stop()
        await tr.close()


async def test_cuda_ipc_expired_keepalive_is_refused(peer):
    await _started(peer, ["cuda_ipc"])
    tr = CudaIpcTransport("gpu0", TransportLimits(stale_after_s=0.3))
    try:
        h = await tr.send(torch.ones(1024, device="cuda:0"), "gpu1", "late", 5.0)
        await asyncio.sleep(0.6)  # past stale_after_s; the sweep drops the keep-alive
        reply = await peer.call(PeerRecv(handle=h))
        assert not reply.ok and reply.error_type == "TransferExpired"
        h2 = await tr.send(torch.full((8,), 3.0, device="cuda:0"), "gpu1", "on-time", 5.0)
        reply = await peer.call(PeerRecv(handle=h2))
        assert reply.ok and reply.digest == digest(torch.full((8,), 3.0))
    finally:
        await tr.close()


async def test_cuda_ipc_same_process_and_zero_copy():
    tr = CudaIpcTransport("gpu0")
    try:
        x = torch.arange(100, device="cuda:0", dtype=torch.int64)
        h = await tr.send(x, "gpu0b", "loop", 5.0)
        view = await tr.recv(h, 5.0, zero_copy=True)
        assert torch.equal(view, x)
        tr.release(h)
        assert not tr._kept
        with pytest.raises(TransferExpired):
            await tr.recv(h, 5.0)
    finally:
        await tr.close()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_cpu_backends_carry_cuda_tensors(peer, backend):
    await _started(peer, [backend])
    tr = ShmTransport("gpu0") if backend == "shm" else TcpTransport("gpu0")
    try:
        x = seeded_tensor([33, 65], "bfloat16", seed=5, device="cuda:0")
        h = await tr.send(x, "gpu1", "d2h", 5.0)
        reply = await peer.call(PeerRecv(handle=h, echo_id="h2d", use_out=True))
        assert reply.ok and reply.digest == digest(x), reply.error
        out = torch.empty_like(x)
        assert torch.equal(await tr.recv(reply.handle, 5.0, out=out), x)
    finally:
        await peer.stop()
        await tr.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two GPUs")
async def test_nccl_between_two_gpus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = f"127.0.0.1:{s.getsockname()[1]}"
    ranks = {"gpu0": 0, "gpu1": 1}
    peers = await asyncio.gather(PeerProcess.spawn(), PeerProcess.spawn())
    try:
        replies = await asyncio.gather(*[
            p.call(PeerStart(device_id=f"gpu{i}", backends=["nccl"], torch_device=f"cuda:{i}",
                             nccl=NcclPeerOptions(rank=i, world_size=2, store_addr=store, peer_ranks=ranks,
                                                  dist_backend="nccl")))
            for i, p in enumerate(peers)])
        assert all(r.ok for r in replies), [r.error for r in replies]
        for k, dtype in enumerate(DTYPES):
            sent = await peers[0].call(PeerSend(transfer_id=f"t{k}", backend="nccl", dst_device="gpu1",
                                                shape=[16, 1024], dtype=dtype, seed=k))
            assert sent.ok, sent.error
            got = await peers[1].call(PeerRecv(handle=sent.handle, echo_id=f"e{k}", use_out=True))
            assert got.ok and got.digest == sent.digest, got.error
            back = await peers[0].call(PeerRecv(handle=got.handle))
            assert back.ok and back.digest == sent.digest, back.error
        ghost = msgspec.structs.replace(sent.handle, transfer_id="ghost", seq=sent.handle.seq + 1)
        assert (await peers[1].call(PeerRecv(handle=ghost, timeout_s=0.5))).error_type == "TransferTimeout"
        await asyncio.gather(*[p.stop() for p in peers])
    finally:
        for p in peers:
            p.kill()
            await p.proc.wait()
