"""The segment RPC: a server every CPU/GPU worker runs (guest segments, status, weight fetches) and the
synchronous client the driver's compute thread uses.

Transport of the tensors: a tensor up to ``inline_max_bytes`` rides inline in the frame; a larger one goes over
the worker's tensor transport (``shm`` / ``tcp`` / ``cuda_ipc`` / ``nccl`` per device pair) and the frame carries
its handle (:class:`TensorMover`). The server runs one thread per connection with blocking sockets: a request is
read, executed and answered on the same thread, with no event-loop hop (``docs/guest-execution.md`` compares it
with an asyncio server, :class:`AsyncSegmentServer`, kept for that measurement).
"""
from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Protocol

import structlog
import torch

from services.worker.segment_wire import (MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, PREFIX, FrameError, FrameReader,
                                          SegmentCall, SegmentFrame, SegmentResult, connect, decode_header,
                                          encode_header, payload_tensor, send_frame, tensor_payload, wire_dtype)
from shared.transport.base import TensorHandle, Transport

log = structlog.get_logger(__name__)
Reply = list[tuple[SegmentFrame, "memoryview | bytes"]]
SEND_TIMEOUT_S = 10.0


class FrameHandler(Protocol):
    """What a server does with one request frame: the frames to send back (possibly none)."""

    def handle(self, msg: SegmentFrame, payload: bytearray) -> Reply: ...


class TensorMover:
    """Inline bytes for small tensors, the tensor transport for large ones; a synchronous API for worker threads
    (transport calls hop onto the worker's event loop)."""

    def __init__(self, device_id: str, transport: Transport | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, inline_max_bytes: int = 1 << 20,
                 timeout_s: float = 5.0) -> None:
        self.device_id, self.transport, self.loop = device_id, transport, loop
        self.inline_max_bytes, self.timeout_s = inline_max_bytes, timeout_s
        self.sent_inline = self.sent_transport = 0

    def pack(self, t: torch.Tensor, dst_device: str) -> tuple[TensorHandle | None, memoryview | bytes]:
        """(handle, b"") when the transport carries ``t``; (None, raw bytes) when it rides inline."""
        nbytes = t.numel() * t.element_size()
        if self.transport is None or self.loop is None or nbytes <= self.inline_max_bytes:
            self.sent_inline += 1
            return None, tensor_payload(t)
        fut = asyncio.run_coroutine_threadsafe(
            self.transport.send(t, dst_device, uuid.uuid4().hex, self.timeout_s), self.loop)
        self.sent_transport += 1
        return fut.result(self.timeout_s + 1.0), b""

    def unpack(self, shape: list[int], dtype: str, handle: TensorHandle | None, payload: bytearray,
               device: torch.device | str = "cpu", timeout_s: float | None = None) -> torch.Tensor:
        """The tensor of a frame: its inline payload, or fetched over the transport by its handle."""
        if handle is None:
            return payload_tensor(payload, shape, dtype, device)
        if self.transport is None or self.loop is None:
            raise FrameError("a tensor handle arrived but this worker has no tensor transport")
        if list(handle.shape) != list(shape) or handle.dtype != dtype:
            raise FrameError(f"handle {handle.transfer_id} is {handle.dtype} {handle.shape}, frame says {dtype} {shape}")
        t = timeout_s or self.timeout_s
        out = asyncio.run_coroutine_threadsafe(self.transport.recv(handle, t), self.loop).result(t + 1.0)
        return out if torch.device(device).type == "cpu" else out.to(device)


