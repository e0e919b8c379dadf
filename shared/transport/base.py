"""The tensor transport interface: a small handle travels over Redis, the bytes go worker-to-worker.

Every backend implements :class:`Transport`. ``send`` stages a tensor for one destination device and returns a
:class:`TensorHandle` (a few hundred bytes of MessagePack); whoever receives the handle calls ``recv`` on its own
transport to get the tensor. No pickle anywhere: the bytes are the tensor's raw little-endian memory, described by
the handle (dtype name, shape, byte count).
"""
from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, TypeVar

import msgspec
import torch

from shared.registry import Registry

MIB = 1024**2
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
T = TypeVar("T")


class TransportError(Exception):
    """Base class of every transport failure; a failure fails one transfer, never the transport."""


class TransferTimeout(TransportError, TimeoutError):
    """The transfer did not finish within its ``timeout_s``; the transport stays usable."""


class TransferTooLarge(TransportError, ValueError):
    """The tensor is above ``max_transfer_bytes`` or ``max_inflight_bytes``; nothing was allocated."""


class TransferExpired(TransportError):
    """The sender no longer holds the bytes (reclaimed after ``stale_after_s``, already fetched, or unknown)."""


class UnsupportedTensor(TransportError, ValueError):
    """A dtype, layout or device this transport cannot carry."""


class TransportClosed(TransportError):
    """The transport was closed."""


class TensorHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What travels over Redis streams in place of a tensor.

    ``location`` is backend-specific: the shared-memory segment name (``shm``), the sender's ``host:port``
    (``tcp``), the base64 MessagePack of the CUDA IPC handle (``cuda_ipc``), ``rank:N`` of the sender (``nccl``).
    ``seq`` is the shm slot generation, the cuda_ipc keep-alive generation, or the NCCL per-pair sequence number.
    ``expires_ts`` (epoch seconds) is when the sender may reclaim the bytes if nobody fetched them.
    """

    transfer_id: str
    shape: list[int]
    dtype: str
    nbytes: int
    src_device: str
    dst_device: str
    backend: str
    location: str
    seq: int = 0
    expires_ts: float = 0.0


_handle_encoder = msgspec.msgpack.Encoder()
_handle_decoder = msgspec.msgpack.Decoder(TensorHandle)


def encode_handle(handle: TensorHandle) -> bytes:
    """MessagePack bytes of a handle (what a stream entry carries)."""
    return _handle_encoder.encode(handle)


def decode_handle(data: bytes) -> TensorHandle:
    """Validate and decode a handle; raises ``msgspec.ValidationError`` on a malformed one."""
    return _handle_decoder.decode(data)


@dataclass(frozen=True)
class TransportLimits:
    """Bounds on buffer space: one transfer, all staged-but-unfetched transfers, and how long bytes are kept."""

    max_transfer_bytes: int = 256 * MIB
    max_inflight_bytes: int = 1024 * MIB
    stale_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_transfer_bytes <= 0 or self.max_inflight_bytes <= 0:
            raise ValueError("transport limits must be positive")
        if self.max_transfer_bytes > self.max_inflight_bytes:
            raise ValueError("max_transfer_bytes must not exceed max_inflight_bytes")
        if self.stale_after_s <= 0:
            raise ValueError("stale_after_s must be positive")

    def check(self, nbytes: int) -> None:
        """Refuse a transfer over the limits before anything is allocated."""
        if nbytes > self.max_transfer_bytes:
            raise TransferTooLarge(f"{nbytes} bytes is above max_transfer_bytes={self.max_transfer_bytes}")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a supported dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedTensor(f"dtype {dtype} is not supported; valid: {', '.join(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedTensor(f"dtype {name!r} is not supported; valid: {', '.join(DTYPES)}") from None


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a contiguous copy first if it is strided)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


def check_tensor(tensor: torch.Tensor, limits: TransportLimits) -> tuple[str, list[int], int]:
    """Validate a tensor to send; returns (dtype name, shape, nbytes)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise UnsupportedTensor("only dense torch tensors can be sent")
    name = dtype_name(tensor.dtype)
    nbytes = tensor_nbytes(tensor)
    limits.check(nbytes)
    return name, list(tensor.shape), nbytes


