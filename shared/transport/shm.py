"""Shared-memory transport between CPU processes on one host.

The sender owns a pool of POSIX shared-memory segments (files under ``/dev/shm``, mapped with ``mmap``), one slot
per segment, in power-of-two size classes. ``send`` copies the tensor into a free slot and returns a handle naming
the segment; the receiver maps the segment (mappings are cached), copies the bytes out and marks the slot done by
writing the slot's generation into the segment header, which the sender's allocator reads back. A slot nobody
released within ``stale_after_s`` is reclaimed; its generation is cleared first, so a late reader gets
:class:`TransferExpired` rather than foreign bytes. ``close`` unlinks every segment the transport created.

Slot header (little-endian u64 words, data starts at byte 4096): magic, capacity, busy generation (written by the
sender after the data), done generation (written by the receiver), byte count.
"""
from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import re
import secrets
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from shared.transport.base import (TRANSPORTS, TensorHandle, Transport, TransferExpired, TransferTimeout,
                                   TransportError, TransportLimits, byte_view, check_out, check_tensor, deliver,
                                   typed_view, wait_until)

log = structlog.get_logger(__name__)

HEADER_BYTES = 4096
MAGIC = int.from_bytes(b"SSHMSLT1", "little")
OFF_MAGIC, OFF_CAPACITY, OFF_BUSY, OFF_DONE, OFF_NBYTES = 0, 8, 16, 24, 32
MIN_SLOT_BYTES = 4096
THREAD_COPY_BYTES = 2 * 1024**2  # copies above this run in a thread so the event loop keeps serving
SEGMENT_PREFIX = "slicesched-"
_U64 = struct.Struct("<Q")


class _Segment:
    """One mapped shared-memory file."""

    def __init__(self, path: Path, size: int = 0, *, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)

    def get(self, off: int) -> int:
        return _U64.unpack_from(self.mm, off)[0]

    def put(self, off: int, value: int) -> None:
        _U64.pack_into(self.mm, off, value)

    def payload(self, nbytes: int) -> torch.Tensor:
        return self.data[HEADER_BYTES:HEADER_BYTES + nbytes]

    def close(self) -> None:
        del self.data
        try:
            self.mm.close()
        except BufferError:  # a zero-copy view is still alive; the mapping goes when it does
            pass


@dataclass
class _Slot:
    name: str
    capacity: int
    seg: _Segment
    gen: int = 0
    expires: float = 0.0


