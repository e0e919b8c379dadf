"""Transfers between real OS processes: each peer is a fresh interpreter (``python -m shared.transport.peer``).

Covers: every dtype and several shapes both ways over shm and tcp; a receiver killed while it holds or fetches
transfers does not wedge the sender; the nccl backend's ordered channels, exercised on CPU through torch.distributed's
gloo backend (the code path is the nccl one; only the collective library differs).
"""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import torch

from shared.transport import DTYPES, ShmTransport, TcpTransport, TransportLimits
from shared.transport.peer import NcclPeerOptions, PeerRecv, PeerSend, PeerStart, digest, seeded_tensor

SHAPES = [[], [0], [1], [7, 3], [2, 3, 64], [256, 1024]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_every_dtype_and_shape_round_trips_between_processes(spawn_peer):
    peer = await spawn_peer()
    started = await peer.call(PeerStart(device_id="cpu1", backends=["shm", "tcp"]))
    assert started.ok, started.error
    transports = {"shm": ShmTransport("cpu0"), "tcp": TcpTransport("cpu0")}
    try:
        n = 0
        for backend, tr in transports.items():
            for dtype in DTYPES:
                for shape in SHAPES:
                    x = seeded_tensor(shape, dtype, seed=n)
                    h = await tr.send(x, "cpu1", f"to-{n}", 5.0)
                    assert h.backend == backend
                    reply = await peer.call(PeerRecv(handle=h, echo_id=f"back-{n}", use_out=n % 2 == 1))
                    assert reply.ok, reply.error
                    assert reply.digest == digest(x)  # the child got the exact bytes
                    back = await tr.recv(reply.handle, 5.0)  # and sent them back from its own transport
                    assert back.dtype == x.dtype and torch.equal(back, x)
                    n += 1
        await peer.stop()
        assert peer.proc.returncode == 0
    finally:
        for tr in transports.values():
            await tr.close()
    assert list(Path("/dev/shm").glob(f"{transports['shm'].segment_prefix}*")) == []
    assert list(Path("/dev/shm").glob(f"slicesched-cpu1-p{started.pid}-*")) == []  # the child's echo segments


async def test_killed_receiver_does_not_wedge_the_sender(spawn_peer):
    limits = TransportLimits(max_transfer_bytes=8 << 20, max_inflight_bytes=8 << 20, stale_after_s=0.5)
    shm, tcp = ShmTransport("cpu0", limits), TcpTransport("cpu0", limits)
    peer = await spawn_peer()
    assert (await peer.call(PeerStart(device_id="cpu1", backends=["shm", "tcp"]))).ok
    try:
        x = torch.randn(2 << 20)  # 8 MiB: fills each transport's buffer space
        staged = {name: await tr.send(x, "cpu1", f"{name}-doomed", 2.0) for name, tr in (("shm", shm), ("tcp", tcp))}
        # the child starts fetching (maybe finishes, maybe not) and dies without answering or releasing
        body = msgspec.msgpack.encode(PeerRecv(handle=staged["tcp"]))
        peer.proc.stdin.write(len(body).to_bytes(4, "little") + body)
        await peer.proc.stdin.drain()
        await asyncio.sleep(0.05)
        peer.kill()
        await peer.proc.wait()

        receivers = {"shm": ShmTransport("cpu2"), "tcp": TcpTransport("cpu2")}
        for name, tr in (("shm", shm), ("tcp", tcp)):
            started = time.monotonic()
            y = torch.randn(2 << 20)
            h = await tr.send(y, "cpu2", f"{name}-after", 5.0)  # waits for the stale space, no longer
            assert time.monotonic() - started < 3.0
            assert torch.equal(await receivers[name].recv(h, 5.0), y)
            await receivers[name].close()
    finally:
        await shm.close()
        await tcp.close()


async def test_nccl_backend_over_gloo_between_two_processes(spawn_peer):
    peers = await asyncio.gather(spawn_peer(), spawn_peer())
    store, ranks = f"127.0.0.1:{_free_port()}", {"g0": 0, "g1": 1}
    started = await asyncio.gather(*[
        p.call(PeerStart(device_id=f"g{i}", backends=["nccl"], max_transfer_bytes=4096, max_inflight_bytes=4096,
                         nccl=NcclPeerOptions(rank=i, world_size=2, store_addr=store, peer_ranks=ranks,
                                              dist_backend="gloo")))
        for i, p in enumerate(peers)])
    assert all(s.ok for s in started), [s.error for s in started]
    g0, g1 = peers
    for k, dtype in enumerate(DTYPES):
        for j, shape in enumerate([[], [0], [7], [4, 33]]):
            sent = await g0.call(PeerSend(transfer_id=f"t{k}.{j}", backend="nccl", dst_device="g1", shape=shape,
                                          dtype=dtype, seed=10 * k + j))
            assert sent.ok, sent.error
            got = await g1.call(PeerRecv(handle=sent.handle, echo_id=f"e{k}.{j}", use_out=j % 2 == 0))
            assert got.ok and got.digest == sent.digest, got.error
            back = await g0.call(PeerRecv(handle=got.handle))  # the other direction's group
            assert back.ok and back.digest == sent.digest, back.error

    # completed sends give their buffer space back: twenty 2 KiB sends through a 4 KiB budget
    for k in range(20):
        sent = await g0.call(PeerSend(transfer_id=f"s{k}", backend="nccl", dst_device="g1", shape=[512],
                                      dtype="float32", seed=k, timeout_s=5.0))
        assert sent.ok, sent.error
        assert (await g1.call(PeerRecv(handle=sent.handle))).digest == sent.digest

    # handles may arrive out of order: the receiver drains in sequence and stashes
    first = await g0.call(PeerSend(transfer_id="a", backend="nccl", dst_device="g1", shape=[10], dtype="float32",
                                   seed=1))
    second = await g0.call(PeerSend(transfer_id="b", backend="nccl", dst_device="g1", shape=[20], dtype="int64",
                                    seed=2))
    assert (await g1.call(PeerRecv(handle=second.handle))).digest == second.digest
    assert (await g1.call(PeerRecv(handle=first.handle))).digest == first.digest

    # a transfer that never comes times out; the channel still delivers the next one
    ghost = msgspec.structs.replace(second.handle, transfer_id="ghost", seq=second.handle.seq + 1)
    timed_out = await g1.call(PeerRecv(handle=ghost, timeout_s=0.3))
    assert not timed_out.ok and timed_out.error_type == "TransferTimeout"
    nxt = await g0.call(PeerSend(transfer_id="c", backend="nccl", dst_device="g1", shape=[5, 5], dtype="bfloat16",
                                 seed=3))
    assert (await g1.call(PeerRecv(handle=nxt.handle))).digest == nxt.digest
    await asyncio.gather(g0.stop(), g1.stop())
