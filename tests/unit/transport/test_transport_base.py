"""The handle codec, limits, backend choice per device pair, and the mux (in one process)."""
from __future__ import annotations

import msgspec
import pytest
import torch

from shared.config import ConfigError, parse_cluster
from shared.transport import (DTYPES, ShmTransport, TcpTransport, TensorHandle, TransferTooLarge, TransportClosed,
                              TransportError, TransportLimits, TransportMux, UnsupportedTensor, backend_for,
                              decode_handle, encode_handle, make_transport, nccl_members)
from shared.transport.cuda_ipc import CudaIpcLocation, CudaIpcTransport, decode_location, encode_location


def _handle(**kw) -> TensorHandle:
    base = dict(transfer_id="r1:mlp3:mb0", shape=[2, 4096], dtype="bfloat16", nbytes=16384, src_device="gpu0",
                dst_device="gpu1", backend="shm", location="slicesched-gpu0-p1-ab-0", seq=7, expires_ts=1.5)
    return TensorHandle(**{**base, **kw})


def test_handle_round_trips_and_stays_small():
    h = _handle()
    data = encode_handle(h)
    assert decode_handle(data) == h
    assert len(data) < 256


def test_malformed_handle_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode_handle(msgspec.msgpack.encode({"transfer_id": "x", "shape": "not-a-list"}))


def test_limits_validate():
    with pytest.raises(ValueError):
        TransportLimits(max_transfer_bytes=10, max_inflight_bytes=5)
    with pytest.raises(ValueError):
        TransportLimits(stale_after_s=0)


@pytest.mark.parametrize("cls", [ShmTransport, TcpTransport])
async def test_too_large_is_refused_without_allocating(cls):
    tr = cls("cpu0", TransportLimits(max_transfer_bytes=4096, max_inflight_bytes=8192))
    try:
        with pytest.raises(TransferTooLarge):
            await tr.send(torch.zeros(1025), "cpu1", "big", 1.0)  # 4100 bytes
        if isinstance(tr, ShmTransport):
            assert tr.stats()["pool_bytes"] == 0
        else:
            assert tr._inflight == 0 and not tr._outbox
        h = await tr.send(torch.zeros(1024), "cpu1", "fits", 1.0)  # exactly the limit
        assert h.nbytes == 4096
    finally:
        await tr.close()


@pytest.mark.parametrize("cls", [ShmTransport, TcpTransport])
async def test_unsupported_dtype_and_mismatched_out(cls):
    tr = cls("cpu0")
    try:
        with pytest.raises(UnsupportedTensor):
            await tr.send(torch.zeros(3, dtype=torch.float64), "cpu1", "f64", 1.0)
        h = await tr.send(torch.zeros(3), "cpu1", "ok", 1.0)
        with pytest.raises(UnsupportedTensor):
            await tr.recv(h, 1.0, out=torch.zeros(4))
        with pytest.raises(UnsupportedTensor):
            await tr.recv(h, 1.0, out=torch.zeros(3, dtype=torch.int32))
        assert torch.equal(await tr.recv(h, 1.0), torch.zeros(3))
    finally:
        await tr.close()


def _cluster(intra: str, inter: str, backends=("cpu", "cpu", "cpu"), hosts=("a", "a", "b")):
    return parse_cluster({
        "devices": [{"id": f"d{i}", "backend": b, "host": h, "memory_gb": 1, "cuda_index": i % 2}
                    for i, (b, h) in enumerate(zip(backends, hosts))],
        "links": {"intra_host": intra, "inter_host": inter}}, "cluster.yaml")


def test_backend_choice_per_pair():
    cpu = _cluster("shm", "tcp")
    assert backend_for(cpu, "d0", "d1") == "shm" and backend_for(cpu, "d0", "d2") == "tcp"
    gpu = _cluster("nvlink", "nccl", backends=("cuda",) * 3)
    assert backend_for(gpu, "d0", "d1") == "cuda_ipc" and backend_for(gpu, "d1", "d2") == "nccl"
    assert nccl_members(gpu) == ["d0", "d1", "d2"]
    assert backend_for(_cluster("pcie", "nccl", backends=("cuda",) * 3), "d0", "d1") == "cuda_ipc"
    mixed = _cluster("cuda_ipc", "nccl", backends=("cuda", "cpu", "cuda"))
    assert backend_for(mixed, "d0", "d1") == "shm"  # a cpu device: host memory
    assert backend_for(mixed, "d1", "d2") == "tcp"
    assert nccl_members(mixed) == ["d0", "d2"]


