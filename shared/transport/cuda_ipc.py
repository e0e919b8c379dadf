"""CUDA IPC transport between GPU processes on one host (NVLink or PCIe peer access).

``send`` copies the tensor into a fresh device buffer (so the caller may reuse its tensor at once), exports the
buffer's CUDA IPC handle with ``UntypedStorage._share_cuda_()`` and puts the handle's fields, MessagePack-encoded
and base64'd, into ``TensorHandle.location``: no pickle. The receiver rebuilds the tensor with
``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (the same function torch's own multiprocessing uses,
called directly), waits on the producer's IPC event, copies device-to-device into ``out`` and acks.

Keep-alive: the sender holds each buffer until the receiver writes the transfer's generation into the sender's
ack board (a small shared-memory segment, two u64 words per keep-alive slot: the generation the sender keeps and
the generation the receiver acked), or until ``stale_after_s``. Even
after that, torch's producer-side IPC ref counter keeps the allocation from being reused while a receiver still
maps it. Both processes must see the same CUDA device numbering (same ``CUDA_VISIBLE_DEVICES``).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import torch

from shared.transport.base import (TRANSPORTS, TensorHandle, Transport, TransferExpired, TransferTimeout,
                                   TransportError, TransportLimits, UnsupportedTensor, check_out, check_tensor,
                                   torch_dtype, wait_until)
from shared.transport.shm import SEGMENT_PREFIX, _safe, _Segment

log = structlog.get_logger(__name__)


class CudaIpcLocation(msgspec.Struct, frozen=True, array_like=True):
    """The fields of ``_share_cuda_()`` plus where to ack; carried base64'd in ``TensorHandle.location``."""

    pid: int
    ack_segment: str
    ack_index: int
    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(CudaIpcLocation)


def encode_location(loc: CudaIpcLocation) -> str:
    return base64.b64encode(_enc.encode(loc)).decode("ascii")


def decode_location(text: str) -> CudaIpcLocation:
    try:
        return _dec.decode(base64.b64decode(text, validate=True))
    except (ValueError, msgspec.DecodeError) as e:
        raise TransportError(f"bad cuda_ipc location: {e}") from None


@dataclass
class _Kept:
    transfer_id: str
    tensor: torch.Tensor
    gen: int
    expires: float


def _mark() -> torch.cuda.Event:
    """An event recorded on the current device's current stream."""
    event = torch.cuda.Event()
    event.record()
    return event


