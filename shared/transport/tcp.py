"""TCP transport between CPU workers on different hosts (or the same one).

Pull model: ``send`` copies the tensor into the sender's bounded outbox and returns a handle naming the sender's
``host:port``; the receiver connects (connections are pooled per endpoint and reused), asks for the transfer id
and reads the bytes straight into the destination tensor. Pulling keeps buffering on the sender, where the limits
are enforced, and a receiver that dies costs the sender nothing but an outbox entry that expires after
``stale_after_s``. An entry is removed once its bytes have been written to a receiver (one fetch per transfer).

Frames: a little-endian u32 length, a MessagePack header (:class:`FetchRequest` / :class:`FetchReply`), then, for
a successful reply, exactly ``nbytes`` raw tensor bytes.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass

import msgspec
import structlog
import torch

from shared.transport.base import (TRANSPORTS, TensorHandle, Transport, TransferExpired, TransferTimeout,
                                   TransportError, TransportLimits, byte_view, check_out, check_tensor, torch_dtype,
                                   wait_until)

log = structlog.get_logger(__name__)

_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
INLINE_PAYLOAD_BYTES = 64 * 1024  # below this, header and payload go out in one write
THREAD_COPY_BYTES = 2 * 1024**2  # staging copies above this run in a thread so the server keeps serving


class FetchRequest(msgspec.Struct, frozen=True, kw_only=True, tag="fetch"):
    """Receiver → sender: send me the bytes of this transfer."""

    transfer_id: str
    nbytes: int


class FetchReply(msgspec.Struct, frozen=True, kw_only=True, tag="reply"):
    """Sender → receiver: ``ok`` and ``nbytes`` raw bytes follow, or why not."""

    transfer_id: str
    ok: bool
    nbytes: int = 0
    dtype: str = ""
    shape: list[int] = []
    error: str = ""


_enc = msgspec.msgpack.Encoder()
_dec_req = msgspec.msgpack.Decoder(FetchRequest)
_dec_reply = msgspec.msgpack.Decoder(FetchReply)


def _frame(msg: msgspec.Struct) -> bytes:
    body = _enc.encode(msg)
    return _LEN.pack(len(body)) + body


async def _recv_exactly(sock: socket.socket, mv: memoryview) -> None:
    loop, pos = asyncio.get_running_loop(), 0
    while pos < len(mv):
        n = await loop.sock_recv_into(sock, mv[pos:])
        if n == 0:
            raise ConnectionError("connection closed by peer")
        pos += n


async def _read_header(sock: socket.socket, decoder: msgspec.msgpack.Decoder) -> msgspec.Struct:
    raw = bytearray(_LEN.size)
    await _recv_exactly(sock, memoryview(raw))
    (n,) = _LEN.unpack(raw)
    if n > MAX_HEADER_BYTES:
        raise TransportError(f"frame header of {n} bytes is above {MAX_HEADER_BYTES}")
    body = bytearray(n)
    await _recv_exactly(sock, memoryview(body))
    return decoder.decode(body)


def parse_endpoint(location: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port)."""
    host, _, port = location.rpartition(":")
    if not host or not port.isdigit():
        raise TransportError(f"bad tcp endpoint {location!r} (expected host:port)")
    return host.strip("[]"), int(port)


def _cpu_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


@dataclass
class _Staged:
    transfer_id: str
    payload: torch.Tensor  # flat uint8, CPU, owned by the outbox
    nbytes: int
    expires: float


