"""NCCL point-to-point transport through ``torch.distributed`` (GPUs across hosts).

Every device that has an NCCL link joins one process group (rank per device, rendezvous through a TCP store at
``store_addr``; rank 0 hosts the store). Two extra groups separate the directions (lower→higher rank and
higher→lower), because NCCL runs a pair's sends and receives in one stream in issue order: with one group, a
driver and a guest that both send before they receive would wait on each other.

Each transfer is a fixed 16-int64 header (magic, sequence number, byte count, dtype, shape) followed by the raw
bytes as uint8. NCCL ignores tags, so ordering is by sequence: the sender numbers transfers per destination, and
the receiver drains its peer's channel in order, stashing transfers whose handle has not been asked for yet. The
handle carries ``location = "rank:N"`` and ``seq``. ``send`` posts the work and returns without waiting for the
receiver (the handle must reach it first). The same code runs on CPU with ``dist_backend="gloo"``, which is how
the unit tests exercise it.

Limits of the design, stated plainly: a posted NCCL operation cannot be cancelled. A ``recv`` that times out
leaves its drain running, so the next ``recv`` from that peer picks up where it left off; but a peer that dies
with a transfer half-posted wedges that peer's channel until the process group is re-created (worker restart).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import structlog
import torch

from shared.transport.base import (DTYPES, TRANSPORTS, TensorHandle, Transport, TransferTimeout, TransportError,
                                   TransportLimits, UnsupportedTensor, byte_view, check_out, check_tensor, deliver,
                                   typed_view, wait_until)

log = structlog.get_logger(__name__)

HEADER_LEN, MAX_NDIM, MAGIC = 16, 8, 0x5353_4E43  # "SSNC"
_DTYPE_CODES = list(DTYPES)


@dataclass
class _Pending:
    seq: int
    sent: Future  # done once the bytes have left this process's buffers
    tensors: tuple[torch.Tensor, ...]
    nbytes: int
    expires: float


@dataclass
class _Channel:
    """Receive state for one peer: the next sequence number to drain and what was drained but not yet asked for."""

    rank: int
    executor: ThreadPoolExecutor
    next_seq: int = 1
    stash: dict[int, tuple[list[int], torch.Tensor, float]] = field(default_factory=dict)


@TRANSPORTS.register("nccl")
class NcclTransport(Transport):
    """Point-to-point ``torch.distributed`` send/recv with ordered per-peer channels (see module docstring)."""

    backend = "nccl"

    def __init__(self, device_id: str, limits: TransportLimits | None = None, *, rank: int, world_size: int,
                 store_addr: str, peer_ranks: dict[str, int], dist_backend: str = "nccl",
                 torch_device: str | None = None, init_timeout_s: float = 120.0) -> None:
        super().__init__(device_id, limits)
        self.rank, self.world_size, self.store_addr = rank, world_size, store_addr
        self.peer_ranks = dict(peer_ranks)
        self.dist_backend = dist_backend
        self.torch_device = torch.device(torch_device or ("cuda" if dist_backend == "nccl" else "cpu"))
        self.init_timeout_s = init_timeout_s
        self._groups: tuple | None = None
        self._starting: asyncio.Future | None = None
        self._send_ex: dict[int, ThreadPoolExecutor] = {}
        self._wait_ex: dict[int, ThreadPoolExecutor] = {}
        self._channels: dict[int, _Channel] = {}
        self._seqs: dict[int, itertools.count] = {}
        self._pending: list[_Pending] = []
        self._abandoned: list[_Pending] = []
        self._inflight = 0

    # ---------------------------------------------------------------- setup
    async def start(self) -> None:
        """Join the process group. Every member must call this at startup: joining is collective."""
        self._check_open()
        if self._groups is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.to_thread(self._init_groups))
        self._groups = await asyncio.shield(self._starting)

    def _init_groups(self) -> tuple:
        import torch.distributed as dist

        if dist.is_initialized():
            raise TransportError("torch.distributed is already initialized in this process")
        host, _, port = self.store_addr.rpartition(":")
        timeout = timedelta(seconds=self.init_timeout_s)
        store = dist.TCPStore(host.strip("[]"), int(port), self.world_size, is_master=self.rank == 0,
                              timeout=timeout)
        dist.init_process_group(self.dist_backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        up = dist.new_group(backend=self.dist_backend, timeout=timeout)
        down = dist.new_group(backend=self.dist_backend, timeout=timeout)
        log.info("nccl_transport_joined", device=self.device_id, rank=self.rank, world_size=self.world_size,
                 dist_backend=self.dist_backend)
        return up, down

    def _group(self, src: int, dst: int):
        return self._groups[0] if src < dst else self._groups[1]

    def _peer(self, device: str) -> int:
        try:
            return self.peer_ranks[device]
        except KeyError:
            raise TransportError(f"device {device!r} is not in the nccl group of {self.device_id}") from None

    def _bind_thread(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.set_device(self.torch_device)

    # ---------------------------------------------------------------- sender side
    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        await self.start()
        dname, shape, nbytes = check_tensor(tensor, self.limits)
        if len(shape) > MAX_NDIM:
            raise UnsupportedTensor(f"nccl carries at most {MAX_NDIM} dimensions, transfer {transfer_id} has "
                                    f"{len(shape)}")
        dst = self._peer(dst_device)
        await wait_until(lambda: self._reserve(nbytes), time.monotonic() + timeout_s,
                         f"nccl send buffer space for transfer {transfer_id}")
        seq = next(self._seqs.setdefault(dst, itertools.count(1)))
        payload = byte_view(tensor).to(self.torch_device, copy=True)
        header = torch.tensor([MAGIC, seq, nbytes, _DTYPE_CODES.index(dname), len(shape), *shape]
                              + [0] * (HEADER_LEN - 5 - len(shape)), dtype=torch.int64, device=self.torch_device)
        ex = self._send_ex.setdefault(dst, ThreadPoolExecutor(1, thread_name_prefix=f"nccl-send-{dst}"))
        waiter = self._wait_ex.setdefault(dst, ThreadPoolExecutor(1, thread_name_prefix=f"nccl-sent-{dst}"))
        sent = waiter.submit(self._wait_sent, ex.submit(self._post_send, dst, header, payload))
        self._pending.append(_Pending(seq, sent, (header, payload), nbytes,
                                      time.monotonic() + self.limits.stale_after_s))
        return TensorHandle(transfer_id=transfer_id, shape=shape, dtype=dname, nbytes=nbytes,
                            src_device=self.device_id, dst_device=dst_device, backend=self.backend,
                            location=f"rank:{self.rank}", seq=seq, expires_ts=time.time() + self.limits.stale_after_s)

    def _post_send(self, dst: int, header: torch.Tensor, payload: torch.Tensor) -> list:
        import torch.distributed as dist

        self._bind_thread()
        group = self._group(self.rank, dst)
        works = [dist.isend(header, dst=dst, group=group)]
        if payload.numel():
            works.append(dist.isend(payload, dst=dst, group=group))
        return works

    def _wait_sent(self, posted: Future) -> None:
        works = posted.result()
        if self.dist_backend == "nccl":  # wait() would only order streams; poll the completion events
            while not all(w.is_completed() for w in works):
                time.sleep(0.0002)
        else:  # gloo marks a send complete only inside wait()
            for w in works:
                w.wait()

    def _reserve(self, nbytes: int) -> bool | None:
        self._sweep()
        if self._inflight + nbytes > self.limits.max_inflight_bytes:
            return None
        self._inflight += nbytes
        return True

    def _sweep(self) -> None:
        now, keep = time.monotonic(), []
        for p in self._pending:
            if p.sent.done():
                self._inflight -= p.nbytes
                if p.sent.exception() is not None:
                    log.warning("nccl_send_failed", device=self.device_id, seq=p.seq, error=str(p.sent.exception()))
            elif now > p.expires:
                self._inflight -= p.nbytes
                self._abandoned.append(p)  # NCCL may still read these buffers: keep them referenced
                log.warning("nccl_send_unclaimed", device=self.device_id, seq=p.seq)
            else:
                keep.append(p)
        self._pending = keep
        self._abandoned = [p for p in self._abandoned if not p.sent.done()]

    # ---------------------------------------------------------------- receiver side
    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        await self.start()
        self._check_handle(handle)
        check_out(handle, out)
        src = self._peer(handle.src_device)
        if handle.location != f"rank:{src}":
            raise TransportError(f"transfer {handle.transfer_id}: location {handle.location!r} is not rank {src}")
        ch = self._channels.get(src)
        if ch is None:
            ch = self._channels[src] = _Channel(src, ThreadPoolExecutor(1, thread_name_prefix=f"nccl-recv-{src}"))
        if handle.seq not in ch.stash:
            drained = asyncio.wrap_future(ch.executor.submit(self._drain, ch, handle.seq))
            try:
                await asyncio.wait_for(asyncio.shield(drained), timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"transfer {handle.transfer_id} (seq {handle.seq}) from rank {src} not "
                                      f"received within {timeout_s}s") from None
        entry = ch.stash.pop(handle.seq, None)
        if entry is None:
            raise TransportError(f"transfer {handle.transfer_id} (seq {handle.seq}) was already received")
        meta, buf, _ = entry
        if meta != [handle.nbytes, _DTYPE_CODES.index(handle.dtype), *handle.shape]:
            raise TransportError(f"transfer {handle.transfer_id}: received {meta}, handle says "
                                 f"{handle.nbytes} bytes {handle.dtype} {handle.shape}")
        return typed_view(buf, handle) if out is None else deliver(buf, handle, out)

    def _drain(self, ch: _Channel, upto: int) -> None:
        """Receive ``ch``'s transfers in order up to sequence ``upto``, into the stash (runs in the peer's thread)."""
        import torch.distributed as dist

        self._bind_thread()
        group = self._group(ch.rank, self.rank)
        while ch.next_seq <= upto:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.torch_device)
            dist.irecv(header, src=ch.rank, group=group).wait()
            h = header.cpu().tolist()
            if h[0] != MAGIC or h[1] != ch.next_seq:
                raise TransportError(f"nccl channel from rank {ch.rank}: bad header {h[:5]} "
                                     f"(expected seq {ch.next_seq})")
            nbytes, ndim = h[2], h[4]
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
            if nbytes:
                dist.irecv(buf, src=ch.rank, group=group).wait()
                if buf.is_cuda:
                    torch.cuda.current_stream().synchronize()  # handed to the event loop's thread next
            ch.stash[h[1]] = ([nbytes, h[3], *h[5:5 + ndim]], buf, time.monotonic() + self.limits.stale_after_s)
            ch.next_seq += 1
        now = time.monotonic()
        for seq in [s for s, e in ch.stash.items() if e[2] < now]:
            del ch.stash[seq]
            log.warning("nccl_recv_unclaimed", device=self.device_id, src_rank=ch.rank, seq=seq)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ex in [*self._send_ex.values(), *self._wait_ex.values(), *(c.executor for c in self._channels.values())]:
            ex.shutdown(wait=False, cancel_futures=True)
        if self._groups is not None:
            import torch.distributed as dist

            await asyncio.to_thread(dist.destroy_process_group)
        self._pending.clear()
        self._abandoned.clear()