async def _gpu_done(event: torch.cuda.Event, timeout_s: float, what: str) -> None:
    """Wait, without blocking the event loop, until ``event`` (the work queued before it) has completed."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"{what}: device copy not finished within {timeout_s}s")
        await asyncio.sleep(0.0002)


@TRANSPORTS.register("cuda_ipc")
class CudaIpcTransport(Transport):
    """CUDA IPC handles in the TensorHandle, a device-to-device copy on the receiver (see module docstring)."""

    backend = "cuda_ipc"

    def __init__(self, device_id: str, limits: TransportLimits | None = None, *, shm_dir: str = "/dev/shm",
                 max_kept: int = 4096) -> None:
        super().__init__(device_id, limits)
        self.shm_dir = Path(shm_dir)
        self.max_kept = max_kept
        self.ack_name = f"{SEGMENT_PREFIX}{_safe(device_id)}-p{os.getpid()}-{os.urandom(4).hex()}-ack"
        self._board: _Segment | None = None
        self._kept: dict[int, _Kept] = {}
        self._by_id: dict[str, int] = {}
        self._kept_bytes = 0
        self._gens = itertools.count(1)
        self._boards: dict[str, _Segment] = {}  # receivers' view of senders' ack boards
        self._held: dict[str, tuple[TensorHandle, CudaIpcLocation]] = {}
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        self._check_open()
        if self._board is None:
            self._board = _Segment(self.shm_dir / self.ack_name, 16 * self.max_kept, create=True)
            self._sweeper = asyncio.create_task(self._sweep_loop())

    # ---------------------------------------------------------------- sender side
    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        await self.start()
        if tensor.device.type != "cuda":
            raise UnsupportedTensor(f"cuda_ipc sends CUDA tensors; transfer {transfer_id} is on {tensor.device}")
        dname, shape, nbytes = check_tensor(tensor, self.limits)
        index = await wait_until(lambda: self._reserve(nbytes), time.monotonic() + timeout_s,
                                 f"cuda_ipc keep-alive space for transfer {transfer_id}")
        try:
            keep = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        except BaseException:
            self._kept_bytes -= nbytes
            raise
        gen = next(self._gens)
        self._board.put(16 * index, gen)
        self._board.put(16 * index + 8, 0)
        self._kept[index] = _Kept(transfer_id, keep, gen, time.monotonic() + self.limits.stale_after_s)
        self._by_id[transfer_id] = index
        with torch.cuda.device(keep.device):
            keep.copy_(tensor)
            copied = _mark()
        # the copy must be complete before the handle can reach a receiver on any path
        await _gpu_done(copied, timeout_s, f"transfer {transfer_id}")
        if nbytes:
            (dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync) = keep.untyped_storage()._share_cuda_()
        else:
            dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = keep.device.index, b"", 0, 0, b"", 0, None, False
        loc = CudaIpcLocation(pid=os.getpid(), ack_segment=self.ack_name, ack_index=index, device=dev,
                              storage_handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                              ref_counter_handle=ref_h, ref_counter_offset=ref_off, event_handle=ev_h,
                              event_sync_required=bool(ev_sync))
        return TensorHandle(transfer_id=transfer_id, shape=shape, dtype=dname, nbytes=nbytes,
                            src_device=self.device_id, dst_device=dst_device, backend=self.backend,
                            location=encode_location(loc), seq=gen, expires_ts=time.time() + self.limits.stale_after_s)

    def _reserve(self, nbytes: int) -> int | None:
        self._sweep()
        if self._kept_bytes + nbytes > self.limits.max_inflight_bytes or len(self._kept) >= self.max_kept:
            return None
        self._kept_bytes += nbytes
        return next(i for i in range(self.max_kept) if i not in self._kept)

    def _drop(self, index: int) -> None:
        kept = self._kept.pop(index)
        self._board.put(16 * index, 0)
        self._by_id.pop(kept.transfer_id, None)
        self._kept_bytes -= kept.tensor.numel() * kept.tensor.element_size()

    def _sweep(self) -> int:
        now, freed = time.monotonic(), 0
        for index, kept in list(self._kept.items()):
            if self._board.get(16 * index + 8) == kept.gen:
                self._drop(index)
                freed += 1
            elif now > kept.expires:
                log.warning("cuda_ipc_keepalive_expired", device=self.device_id, transfer_id=kept.transfer_id)
                self._drop(index)
                freed += 1
        if freed:
            torch.cuda.ipc_collect()
        return freed

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self._kept:
                self._sweep()

    # ---------------------------------------------------------------- receiver side
    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        self._check_open()
        self._check_handle(handle)
        check_out(handle, out)
        loc = decode_location(handle.location)
        src = self._open(handle, loc)
        if zero_copy and out is None:
            self._held[handle.transfer_id] = (handle, loc)
            return src
        with torch.cuda.device(src.device if out is None else out.device):
            result = src.clone() if out is None else out.copy_(src)
            copied = _mark()
        await _gpu_done(copied, timeout_s, f"transfer {handle.transfer_id}")
        del src
        self._ack(handle, loc)
        return result

    def release(self, handle: TensorHandle) -> None:
        held = self._held.pop(handle.transfer_id, None)
        if held is not None:
            torch.cuda.current_stream().synchronize()  # the caller's reads of the view must finish first
            self._ack(*held)

    def _open(self, handle: TensorHandle, loc: CudaIpcLocation) -> torch.Tensor:
        dtype = torch_dtype(handle.dtype)
        if loc.pid == os.getpid():  # cudaIpcOpenMemHandle refuses handles of the calling process
            index = self._by_id.get(handle.transfer_id)
            if index is None or self._kept[index].gen != handle.seq:
                raise TransferExpired(f"transfer {handle.transfer_id} is no longer kept")
            return self._kept[index].tensor
        if self._ack_board(loc).get(16 * loc.ack_index) != handle.seq:
            raise TransferExpired(f"transfer {handle.transfer_id} is no longer kept by the sender")
        if not handle.nbytes:
            return torch.empty(handle.shape, dtype=dtype, device=f"cuda:{loc.device}")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        stride = torch.empty(handle.shape, device="meta").stride()
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(handle.shape), stride, 0, torch.storage.TypedStorage,
                                   dtype, loc.device, loc.storage_handle, loc.storage_size_bytes,
                                   loc.storage_offset_bytes, False, loc.ref_counter_handle, loc.ref_counter_offset,
                                   loc.event_handle, loc.event_sync_required)

    def _ack_board(self, loc: CudaIpcLocation) -> _Segment:
        board = self._boards.get(loc.ack_segment)
        if board is None:
            if "/" in loc.ack_segment or not loc.ack_segment.startswith(SEGMENT_PREFIX):
                raise TransportError(f"bad ack segment name {loc.ack_segment!r}")
            try:
                board = self._boards[loc.ack_segment] = _Segment(self.shm_dir / loc.ack_segment)
            except FileNotFoundError:
                raise TransferExpired(f"the sender's ack board {loc.ack_segment} is gone") from None
        return board

    def _ack(self, handle: TensorHandle, loc: CudaIpcLocation) -> None:
        if loc.pid == os.getpid():
            index = self._by_id.get(handle.transfer_id)
            if index is not None and self._kept[index].gen == handle.seq:
                self._drop(index)
            return
        self._ack_board(loc).put(16 * loc.ack_index + 8, handle.seq)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._kept.clear()
        self._kept_bytes = 0
        self._by_id.clear()
        self._held.clear()
        for board in self._boards.values():
            board.close()
        if self._board is not None:
            self._board.close()
            (self.shm_dir / self.ack_name).unlink(missing_ok=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
