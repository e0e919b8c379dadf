"""Redis clients with the timeouts this project relies on (see RELIABILITY.md).

* command client: a *blocking* pool (waits for a free connection up to ``pool_timeout_s`` instead of raising),
  ``socket_timeout`` so a half-open connection cannot hang a call, a bounded retry policy, health checks.
* blocking-read client: its own connection with ``socket_timeout`` above the XREADGROUP block time, and no retries
  (a retried ``>`` read can leave entries pending whose reply was lost; the consumer re-reads its PEL instead).
"""
from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def command_client(url: str, *, max_connections: int = 64, pool_timeout_s: float = 5.0,
                   socket_timeout_s: float = 5.0, name: str | None = None) -> aioredis.Redis:
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, socket_timeout=socket_timeout_s,
        socket_connect_timeout=3.0, socket_keepalive=True, health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        client_name=name,
    )
    return aioredis.Redis(connection_pool=pool)


def blocking_client(url: str, *, block_ms: int, name: str | None = None) -> aioredis.Redis:
    """A single-connection client for blocking reads: socket timeout = block time + 2 s, no retries."""
    pool = BlockingConnectionPool.from_url(
        url, max_connections=2, timeout=5.0, socket_timeout=block_ms / 1000.0 + 2.0, socket_connect_timeout=3.0,
        socket_keepalive=True, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=0),
        client_name=name,
    )
    return aioredis.Redis(connection_pool=pool)


async def close_quietly(*clients: aioredis.Redis | None) -> None:
    for c in clients:
        if c is None:
            continue
        try:
            await c.aclose()
        except Exception:  # closing during shutdown must never raise
            pass
