"""A small TCP fault proxy for the reliability suite (``tc netem`` and toxiproxy are not available here).

It runs an asyncio server on its own thread (so the load generator's event loop cannot slow it down, and pytest's
per-test loops cannot close it) and forwards every connection to the target. Faults:

* ``latency(s)``: replies (target -> client) are delivered ``s`` seconds late, in order, without throttling;
* ``blackhole()``: nothing passes in either direction and new connections are accepted but never forwarded, so
  clients see a half-open connection; ``heal()`` ends it and resets every connection that lost bytes;
* ``reset_all()``: every open connection is closed with a TCP RST.

For blackholes it records when the clients closed the connections that were open when the fault began: the
detection time of a half-open connection.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass(eq=False)  # identity semantics: kept in sets
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None
    opened: float
    tasks: list[asyncio.Task] = field(default_factory=list)
    tainted: bool = False  # bytes were dropped: the stream can never be resynchronised
    closed: float | None = None


def _rst(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class FaultProxy:
    """``FaultProxy(host, port).start()`` listens on ``127.0.0.1:self.port`` and forwards to ``host:port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.mode = "pass"  # pass | blackhole
        self.latency_s = 0.0
        self.conns: set[_Conn] = set()
        self.accepted = 0
        self.resets = 0
        self.blackhole_started: float | None = None
        self.detections: list[float] = []  # seconds from blackhole start to a client closing a pre-existing conn
        self._watch: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # ------------------------------------------------------------ lifecycle (any thread)
    def start(self) -> "FaultProxy":
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------ faults (any thread)
    def latency(self, seconds: float) -> float:
        """Delay every reply by ``seconds`` from now on (0 ends it); returns the time it took effect."""
        self.latency_s = seconds
        return time.time()

    def blackhole(self) -> float:
        def go() -> None:
            self.mode = "blackhole"
            self.blackhole_started = time.time()
            self.detections = []
            self._watch = {c for c in self.conns if c.closed is None}
            for c in self._watch:
                c.tainted = True
        self._loop.call_soon_threadsafe(go)
        return time.time()

    def heal(self) -> float:
        """End a blackhole; connections that lost bytes are reset (their clients reconnect)."""
        def go() -> int:
            self.mode = "pass"
            n = 0
            for c in list(self.conns):
                if c.tainted:
                    self._close(c, rst=True)
                    n += 1
            return n
        self._call(_wrap(go))
        return time.time()

    def reset_all(self) -> int:
        """RST every open connection; returns how many."""
        def go() -> int:
            n = 0
            for c in list(self.conns):
                self._close(c, rst=True)
                n += 1
            self.resets += n
            return n
        return self._call(_wrap(go))

    def stats(self) -> dict:
        return {"open": len(self.conns), "accepted": self.accepted, "resets": self.resets,
                "watched": len(self._watch), "detections_s": sorted(self.detections)}

    # ------------------------------------------------------------ internals (proxy thread)
    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        for c in list(self.conns):
            self._close(c, rst=False)
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Conn(writer, None, time.time())
        self.conns.add(conn)
        if self.mode == "blackhole":  # accepted, never forwarded: a half-open connection
            conn.tainted = True
            conn.tasks.append(asyncio.current_task())
            await self._drain_forever(conn, reader)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._close(conn, rst=True)
            return
        conn.upstream = up_writer
        conn.tasks = [asyncio.create_task(self._pump(conn, reader, up_writer, delay=False)),
                      asyncio.create_task(self._pump(conn, up_reader, writer, delay=True))]

    async def _drain_forever(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except (OSError, asyncio.CancelledError):
            pass
        self._client_gone(conn)

    async def _pump(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    delay: bool) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer)) if delay else None
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if self.mode == "blackhole" or conn.tainted:
                    conn.tainted = True
                    continue
                if sender is not None:
                    queue.put_nowait((time.monotonic() + self.latency_s, data))
                else:
                    writer.write(data)
                    await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if sender is not None:
                sender.cancel()
        if not delay:  # the client side ended
            self._client_gone(conn)
        else:
            self._close(conn, rst=False)

    @staticmethod
    async def _send(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass

    def _client_gone(self, conn: _Conn) -> None:
        if conn in self._watch and conn.closed is None and self.blackhole_started is not None:
            self.detections.append(time.time() - self.blackhole_started)
        self._close(conn, rst=False)

    def _close(self, conn: _Conn, *, rst: bool) -> None:
        if conn.closed is not None:
            return
        conn.closed = time.time()
        self.conns.discard(conn)
        for w in (conn.client, conn.upstream):
            if w is None:
                continue
            if rst:
                _rst(w)
            else:
                w.transport.abort()
        for t in conn.tasks:
            if t is not asyncio.current_task():
                t.cancel()


async def _wrap(fn):
    return fn()
