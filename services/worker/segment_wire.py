"""Wire format of the segment RPC between workers (driver ↔ guest): length-prefixed frames, no pickle.

A frame is ``u32 header_len | u32 payload_len | header | payload``: the header is a MessagePack msgspec Struct
(tagged union :data:`SegmentFrame`), the payload the raw little-endian bytes of one tensor when it travels inline
(small tensors), or empty when the tensor goes over the tensor transport and the header carries its
:class:`~shared.transport.TensorHandle`. Both sizes are bounded before anything is allocated; a frame over the
bounds closes the connection. :class:`FrameReader` keeps a partly read frame across socket timeouts, so a caller
that gives up waiting can keep using the connection (late replies are recognised by their ``call_id``).
"""
from __future__ import annotations

import socket
import struct
import time
from typing import Union

import msgspec
import torch

from shared.transport.base import DTYPES, TensorHandle, byte_view, dtype_name

PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 256 * 1024**2
_RECV_CHUNK = 256 * 1024


class SegmentCall(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Run ``segment`` of ``tenant`` under ``lease_id`` on the hidden states of one micro-batch."""

    call_id: int
    lease_id: str
    tenant: str
    segment: str
    micro_batch: int = 0
    shape: list[int]
    dtype: str
    handle: TensorHandle | None = None  # None: the tensor is the frame's payload
    timeout_ms: float = 0.0  # the driver stops waiting after this; the guest skips a call still queued past it


class SegmentResult(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Reply to :class:`SegmentCall`; ``error`` non-empty means "run it yourself" (no tensor)."""

    call_id: int
    error: str = ""  # lease_inactive | not_staged | busy | expired | bad_request | internal
    shape: list[int] = []
    dtype: str = ""
    handle: TensorHandle | None = None
    guest_ms: float = 0.0  # compute time on the guest
    queue_ms: float = 0.0  # time the call waited for the guest's device (home work first)


class LeaseStatusQuery(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The driver asks whether the guest has staged a lease's segments."""

    lease_id: str


class LeaseStatusReply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The guest's view of a lease."""

    lease_id: str
    state: str  # unknown | staging | ready | ended | failed
    staged: list[str] = []
    detail: str = ""


class WeightsQuery(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A guest asks the home worker for one segment's weights (to stage them bit-identically)."""

    lease_id: str
    tenant: str
    segment: str
    guest_device: str


class WeightTensor(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """One tensor of a :class:`WeightsQuery` reply; ``last`` marks the segment's final tensor."""

    segment: str
    name: str = ""
    shape: list[int] = []
    dtype: str = ""
    handle: TensorHandle | None = None
    last: bool = True
    error: str = ""  # unknown_lease | not_home | bad_request


class KVQuery(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A home worker asks a guest for the KV of a sequence the guest is handing to it (:class:`HandOff`)."""

    request_id: str
    token: str
    home_device: str


class KVTensor(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """One layer's K or V of a :class:`KVQuery` reply (``[kv_heads, positions, head_dim]``); ``last`` marks the
    final one. An empty reply (``last`` and no ``kind``) is a sequence without tensors."""

    request_id: str
    layer: int = 0
    kind: str = ""  # k | v
    shape: list[int] = []
    dtype: str = ""
    handle: TensorHandle | None = None
    last: bool = True
    error: str = ""  # unknown_sequence


SegmentFrame = Union[SegmentCall, SegmentResult, LeaseStatusQuery, LeaseStatusReply, WeightsQuery, WeightTensor,
                     KVQuery, KVTensor]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SegmentFrame)


class FrameError(ConnectionError):
    """A malformed or oversized frame: the connection is no longer usable."""


def encode_header(msg: SegmentFrame) -> bytes:
    """MessagePack of a frame header."""
    return _encoder.encode(msg)


def decode_header(data: bytes) -> SegmentFrame:
    """Validate and decode a frame header; ``FrameError`` for anything malformed."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise FrameError(f"bad segment frame header: {e}") from None


def tensor_payload(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (a contiguous copy first if needed), without another copy."""
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(byte_view(t).numpy())


def payload_tensor(payload: bytearray | memoryview, shape: list[int], dtype: str,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Interpret an inline payload as a tensor (shares the buffer on CPU); validates sizes and dtype."""
    if dtype not in DTYPES:
        raise FrameError(f"unsupported dtype {dtype!r}")
    dt = DTYPES[dtype]
    n = 1
    for s in shape:
        if s < 0:
            raise FrameError(f"negative dimension in shape {shape}")
        n *= s
    nbytes = n * torch.empty(0, dtype=dt).element_size()
    if nbytes != len(payload):
        raise FrameError(f"payload holds {len(payload)} bytes, shape {shape} {dtype} needs {nbytes}")
    if not nbytes:
        return torch.empty(shape, dtype=dt, device=device)
    t = torch.frombuffer(payload, dtype=torch.uint8).view(dt).reshape(shape)
    return t if torch.device(device).type == "cpu" else t.to(device)


def send_frame(sock: socket.socket, header: SegmentFrame, payload: memoryview | bytes = b"") -> None:
    """Write one frame (one ``sendmsg`` in the common case); raises ``OSError`` on failure."""
    h = encode_header(header)
    if len(h) > MAX_HEADER_BYTES or len(payload) > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame too large: header {len(h)} B, payload {len(payload)} B")
    bufs = [memoryview(PREFIX.pack(len(h), len(payload))), memoryview(h)]
    if len(payload):
        bufs.append(memoryview(payload).cast("B"))
    while bufs:
        sent = sock.sendmsg(bufs)
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if bufs and sent:
            bufs[0] = bufs[0][sent:]


class FrameReader:
    """Reads frames from a blocking socket with a deadline; keeps partial frames across timeouts."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._cur: list | None = None  # [header bytes, payload bytearray, bytes filled]

    def read(self, deadline: float | None = None) -> tuple[SegmentFrame, bytearray]:
        """The next frame; ``TimeoutError`` past ``deadline`` (monotonic; None = wait forever),
        ``ConnectionError`` when the peer closed or sent a bad frame."""
        while True:
            if self._cur is None:
                if len(self._buf) >= PREFIX.size:
                    hl, pl = PREFIX.unpack_from(self._buf)
                    if hl > MAX_HEADER_BYTES or pl > MAX_PAYLOAD_BYTES:
                        raise FrameError(f"frame over the limits: header {hl} B, payload {pl} B")
                    if len(self._buf) >= PREFIX.size + hl:
                        header = bytes(self._buf[PREFIX.size:PREFIX.size + hl])
                        rest = PREFIX.size + hl
                        n = min(len(self._buf) - rest, pl)
                        payload = bytearray(pl)
                        payload[:n] = self._buf[rest:rest + n]
                        del self._buf[:rest + n]
                        self._cur = [header, payload, n]
                        continue
                self._settimeout(deadline)
                data = self.sock.recv(_RECV_CHUNK)
                if not data:
                    raise ConnectionResetError("peer closed the segment connection")
                self._buf += data
            else:
                header, payload, n = self._cur
                if n == len(payload):
                    self._cur = None
                    return decode_header(header), payload
                self._settimeout(deadline)
                k = self.sock.recv_into(memoryview(payload)[n:])
                if not k:
                    raise ConnectionResetError("peer closed the segment connection")
                self._cur[2] = n + k

    def _settimeout(self, deadline: float | None) -> None:
        if deadline is None:
            self.sock.settimeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("segment frame not received in time")
        self.sock.settimeout(left)


def connect(addr: str, timeout_s: float = 2.0) -> socket.socket:
    """A blocking TCP connection to ``host:port`` with ``TCP_NODELAY``."""
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def wire_dtype(t: torch.Tensor) -> str:
    """The dtype name frames carry."""
    return dtype_name(t.dtype)