class ShmSlotPool:
    """Sender-side allocator: slots in power-of-two classes, total capacity bounded by ``max_inflight_bytes``."""

    def __init__(self, shm_dir: Path, prefix: str, limits: TransportLimits) -> None:
        self.shm_dir, self.prefix, self.limits = shm_dir, prefix, limits
        self.free: dict[int, list[_Slot]] = {}
        self.busy: dict[str, _Slot] = {}
        self.pool_bytes = 0
        self._names = itertools.count()
        self._gens = itertools.count(1)

    def capacity_for(self, nbytes: int) -> int:
        """The slot size class for ``nbytes``: a power of two from 4 KiB, capped at ``max_transfer_bytes``."""
        cap = max(MIN_SLOT_BYTES, 1 << max(nbytes - 1, 0).bit_length())
        return max(min(cap, self.limits.max_transfer_bytes), nbytes)

    def alloc(self, nbytes: int) -> _Slot | None:
        """A slot for ``nbytes`` (marked busy with a fresh generation), or None while the pool is full."""
        self.reclaim()
        cap = self.capacity_for(nbytes)
        slots = self.free.get(cap)
        if slots:
            slot = slots.pop()
        else:
            while self.pool_bytes + cap > self.limits.max_inflight_bytes and self._evict_one():
                pass
            if self.pool_bytes + cap > self.limits.max_inflight_bytes:
                return None
            name = f"{self.prefix}{next(self._names)}"
            seg = _Segment(self.shm_dir / name, HEADER_BYTES + cap, create=True)
            seg.put(OFF_MAGIC, MAGIC)
            seg.put(OFF_CAPACITY, cap)
            slot = _Slot(name, cap, seg)
            self.pool_bytes += cap
        slot.gen = next(self._gens)
        slot.expires = time.monotonic() + self.limits.stale_after_s
        slot.seg.put(OFF_BUSY, 0)  # invalidate readers of the previous generation before overwriting
        slot.seg.put(OFF_DONE, 0)
        self.busy[slot.name] = slot
        return slot

    def publish(self, slot: _Slot, nbytes: int) -> None:
        """Make a written slot readable: the busy generation goes in last."""
        slot.seg.put(OFF_NBYTES, nbytes)
        slot.seg.put(OFF_BUSY, slot.gen)

    def give_back(self, slot: _Slot) -> None:
        """Return a slot to its size class's free list."""
        self.busy.pop(slot.name, None)
        self.free.setdefault(slot.capacity, []).append(slot)

    def reclaim(self) -> int:
        """Free slots their receivers released, and slots past ``stale_after_s``; returns how many."""
        now, n = time.monotonic(), 0
        for slot in list(self.busy.values()):
            if slot.seg.get(OFF_DONE) == slot.gen:
                self.give_back(slot)
                n += 1
            elif now > slot.expires:
                slot.seg.put(OFF_BUSY, 0)
                log.warning("shm_slot_reclaimed_stale", segment=slot.name, gen=slot.gen)
                self.give_back(slot)
                n += 1
        return n

    @property
    def busy_bytes(self) -> int:
        return sum(s.capacity for s in self.busy.values())

    def _evict_one(self) -> bool:
        for cap in sorted(self.free, reverse=True):
            if self.free[cap]:
                self._destroy(self.free[cap].pop())
                return True
        return False

    def _destroy(self, slot: _Slot) -> None:
        self.pool_bytes -= slot.capacity
        slot.seg.close()
        try:
            os.unlink(slot.seg.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap and unlink every segment of the pool."""
        for slot in [*self.busy.values(), *(s for lst in self.free.values() for s in lst)]:
            self._destroy(slot)
        self.busy.clear()
        self.free.clear()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)


def reap_orphan_segments(shm_dir: str | Path = "/dev/shm") -> list[str]:
    """Unlink segments left by transports whose process is gone (killed before ``close``).

    Only for hosts whose ``/dev/shm`` is not shared across PID namespaces: a PID is judged by ``/proc`` here.
    """
    removed = []
    for p in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        m = re.match(rf"{SEGMENT_PREFIX}.*-p(\d+)-[0-9a-f]+-\d+$", p.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


@TRANSPORTS.register("shm")
class ShmTransport(Transport):
    """Shared-memory slots between processes on one host (see the module docstring)."""

    backend = "shm"

    def __init__(self, device_id: str, limits: TransportLimits | None = None, *, shm_dir: str = "/dev/shm",
                 max_open_segments: int = 64) -> None:
        super().__init__(device_id, limits)
        self.shm_dir = Path(shm_dir)
        if not self.shm_dir.is_dir():
            raise TransportError(f"shared-memory directory {shm_dir} does not exist")
        self.segment_prefix = f"{SEGMENT_PREFIX}{_safe(device_id)}-p{os.getpid()}-{secrets.token_hex(4)}-"
        self.pool = ShmSlotPool(self.shm_dir, self.segment_prefix, self.limits)
        self._open: OrderedDict[str, _Segment] = OrderedDict()
        self._max_open = max_open_segments
        self._held: dict[str, TensorHandle] = {}

    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        self._check_open()
        dname, shape, nbytes = check_tensor(tensor, self.limits)
        slot = await wait_until(lambda: self.pool.alloc(nbytes), time.monotonic() + timeout_s,
                                f"shared-memory space for transfer {transfer_id} ({nbytes} bytes)")
        try:
            src, dst = byte_view(tensor), slot.seg.payload(nbytes)
            if nbytes >= THREAD_COPY_BYTES:
                await asyncio.to_thread(dst.copy_, src)
            else:
                dst.copy_(src)
        except asyncio.CancelledError:
            raise  # a copy may still be running in its thread: leave the slot busy until it goes stale
        except BaseException:
            self.pool.give_back(slot)
            raise
        self.pool.publish(slot, nbytes)
        return TensorHandle(transfer_id=transfer_id, shape=shape, dtype=dname, nbytes=nbytes,
                            src_device=self.device_id, dst_device=dst_device, backend=self.backend,
                            location=slot.name, seq=slot.gen, expires_ts=time.time() + self.limits.stale_after_s)

    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        self._check_open()
        self._check_handle(handle)
        check_out(handle, out)
        seg = self._segment(handle)
        src = seg.payload(handle.nbytes)
        if zero_copy and out is None:
            self._held[handle.transfer_id] = handle
            return typed_view(src, handle)
        if handle.nbytes >= THREAD_COPY_BYTES:
            try:
                result = await asyncio.wait_for(asyncio.to_thread(deliver, src, handle, out), timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"copy of transfer {handle.transfer_id} took over {timeout_s}s") from None
        else:
            result = deliver(src, handle, out)
        if seg.get(OFF_BUSY) != handle.seq:
            raise TransferExpired(f"transfer {handle.transfer_id}: slot reclaimed during the copy")
        seg.put(OFF_DONE, handle.seq)
        return result

    def release(self, handle: TensorHandle) -> None:
        """Mark a zero-copy slot done; its view must not be used afterwards."""
        if self._held.pop(handle.transfer_id, None) is None:
            return
        seg = self._open.get(handle.location)
        if seg is None:  # evicted from the mapping cache meanwhile
            try:
                seg = _Segment(self.shm_dir / handle.location)
            except FileNotFoundError:
                return
            self._open[handle.location] = seg
        if seg.get(OFF_BUSY) == handle.seq:
            seg.put(OFF_DONE, handle.seq)

    def _segment(self, handle: TensorHandle) -> _Segment:
        seg = self._open.get(handle.location)
        if seg is None:
            if "/" in handle.location or not handle.location.startswith(SEGMENT_PREFIX):
                raise TransportError(f"transfer {handle.transfer_id}: bad segment name {handle.location!r}")
            try:
                seg = _Segment(self.shm_dir / handle.location)
            except FileNotFoundError:
                raise TransferExpired(f"transfer {handle.transfer_id}: segment {handle.location} is gone") from None
            if seg.get(OFF_MAGIC) != MAGIC:
                seg.close()
                raise TransportError(f"transfer {handle.transfer_id}: {handle.location} is not a transport segment")
            self._open[handle.location] = seg
            while len(self._open) > self._max_open:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(handle.location)
        if seg.get(OFF_BUSY) != handle.seq:
            raise TransferExpired(f"transfer {handle.transfer_id}: slot was reclaimed (stale) or reused")
        if handle.nbytes > seg.get(OFF_CAPACITY):
            raise TransportError(f"transfer {handle.transfer_id}: {handle.nbytes} bytes exceed the slot")
        return seg

    def stats(self) -> dict[str, int]:
        """Pool occupancy (for metrics and tests)."""
        return {"pool_bytes": self.pool.pool_bytes, "busy_bytes": self.pool.busy_bytes,
                "busy_slots": len(self.pool.busy), "open_segments": len(self._open)}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for seg in self._open.values():
            seg.close()
        self._open.clear()
        self._held.clear()
        self.pool.close()