class _ConnectionPool:
    """Idle client sockets per endpoint, reused across fetches."""

    def __init__(self, max_idle: int = 4) -> None:
        self.max_idle = max_idle
        self.idle: dict[tuple[str, int], list[socket.socket]] = {}

    async def get(self, ep: tuple[str, int]) -> tuple[socket.socket, bool]:
        idle = self.idle.get(ep)
        if idle:
            return idle.pop(), True
        loop = asyncio.get_running_loop()
        family, type_, proto, _, addr = (await loop.getaddrinfo(*ep, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return sock, False

    def put(self, ep: tuple[str, int], sock: socket.socket) -> None:
        idle = self.idle.setdefault(ep, [])
        if len(idle) < self.max_idle:
            idle.append(sock)
        else:
            sock.close()

    def close(self) -> None:
        for socks in self.idle.values():
            for s in socks:
                s.close()
        self.idle.clear()


@TRANSPORTS.register("tcp")
class TcpTransport(Transport):
    """Length-prefixed TCP pulls from the sender's server (see the module docstring)."""

    backend = "tcp"

    def __init__(self, device_id: str, limits: TransportLimits | None = None, *, bind_host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None, max_idle_connections: int = 4) -> None:
        super().__init__(device_id, limits)
        self.bind_host, self.port = bind_host, port
        self.advertise_host = advertise_host or (bind_host if bind_host not in ("", "0.0.0.0", "::")
                                                 else socket.gethostname())
        self._outbox: dict[str, _Staged] = {}
        self._inflight = 0
        self._space = asyncio.Event()
        self._pool = _ConnectionPool(max_idle_connections)
        self._lsock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._conns: set[socket.socket] = set()

    @property
    def endpoint(self) -> str:
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self._check_open()
        if self._lsock is not None:
            return
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        self._lsock = socket.create_server((self.bind_host, self.port), family=family, backlog=128)
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self._spawn(self._accept_loop())
        self._spawn(self._expiry_loop())
        log.debug("tcp_transport_listening", device=self.device_id, endpoint=self.endpoint)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- sender side
    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        await self.start()
        dname, shape, nbytes = check_tensor(tensor, self.limits)
        if transfer_id in self._outbox:
            raise TransportError(f"transfer {transfer_id} is already staged")
        await wait_until(lambda: self._reserve(nbytes), time.monotonic() + timeout_s,
                         f"tcp outbox space for transfer {transfer_id} ({nbytes} bytes)", wake=self._space)
        try:
            payload = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes >= THREAD_COPY_BYTES:
                await asyncio.to_thread(payload.copy_, byte_view(tensor))
            else:
                payload.copy_(byte_view(tensor))
        except BaseException:
            self._unreserve(nbytes)
            raise
        self._outbox[transfer_id] = _Staged(transfer_id, payload, nbytes,
                                            time.monotonic() + self.limits.stale_after_s)
        return TensorHandle(transfer_id=transfer_id, shape=shape, dtype=dname, nbytes=nbytes,
                            src_device=self.device_id, dst_device=dst_device, backend=self.backend,
                            location=self.endpoint, expires_ts=time.time() + self.limits.stale_after_s)

    def _reserve(self, nbytes: int) -> bool | None:
        self._expire()
        if self._inflight + nbytes > self.limits.max_inflight_bytes:
            return None
        self._inflight += nbytes
        return True

    def _unreserve(self, nbytes: int) -> None:
        self._inflight -= nbytes
        self._space.set()

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, s in self._outbox.items() if s.expires < now]:
            staged = self._outbox.pop(tid)
            self._unreserve(staged.nbytes)
            log.warning("tcp_transfer_expired", device=self.device_id, transfer_id=tid)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.limits.stale_after_s / 4))
            self._expire()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._lsock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(conn)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    req = await _read_header(conn, _dec_req)
                except ConnectionError:
                    return  # the client closed its pooled connection
                staged = self._outbox.get(req.transfer_id)
                if staged is None or staged.nbytes != req.nbytes:
                    why = "unknown, expired or already fetched" if staged is None else "byte count mismatch"
                    await loop.sock_sendall(conn, _frame(FetchReply(transfer_id=req.transfer_id, ok=False,
                                                                    error=why)))
                    continue
                del self._outbox[req.transfer_id]
                try:
                    head = _frame(FetchReply(transfer_id=req.transfer_id, ok=True, nbytes=staged.nbytes))
                    if staged.nbytes <= INLINE_PAYLOAD_BYTES:
                        await loop.sock_sendall(conn, head + _cpu_bytes(staged.payload).tobytes())
                    else:
                        await loop.sock_sendall(conn, head)
                        await loop.sock_sendall(conn, _cpu_bytes(staged.payload))
                finally:
                    self._unreserve(staged.nbytes)
        except (OSError, TransportError, msgspec.DecodeError) as e:
            log.info("tcp_peer_disconnected", device=self.device_id, error=str(e))
        finally:
            self._conns.discard(conn)
            conn.close()

    # ---------------------------------------------------------------- receiver side
    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        self._check_open()
        self._check_handle(handle)
        check_out(handle, out)
        ep = parse_endpoint(handle.location)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(handle.shape, dtype=torch_dtype(handle.dtype))
        try:
            async with asyncio.timeout(timeout_s):
                for attempt in range(2):
                    sock, reused = await self._pool.get(ep)
                    try:
                        await self._fetch(sock, handle, dst)
                    except _Refused:
                        self._pool.put(ep, sock)
                        raise
                    except ConnectionError:
                        sock.close()
                        if reused and attempt == 0:
                            continue  # the pooled connection had gone stale; one retry on a fresh one
                        raise
                    except BaseException:
                        sock.close()
                        raise
                    self._pool.put(ep, sock)
                    break
        except TimeoutError:
            raise TransferTimeout(f"transfer {handle.transfer_id} from {handle.location} took over "
                                  f"{timeout_s}s") from None
        except OSError as e:
            raise TransportError(f"transfer {handle.transfer_id} from {handle.location}: {e}") from None
        if out is not None and not direct:
            out.copy_(dst)
            return out
        return dst

    async def _fetch(self, sock: socket.socket, handle: TensorHandle, dst: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, _frame(FetchRequest(transfer_id=handle.transfer_id, nbytes=handle.nbytes)))
        reply = await _read_header(sock, _dec_reply)
        if not reply.ok:
            raise _Refused(f"transfer {handle.transfer_id} from {handle.location}: {reply.error}")
        if reply.transfer_id != handle.transfer_id or reply.nbytes != handle.nbytes:
            raise TransportError(f"transfer {handle.transfer_id}: reply for {reply.transfer_id} "
                                 f"({reply.nbytes} bytes) does not match the handle")
        if handle.nbytes:
            await _recv_exactly(sock, _cpu_bytes(byte_view(dst)))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in list(self._conns):
            conn.close()
        if self._lsock is not None:
            self._lsock.close()
        self._pool.close()
        self._outbox.clear()
        self._inflight = 0


class _Refused(TransferExpired):
    """The sender answered but does not hold the transfer; the connection stays usable."""

    def __init__(self, why: str) -> None:
        super().__init__(f"sender refused the fetch of {why}")
