"""Segment RPC frames: round trips, bounds checked before allocation, partial frames kept across timeouts."""
from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from services.worker.segment_wire import (MAX_HEADER_BYTES, PREFIX, FrameError, FrameReader, LeaseStatusQuery,
                                          LeaseStatusReply, SegmentCall, SegmentResult, WeightsQuery, WeightTensor,
                                          decode_header, encode_header, payload_tensor, send_frame, tensor_payload)
from shared.transport.base import TensorHandle


@pytest.fixture
def sockpair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


HANDLE = TensorHandle(transfer_id="t1", shape=[2, 3], dtype="float32", nbytes=24, src_device="cpu0",
                      dst_device="cpu1", backend="shm", location="seg", seq=1)
FRAMES = [SegmentCall(call_id=1, lease_id="L", tenant="a", segment="mlp[0]", micro_batch=1, shape=[2, 3],
                      dtype="float32", timeout_ms=5.0),
          SegmentCall(call_id=2, lease_id="L", tenant="a", segment="mlp[1]", shape=[2, 3], dtype="float32",
                      handle=HANDLE),
          SegmentResult(call_id=1, shape=[2, 3], dtype="float32", guest_ms=0.5), SegmentResult(call_id=3, error="busy"),
          LeaseStatusQuery(lease_id="L"), LeaseStatusReply(lease_id="L", state="ready", staged=["mlp[0]"]),
          WeightsQuery(lease_id="L", tenant="a", segment="mlp[0]", guest_device="cpu1"),
          WeightTensor(segment="mlp[0]", name="w", shape=[4], dtype="bfloat16", last=False)]


@pytest.mark.parametrize("msg", FRAMES, ids=lambda m: type(m).__name__)
def test_every_frame_round_trips(sockpair, msg):
    a, b = sockpair
    assert decode_header(encode_header(msg)) == msg
    send_frame(a, msg, b"\x01\x02\x03\x04" if isinstance(msg, SegmentCall) else b"")
    got, payload = FrameReader(b).read(time.monotonic() + 2)
    assert got == msg
    assert bytes(payload) == (b"\x01\x02\x03\x04" if isinstance(msg, SegmentCall) else b"")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_tensor_payload_round_trips_bit_for_bit(sockpair, dtype):
    a, b = sockpair
    t = (torch.randn(5, 7) * 100).to(dtype)
    msg = SegmentResult(call_id=1, shape=[5, 7], dtype=str(dtype).split(".")[1])
    send_frame(a, msg, tensor_payload(t[:, 1:4]))  # a strided view: sent as its contiguous bytes
    got, payload = FrameReader(b).read(time.monotonic() + 2)
    out = payload_tensor(payload, [5, 3], got.dtype)
    assert out.dtype == dtype and torch.equal(out, t[:, 1:4])


def test_payload_validation():
    with pytest.raises(FrameError, match="needs 24"):
        payload_tensor(bytearray(20), [2, 3], "float32")
    with pytest.raises(FrameError, match="unsupported dtype"):
        payload_tensor(bytearray(6), [2, 3], "int8")
    with pytest.raises(FrameError, match="bad segment frame"):
        decode_header(b"\x93\x01\x02\x03")


def test_oversized_frames_are_refused_before_allocation(sockpair):
    a, b = sockpair
    a.sendall(PREFIX.pack(MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(FrameError, match="over the limits"):
        FrameReader(b).read(time.monotonic() + 2)
    a.sendall(struct.pack("<II", 10, 2**31))
    with pytest.raises(FrameError, match="over the limits"):
        FrameReader(b).read(time.monotonic() + 2)


def test_partial_frame_survives_a_timeout_and_a_closed_peer_is_an_error(sockpair):
    a, b = sockpair
    msg = FRAMES[0]
    h = encode_header(msg)
    raw = PREFIX.pack(len(h), 4096) + h + bytes(range(256)) * 16
    reader = FrameReader(b)
    a.sendall(raw[:10])
    with pytest.raises(TimeoutError):
        reader.read(time.monotonic() + 0.05)
    a.sendall(raw[10:len(raw) - 100])
    with pytest.raises(TimeoutError):
        reader.read(time.monotonic() + 0.05)
    a.sendall(raw[len(raw) - 100:])
    got, payload = reader.read(time.monotonic() + 2)
    assert got == msg and bytes(payload) == bytes(range(256)) * 16
    a.close()
    with pytest.raises(ConnectionError):
        reader.read(time.monotonic() + 2)