def test_impossible_links_name_the_field():
    with pytest.raises(ConfigError) as e:
        backend_for(_cluster("shm", "shm"), "d0", "d2")
    assert e.value.field_path == "links.inter_host" and e.value.file == "cluster.yaml"
    with pytest.raises(ConfigError) as e:
        make_transport(_cluster("nvlink", "nccl", backends=("cuda",) * 3), "d0")
    assert "nccl_store_addr" in str(e.value)
    with pytest.raises(ConfigError):
        make_transport(_cluster("shm", "tcp"), "nope")
    with pytest.raises(TypeError):
        make_transport(_cluster("shm", "tcp"), "d0", bogus=1)


def test_factory_builds_one_transport_per_backend():
    mux = make_transport(_cluster("nvlink", "nccl", backends=("cuda",) * 3), "d1", nccl_store_addr="a:29500")
    assert mux.routes == {"d0": "cuda_ipc", "d2": "nccl"}
    assert isinstance(mux.transports["cuda_ipc"], CudaIpcTransport)
    nccl = mux.transports["nccl"]
    assert (nccl.rank, nccl.world_size, str(nccl.torch_device)) == (1, 3, "cuda:1")


async def test_mux_routes_send_by_destination_and_recv_by_backend():
    cluster = _cluster("shm", "tcp")
    a, b = make_transport(cluster, "d0"), make_transport(cluster, "d2")
    c = make_transport(cluster, "d1")
    try:
        assert set(a.transports) == {"shm", "tcp"}
        x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
        h_shm = await a.send(x, "d1", "to-d1", 2.0)
        h_tcp = await a.send(x, "d2", "to-d2", 2.0)
        assert (h_shm.backend, h_tcp.backend) == ("shm", "tcp")
        assert torch.equal(await c.recv(h_shm, 2.0), x)
        assert torch.equal(await b.recv(h_tcp, 2.0), x)
        with pytest.raises(TransportError):
            await a.send(x, "d9", "nowhere", 1.0)
        with pytest.raises(TransportError):
            await b.recv(msgspec.structs.replace(h_tcp, backend="cuda_ipc"), 1.0)
    finally:
        for m in (a, b, c):
            await m.close()


def test_mux_needs_a_transport_for_each_route():
    with pytest.raises(ValueError):
        TransportMux("d0", {"d1": "shm"}, {})


def test_cuda_ipc_location_round_trips_without_pickle():
    loc = CudaIpcLocation(pid=42, ack_segment="slicesched-g0-p42-ab-ack", ack_index=3, device=1,
                          storage_handle=bytes(range(64)), storage_size_bytes=1 << 20, storage_offset_bytes=512,
                          ref_counter_handle=b"/torch_123_456", ref_counter_offset=8, event_handle=bytes(64),
                          event_sync_required=True)
    text = encode_location(loc)
    assert decode_location(text) == loc
    assert len(text) < 400
    with pytest.raises(TransportError):
        decode_location("not base64 !")


async def test_cuda_ipc_refuses_cpu_tensors(tmp_path):
    tr = CudaIpcTransport("g0", shm_dir=str(tmp_path))
    try:
        with pytest.raises(UnsupportedTensor):
            await tr.send(torch.zeros(4), "g1", "cpu-tensor", 1.0)
    finally:
        await tr.close()
    assert list(tmp_path.iterdir()) == []  # the ack board is unlinked on close


def test_every_dtype_has_a_wire_name():
    assert set(DTYPES) == {"float32", "float16", "bfloat16", "int64", "int32"}


@pytest.mark.parametrize("cls", [ShmTransport, TcpTransport])
async def test_closed_transport_refuses_work(cls):
    tr = cls("cpu0")
    h = await tr.send(torch.zeros(2), "cpu1", "x", 1.0)
    await tr.close()
    await tr.close()  # idempotent
    with pytest.raises(TransportClosed):
        await tr.send(torch.zeros(2), "cpu1", "y", 1.0)
    with pytest.raises(TransportClosed):
        await tr.recv(h, 1.0)