class SegmentServer:
    """TCP server: one thread per connection reads a frame, runs the handler, writes the reply frames."""

    def __init__(self, handler: FrameHandler, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, torch_threads: int | None = None) -> None:
        self.handler = handler
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.addr = f"{advertise_host or host}:{self.port}"
        self.torch_threads = torch_threads or torch.get_num_threads()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="segment-accept", daemon=True)

    def start(self) -> str:
        self._thread.start()
        return self.addr

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="segment-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        torch.set_num_threads(self.torch_threads)  # the device's thread count, as for the engine
        reader = FrameReader(conn)
        try:
            while True:
                msg, payload = reader.read()
                reply = self.handler.handle(msg, payload)
                conn.settimeout(SEND_TIMEOUT_S)  # a peer that stops reading costs this connection only
                for header, body in reply:
                    send_frame(conn, header, body)
        except (ConnectionError, OSError) as e:
            if not self._closed and not isinstance(e, ConnectionResetError):
                log.info("segment_connection_closed", error=repr(e))
        except Exception:  # a handler bug: drop this connection (the peer runs its segments itself)
            log.exception("segment_handler_failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and drop every connection (in-flight requests on them fail on the client side)."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class AsyncSegmentServer:
    """The same protocol on asyncio streams, handlers on one executor thread (kept to measure the hop cost)."""

    def __init__(self, handler: FrameHandler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler, self.host, self.port = handler, host, port
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment-exec")
        self._server: asyncio.base_events.Server | None = None
        self.addr = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.addr = f"{self.host}:{self.port}"
        return self.addr

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                hl, pl = PREFIX.unpack(await reader.readexactly(PREFIX.size))
                if hl > MAX_HEADER_BYTES or pl > MAX_PAYLOAD_BYTES:
                    raise FrameError("frame over the limits")
                msg = decode_header(await reader.readexactly(hl))
                payload = bytearray(await reader.readexactly(pl)) if pl else bytearray()
                for header, body in await loop.run_in_executor(self._pool, self.handler.handle, msg, payload):
                    h = encode_header(header)
                    writer.write(PREFIX.pack(len(h), len(body)) + h)
                    if len(body):
                        writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, FrameError, asyncio.CancelledError):
            pass  # peer gone, bad frame, or the server closing: drop this connection
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._pool.shutdown(wait=False)


class SegmentClient:
    """A blocking client of one peer's segment server. Calls are pipelined: ``call`` sends and returns an id,
    ``result`` waits for that id's reply (replies to calls given up on are dropped when they arrive)."""

    def __init__(self, addr: str, connect_timeout_s: float = 2.0) -> None:
        self.addr = addr
        self.sock = connect(addr, connect_timeout_s)
        self._reader = FrameReader(self.sock)
        self._ids = itertools.count(1)
        self._waiting: set[int] = set()
        self._stash: dict[int, tuple[SegmentResult, bytearray]] = {}
        self._send_lock = threading.Lock()
        self.closed = False

    def call(self, lease_id: str, tenant: str, segment: str, micro_batch: int, hidden: torch.Tensor,
             mover: TensorMover, dst_device: str, timeout_s: float) -> int:
        """Send one segment call; returns its id. ``OSError``/``FrameError`` when the connection is unusable."""
        cid = next(self._ids)
        handle, payload = mover.pack(hidden, dst_device)
        msg = SegmentCall(call_id=cid, lease_id=lease_id, tenant=tenant, segment=segment, micro_batch=micro_batch,
                          shape=list(hidden.shape), dtype=wire_dtype(hidden), handle=handle,
                          timeout_ms=timeout_s * 1e3)
        self.send(msg, payload, timeout_s)
        self._waiting.add(cid)
        return cid

    def result(self, call_id: int, deadline: float) -> tuple[SegmentResult, bytearray]:
        """The reply to ``call_id``; ``TimeoutError`` past ``deadline`` (monotonic; the call is then given up)."""
        try:
            while call_id not in self._stash:
                msg, payload = self._reader.read(deadline)
                if isinstance(msg, SegmentResult) and msg.call_id in self._waiting:
                    self._stash[msg.call_id] = (msg, payload)
            return self._stash.pop(call_id)
        finally:
            self._waiting.discard(call_id)

    def send(self, msg: SegmentFrame, payload: memoryview | bytes = b"", timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Write one frame; a send that does not complete in ``timeout_s`` leaves the connection unusable."""
        with self._send_lock:
            self.sock.settimeout(timeout_s)
            send_frame(self.sock, msg, payload)

    def request(self, msg: SegmentFrame, timeout_s: float = 5.0) -> tuple[SegmentFrame, bytearray]:
        """Send a non-call request and read the next non-result frame (status, weights); not for use while
        calls are outstanding on this connection."""
        self.send(msg)
        return self.read_other(time.monotonic() + timeout_s)

    def tensor_replies(self, q: SegmentFrame, frame_type: type, answers: Callable[[Any], bool], what: str,
                       timeout_s: float) -> Iterator[tuple[Any, bytearray]]:
        """Send a tensor query (weights, KV) and yield its reply frames up to the one marked ``last``:
        ``FrameError`` for a frame that does not answer it, ``RuntimeError`` naming ``what`` if the peer refuses,
        ``TimeoutError`` past ``timeout_s`` in all."""
        self.send(q)
        deadline = time.monotonic() + timeout_s
        while True:
            msg, payload = self.read_other(deadline)
            if not isinstance(msg, frame_type) or not answers(msg):
                raise FrameError(f"unexpected reply {type(msg).__name__} to a query for {what}")
            if msg.error:
                raise RuntimeError(f"peer refused {what}: {msg.error}")
            yield msg, payload
            if msg.last:
                return

    def read_other(self, deadline: float) -> tuple[SegmentFrame, bytearray]:
        """The next frame that is not a segment result (those are only read by ``result``)."""
        while True:
            reply, payload = self._reader.read(deadline)
            if not isinstance(reply, SegmentResult):
                return reply, payload

    def close(self) -> None:
        """Close the connection; a thread blocked in ``result`` gets a ``ConnectionError``."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
