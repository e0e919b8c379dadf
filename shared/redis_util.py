"""Redis clients with the timeouts this project relies on (see RELIABILITY.md), for a single server or a Redis
Cluster alike.

* command client: waits for a free connection up to ``pool_timeout_s`` instead of raising, ``socket_timeout`` so a
  half-open connection cannot hang a call, a bounded retry policy, health checks.
* blocking-read client: its own connection with ``socket_timeout`` above the XREADGROUP block time, and no retries
  (a retried ``>`` read can leave entries pending whose reply was lost; the consumer re-reads its PEL instead).

Whether ``REDIS_URL`` names a node of a Redis Cluster is decided once per process and URL
(:func:`is_cluster`): ``SLICESCHED_REDIS_CLUSTER=1``/``0`` says it, ``auto`` (the default) asks the server
(``CLUSTER MYID`` answers only on a cluster node). On a cluster the factories return redis-py's cluster clients,
which route every command by its key's slot and follow failovers; callers use the same methods either way. What
the cluster asks of callers: a Lua script, MULTI or multi-key command keeps its keys in one slot (hash tags such
as ``{gmg}``), and a script called inside a pipeline goes as EVAL (:func:`pipeline_script`).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import ClusterDownError, ResponseError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from shared.config import redis_cluster_setting

# Transient trouble: the server is unreachable or stalled, or (cluster) a slot's master failed and its replica is
# not promoted yet. Callers retry these; anything else is a bug or a refusal.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, ClusterDownError, TryAgainError,
                SlotNotCoveredError)

_MODES: dict[str, bool] = {}
PROBE_WAIT_S = 10.0


class RedisModeUnknown(RuntimeError):
    """``SLICESCHED_REDIS_CLUSTER=auto`` and the server could not be asked whether it is a cluster node."""


def is_cluster(url: str, *, wait_s: float = PROBE_WAIT_S) -> bool:
    """True if ``url`` names a Redis Cluster node: ``SLICESCHED_REDIS_CLUSTER`` when it says so, else asked once
    per process (``CLUSTER MYID``), retrying for up to ``wait_s`` while the server is unreachable."""
    forced = redis_cluster_setting()
    if forced is not None:
        return forced
    if url in _MODES:
        return _MODES[url]
    deadline = time.monotonic() + wait_s
    while True:
        r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, retry=None)
        try:
            r.execute_command("CLUSTER", "MYID")
            mode = True
        except ResponseError:  # "cluster support disabled" (or an ACL without CLUSTER: no cluster client works)
            mode = False
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            if time.monotonic() >= deadline:
                raise RedisModeUnknown(
                    f"cannot tell whether REDIS_URL is a Redis Cluster node: unreachable for {wait_s:g} s ({e}); "
                    "set SLICESCHED_REDIS_CLUSTER=1 (cluster) or 0 (single server)") from None
            time.sleep(0.2)
            continue
        finally:
            r.close()
        _MODES[url] = mode
        return mode


class _BoundedCluster(AsyncRedisCluster):
    """redis-py's asyncio cluster client raises at once when a node's connections are all busy; this one waits up
    to ``pool_timeout_s`` for one of ``max_connections`` slots, as the single-server blocking pool does."""

    def __init__(self, *args: Any, bound: int, pool_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._busy = asyncio.Semaphore(bound)
        self._pool_timeout_s = pool_timeout_s

    async def _acquire(self) -> None:
        try:
            await asyncio.wait_for(self._busy.acquire(), timeout=self._pool_timeout_s)
        except asyncio.TimeoutError:
            raise RedisConnectionError("no free Redis connection within the pool timeout") from None

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self._acquire()
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._busy.release()

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("shard_hint is not supported on a cluster")
        return _BoundedPipeline(self, transaction)


class _BoundedPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list:
        client = self.cluster_client
        # redis-py 8.1's cluster MULTI passes the commands' ``keys`` hint on to response callbacks that do not take
        # it (SMEMBERS, ...); the other execution paths drop it. Drop it here too.
        for cmd in getattr(self._execution_strategy, "_command_queue", ()):
            cmd.kwargs.pop("keys", None)
        await client._acquire()
        try:
            return await super().execute(raise_on_error=raise_on_error, allow_redirections=allow_redirections)
        finally:
            client._busy.release()


def _cluster(url: str, *, max_connections: int, pool_timeout_s: float, socket_timeout_s: float, retries: int,
             name: str | None, health_check_interval: float = 0) -> AsyncRedisCluster:
    # per node at most twice the bound: a pipeline's redirected commands may take a second connection
    return _BoundedCluster.from_url(
        url, max_connections=2 * max_connections, bound=max_connections, pool_timeout_s=pool_timeout_s, socket_timeout=socket_timeout_s,
        socket_connect_timeout=3.0, socket_keepalive=True, health_check_interval=health_check_interval,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=retries),
        require_full_coverage=False, client_name=name)


def command_client(url: str, *, max_connections: int = 64, pool_timeout_s: float = 5.0,
                   socket_timeout_s: float = 5.0, name: str | None = None) -> aioredis.Redis:
    """The client for commands (a :class:`redis.asyncio.RedisCluster` on a cluster)."""
    if is_cluster(url):
        return _cluster(url, max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                        socket_timeout_s=socket_timeout_s, retries=3, name=name, health_check_interval=15)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, socket_timeout=socket_timeout_s,
        socket_connect_timeout=3.0, socket_keepalive=True, health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        client_name=name,
    )
    return aioredis.Redis(connection_pool=pool)


def blocking_client(url: str, *, block_ms: int, name: str | None = None) -> aioredis.Redis:
    """A client for blocking reads: socket timeout = block time + 2 s, no retries (one connection per node)."""
    if is_cluster(url):
        return _cluster(url, max_connections=2, pool_timeout_s=5.0, socket_timeout_s=block_ms / 1000.0 + 2.0,
                        retries=0, name=name)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=2, timeout=5.0, socket_timeout=block_ms / 1000.0 + 2.0, socket_connect_timeout=3.0,
        socket_keepalive=True, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=0),
        client_name=name,
    )
    return aioredis.Redis(connection_pool=pool)


def sync_client(url: str, *, socket_timeout: float = 5.0, socket_connect_timeout: float | None = None,
                retries: int = 3, name: str | None = None) -> redis.Redis:
    """A synchronous client (launcher, inspect, the worker's compute-thread publisher), cluster-aware likewise."""
    connect = socket_connect_timeout if socket_connect_timeout is not None else min(socket_timeout, 3.0)
    if is_cluster(url):
        return SyncRedisCluster.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=connect, socket_keepalive=True,
            client_name=name, require_full_coverage=False,
            retry=SyncRetry(NoBackoff() if retries == 0 else ExponentialWithJitterBackoff(base=0.05, cap=1.0),
                            retries=retries))
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=connect,
                                socket_keepalive=True, client_name=name, retry_on_timeout=retries > 0,
                                retry=SyncRetry(NoBackoff(), retries) if retries else None)


def pipeline_script(pipe: Any, script: str, keys: list[str], args: list[Any]) -> None:
    """Queue a Lua script in a pipeline. As EVAL: a cluster pipeline refuses EVALSHA, and Redis keeps the
    compiled script in its cache either way, so only the text travels again."""
    pipe.eval(script, len(keys), *keys, *args)


async def disconnect_now(client: aioredis.Redis) -> None:
    """Close every connection of ``client`` at once (wakes a blocked XREAD); the client reconnects if used."""
    if isinstance(client, AsyncRedisCluster):
        for node in client.get_nodes():
            await node.disconnect()
    else:
        await client.connection_pool.disconnect()


async def close_quietly(*clients: aioredis.Redis | None) -> None:
    for c in clients:
        if c is None:
            continue
        try:
            await c.aclose()
        except Exception:  # closing during shutdown must never raise
            pass

