"""TCP transport in one process: framing, connection reuse, timeouts, a receiver that drops mid-transfer."""
from __future__ import annotations

import asyncio
import socket
import struct

import msgspec
import pytest
import torch

from shared.transport import TcpTransport, TransferExpired, TransferTimeout, TransportError, TransportLimits
from shared.transport.tcp import FetchRequest, parse_endpoint


@pytest.fixture
async def pair():
    a = TcpTransport("cpu0", TransportLimits(max_transfer_bytes=16 << 20, max_inflight_bytes=32 << 20,
                                             stale_after_s=0.5))
    b = TcpTransport("cpu1")
    yield a, b
    await a.close()
    await b.close()


async def test_large_round_trip_into_out(pair):
    a, b = pair
    x = torch.randn(2048, 1024)  # 8 MiB: header and payload sent separately
    h = await a.send(x, "cpu1", "big", 5.0)
    out = torch.empty_like(x)
    assert (await b.recv(h, 5.0, out=out)) is out and torch.equal(out, x)
    assert a._inflight == 0


async def test_connection_is_reused(pair):
    a, b = pair
    for i in range(20):
        h = await a.send(torch.full((100,), i, dtype=torch.int32), "cpu1", f"t{i}", 1.0)
        assert (await b.recv(h, 1.0))[0].item() == i
    ep = parse_endpoint(a.endpoint)
    assert len(b._pool.idle[ep]) == 1
    assert len(a._conns) == 1  # one server-side connection served all twenty fetches


async def test_a_transfer_is_fetched_once(pair):
    a, b = pair
    h = await a.send(torch.zeros(10), "cpu1", "once", 1.0)
    await b.recv(h, 1.0)
    with pytest.raises(TransferExpired):
        await b.recv(h, 1.0)
    h2 = await a.send(torch.ones(10), "cpu1", "again", 1.0)  # the refused fetch left the connection usable
    assert torch.equal(await b.recv(h2, 1.0), torch.ones(10))


async def test_duplicate_transfer_id_is_refused(pair):
    a, _ = pair
    await a.send(torch.zeros(10), "cpu1", "dup", 1.0)
    with pytest.raises(TransportError):
        await a.send(torch.zeros(10), "cpu1", "dup", 1.0)


async def test_silent_sender_times_out_that_transfer_only(pair):
    a, b = pair
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog) and never answers
    try:
        h_real = await a.send(torch.arange(10), "cpu1", "real", 1.0)
        bad = msgspec.structs.replace(h_real, transfer_id="lost", location=f"127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(TransferTimeout):
            await b.recv(bad, 0.3)
        assert torch.equal(await b.recv(h_real, 1.0), torch.arange(10))
    finally:
        silent.close()


async def test_unreachable_sender_is_a_transport_error(pair):
    _, b = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    h = await pair[0].send(torch.zeros(3), "cpu1", "x", 1.0)
    with pytest.raises(TransportError):
        await b.recv(msgspec.structs.replace(h, location=f"127.0.0.1:{port}"), 1.0)


async def test_full_outbox_times_out_then_expiry_frees_it():
    a = TcpTransport("cpu0", TransportLimits(max_transfer_bytes=1 << 20, max_inflight_bytes=1 << 20,
                                             stale_after_s=0.4))
    b = TcpTransport("cpu1")
    try:
        await a.send(torch.zeros(1 << 18), "cpu1", "unfetched", 1.0)
        with pytest.raises(TransferTimeout):
            await a.send(torch.zeros(1 << 18), "cpu1", "waits", 0.1)
        h = await a.send(torch.ones(1 << 18), "cpu1", "after-expiry", 2.0)
        assert torch.equal(await b.recv(h, 1.0), torch.ones(1 << 18))
    finally:
        await a.close()
        await b.close()


async def test_receiver_dropping_mid_transfer_does_not_wedge_the_sender(pair):
    a, b = pair
    x = torch.randn(4 << 20)  # 16 MiB
    h = await a.send(x, "cpu1", "dropped", 5.0)
    loop = asyncio.get_running_loop()
    host, port = parse_endpoint(a.endpoint)
    raw = socket.create_connection((host, port))
    raw.setblocking(False)
    body = msgspec.msgpack.encode(FetchRequest(transfer_id="dropped", nbytes=h.nbytes))
    await loop.sock_sendall(raw, struct.pack("<I", len(body)) + body)
    await loop.sock_recv(raw, 4096)  # the reply has started
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()  # reset: as if the receiver process died
    for _ in range(200):
        if a._inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert a._inflight == 0 and not a._outbox
    y = torch.randn(1000)
    h2 = await a.send(y, "cpu1", "next", 1.0)
    assert torch.equal(await b.recv(h2, 1.0), y)
