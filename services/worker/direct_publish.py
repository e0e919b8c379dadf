"""Token chunks published from the compute thread itself.

Most steps only carry mid-stream tokens. Handing them to the event loop costs a thread hop per step, and the
loop's Python work then competes with the next step for the GIL; on a small model that doubles the time per
token. The compute thread instead writes such a step's chunks with one pipelined XADD on its own synchronous
connection (short timeout, no retries). Anything else goes through the event loop as before: chunks that finish
a request (the terminal-state fence comes first), and every chunk while the loop still has chunks to publish or
after a failed write (so a request's chunks never overtake each other); after a failure the direct path rests
for ``rest_s``.
"""
from __future__ import annotations

import time

import structlog
from redis.exceptions import RedisClusterException

from shared.codec import encode
from shared.redis_util import REDIS_ERRORS, sync_client
from shared.streams import FIELD_MSG, FIELD_TYPE

log = structlog.get_logger()

# a cluster client that cannot reach any node (RedisClusterException) is one more reason to fall back to the loop
SYNC_ERRORS = (*REDIS_ERRORS, RedisClusterException)


class DirectPublisher:
    def __init__(self, url: str, *, maxlen: int, timeout_s: float = 0.5, rest_s: float = 1.0,
                 name: str | None = None) -> None:
        self.url, self.timeout_s, self.name = url, timeout_s, name
        self.client = None  # made at the first publish: a cluster client connects when it is made
        self.maxlen, self.rest_s = maxlen, rest_s
        self.resting_until = 0.0
        self.published = self.failures = 0

    def available(self) -> bool:
        return time.monotonic() >= self.resting_until

    def publish(self, items: list[tuple[str, object]]) -> bool:
        """XADD every ``(stream, message)`` in one round trip; False (nothing is retried here) on a Redis error.
        A failed pipeline may have written some entries: the gateway drops repeated chunks by ``seq``."""
        try:
            if self.client is None:
                self.client = sync_client(self.url, socket_timeout=self.timeout_s,
                                          socket_connect_timeout=self.timeout_s, retries=0, name=self.name, wait_s=0)
            pipe = self.client.pipeline(transaction=False)
            for stream, msg in items:
                pipe.xadd(stream, {FIELD_TYPE: type(msg).__name__, FIELD_MSG: encode(msg)}, maxlen=self.maxlen,
                          approximate=True)
            pipe.execute()
        except SYNC_ERRORS as e:
            self.failures += 1
            self.resting_until = time.monotonic() + self.rest_s
            log.warning("direct_publish_failed", error=repr(e), items=len(items))
            return False
        self.published += len(items)
        return True

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        except Exception:  # closing a broken connection must not mask the shutdown
            pass