def check_out(handle: TensorHandle, out: torch.Tensor | None) -> None:
    """``out`` must match the handle's dtype and shape exactly."""
    if out is None:
        return
    if out.dtype != torch_dtype(handle.dtype) or list(out.shape) != list(handle.shape):
        raise UnsupportedTensor(f"out is {out.dtype} {list(out.shape)}, transfer {handle.transfer_id} is "
                                f"{handle.dtype} {handle.shape}")


def deliver(src: torch.Tensor, handle: TensorHandle, out: torch.Tensor | None) -> torch.Tensor:
    """Copy a flat uint8 buffer holding the handle's bytes into ``out`` (or a new tensor) with its dtype/shape."""
    typed = src.view(torch_dtype(handle.dtype)).reshape(handle.shape) if handle.nbytes else \
        torch.empty(handle.shape, dtype=torch_dtype(handle.dtype), device=src.device)
    if out is None:
        return typed.clone()
    out.copy_(typed)
    return out


def typed_view(src: torch.Tensor, handle: TensorHandle) -> torch.Tensor:
    """Interpret a flat uint8 buffer as the handle's tensor without copying."""
    if not handle.nbytes:
        return torch.empty(handle.shape, dtype=torch_dtype(handle.dtype), device=src.device)
    return src.view(torch_dtype(handle.dtype)).reshape(handle.shape)


async def wait_until(attempt: Callable[[], T | None], deadline: float, what: str,
                     wake: asyncio.Event | None = None) -> T:
    """Call ``attempt`` until it returns non-None, polling with backoff (or woken by ``wake``) until ``deadline``.

    Used for back-pressure: a sender waits for buffer space freed by receivers, possibly in other processes.
    """
    delay = 0.0005
    while True:
        got = attempt()
        if got is not None:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"timed out waiting for {what}")
        if wake is not None:
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), min(delay, left))
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)


class Transport(abc.ABC):
    """Moves tensors between devices by handle. Async; one instance per (worker, backend).

    ``send`` stages the bytes and returns a handle (it does not wait for the receiver); ``recv`` fetches them.
    A transfer that fails raises a :class:`TransportError` subclass and affects that transfer only.
    """

    backend: ClassVar[str] = ""

    def __init__(self, device_id: str, limits: TransportLimits | None = None) -> None:
        self.device_id = device_id
        self.limits = limits or TransportLimits()
        self._closed = False

    async def start(self) -> None:
        """Open servers / process groups. Idempotent; ``send``/``recv`` call it when needed."""

    @abc.abstractmethod
    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        """Stage ``tensor`` for ``dst_device``; the caller may modify ``tensor`` once this returns."""

    @abc.abstractmethod
    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        """Fetch the tensor of ``handle`` into ``out`` (or a new tensor).

        With ``zero_copy=True`` and ``out=None`` a backend that can map the sender's buffer returns a view of it;
        the caller must then call :meth:`release` once done. Other backends ignore the flag.
        """

    def release(self, handle: TensorHandle) -> None:
        """Give back a buffer kept by a zero-copy ``recv``; a no-op where nothing is kept."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Free every buffer, server and segment this transport owns. Idempotent."""

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.backend} transport of {self.device_id} is closed")

    def _check_handle(self, handle: TensorHandle) -> None:
        if handle.backend != self.backend:
            raise TransportError(f"handle of transfer {handle.transfer_id} is for backend {handle.backend!r}, "
                                 f"not {self.backend!r}")

    async def __aenter__(self) -> "Transport":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


TRANSPORTS: Registry[Transport] = Registry("transport")
