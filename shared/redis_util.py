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
as ``{gmg}``), and scripts go through :class:`LuaScript` and :func:`run_pipeline` (which also waits for a replica
after the writes that must survive a failover).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Callable, Iterable

import redis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import ClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import ClusterDownError, NoScriptError, ResponseError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from shared.config import env_number, redis_cluster_setting

log = structlog.get_logger()

# Transient trouble: the server is unreachable or stalled, or (cluster) a slot's master failed and its replica is
# not promoted yet. Callers retry these; anything else is a bug or a refusal.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, ClusterDownError, TryAgainError,
                SlotNotCoveredError)

_MODES: dict[str, bool] = {}
PROBE_WAIT_S = 10.0


class RedisModeUnknown(RedisConnectionError):
    """``SLICESCHED_REDIS_CLUSTER=auto`` and the server could not be asked whether it is a cluster node (a
    connection error: callers treat it as Redis being down)."""


def is_cluster(url: str, *, wait_s: float = PROBE_WAIT_S, connect_timeout_s: float = 2.0) -> bool:
    """True if ``url`` names a Redis Cluster node: ``SLICESCHED_REDIS_CLUSTER`` when it says so, else asked once
    per process (``CLUSTER MYID``), retrying for up to ``wait_s`` while the server is unreachable."""
    forced = redis_cluster_setting()
    if forced is not None:
        return forced
    if url in _MODES:
        return _MODES[url]
    deadline = time.monotonic() + wait_s
    while True:
        r = redis.Redis.from_url(url, socket_timeout=connect_timeout_s, socket_connect_timeout=connect_timeout_s,
                                 retry=None)
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


class _Deferred:
    """A client made at its first use, for a process that started while Redis was unreachable and had to ask it
    whether it is a cluster node (``auto``). Until Redis answers, every use raises :class:`RedisModeUnknown` (a
    connection error) at once, asking again at most every ``retry_s``."""

    def __init__(self, url: str, make: Callable[[bool], Any], retry_s: float = 0.5) -> None:
        self._url, self._make, self._retry_s = url, make, retry_s
        self._client: Any = None
        self._next = 0.0

    def resolve(self) -> Any:
        if self._client is None:
            if time.monotonic() < self._next:
                raise RedisModeUnknown(f"Redis at {self._url} not reachable yet")
            self._next = time.monotonic() + self._retry_s
            self._client = self._make(is_cluster(self._url, wait_s=0, connect_timeout_s=0.5))
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _made(url: str, make: Callable[[bool], Any]) -> Any:
    try:
        return make(is_cluster(url, wait_s=0, connect_timeout_s=0.5))
    except RedisModeUnknown:
        return _Deferred(url, make)


def unwrap(client: Any) -> Any:
    """The real client behind a deferred one (raises a connection error while Redis is unreachable)."""
    return client.resolve() if isinstance(client, _Deferred) else client


def command_client(url: str, *, max_connections: int = 64, pool_timeout_s: float = 5.0,
                   socket_timeout_s: float = 5.0, name: str | None = None) -> aioredis.Redis:
    """The client for commands (a :class:`redis.asyncio.RedisCluster` on a cluster)."""
    def make(cluster: bool) -> aioredis.Redis:
        if cluster:
            return _cluster(url, max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                            socket_timeout_s=socket_timeout_s, retries=3, name=name, health_check_interval=15)
        return _single(url, max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                       socket_timeout_s=socket_timeout_s, name=name)

    return _made(url, make)


def _single(url: str, *, max_connections: int, pool_timeout_s: float, socket_timeout_s: float,
            name: str | None) -> aioredis.Redis:
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
    def make(cluster: bool) -> aioredis.Redis:
        if cluster:
            return _cluster(url, max_connections=2, pool_timeout_s=5.0, socket_timeout_s=block_ms / 1000.0 + 2.0,
                            retries=0, name=name)
        pool = BlockingConnectionPool.from_url(
            url, max_connections=2, timeout=5.0, socket_timeout=block_ms / 1000.0 + 2.0, socket_connect_timeout=3.0,
            socket_keepalive=True, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=0),
            client_name=name,
        )
        return aioredis.Redis(connection_pool=pool)

    return _made(url, make)


def sync_client(url: str, *, socket_timeout: float = 5.0, socket_connect_timeout: float | None = None,
                retries: int = 3, name: str | None = None, wait_s: float = PROBE_WAIT_S) -> redis.Redis:
    """A synchronous client (launcher, inspect, the worker's compute-thread publisher), cluster-aware likewise
    (asks the server for up to ``wait_s`` in ``auto`` mode, then raises :class:`RedisModeUnknown`). A cluster
    client connects when it is made."""
    connect = socket_connect_timeout if socket_connect_timeout is not None else min(socket_timeout, 3.0)
    if is_cluster(url, wait_s=wait_s, connect_timeout_s=min(connect, 2.0)):
        return SyncRedisCluster.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=connect, socket_keepalive=True,
            client_name=name, require_full_coverage=False,
            retry=SyncRetry(NoBackoff() if retries == 0 else ExponentialWithJitterBackoff(base=0.05, cap=1.0),
                            retries=retries))
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=connect,
                                socket_keepalive=True, client_name=name, retry_on_timeout=retries > 0,
                                retry=SyncRetry(NoBackoff(), retries) if retries else None)


class LuaScript:
    """A Lua script run by its SHA1 inside a pipeline (:func:`run_pipeline` loads it where a node lacks it)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        # as a raw command: redis-py's cluster pipeline refuses its evalsha() method, not the command
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


_WAIT_REST_S = 5.0  # after a WAIT that no replica answered in time, that master's writes go without it this long
_wait_rest: dict[str, float] = {}
unreplicated_writes = 0  # WAITs that timed out (a metric for tests and logs)


def wait_ms() -> int:
    """``SLICESCHED_REDIS_WAIT_MS`` (default 100): how long a write that hands a request on waits for a replica to
    acknowledge it (see docs/reliability.md, row 22); 0 turns the WAIT off."""
    return env_number("SLICESCHED_REDIS_WAIT_MS", 100, int, minimum=0)


REPLICA_VIEW_S = 5.0  # how old the client's view of which masters have a synced replica may get


async def _masters_with_replicas(client: Any, keys: list[str]) -> list:
    """The masters (cluster nodes) serving ``keys`` that have a replica in sync and are not resting from a WAIT
    that timed out. Which masters have one is asked (``CLUSTER SLOTS``, which lists a replica once it has synced)
    at most every ``REPLICA_VIEW_S``: replicas join, sync and fail over without telling the client."""
    if not keys or not isinstance(client, AsyncRedisCluster) or not wait_ms():
        return []  # a single server: none in this project's deployments (docs/deployment.md)
    now = time.monotonic()
    view = getattr(client, "_replica_view", None)
    if view is None or now - view[0] > REPLICA_VIEW_S:
        counts = view[1] if view else {}
        try:
            slots = await client.execute_command("CLUSTER SLOTS")
            counts = {f"{v['primary'][0]}:{v['primary'][1]}": len(v["replicas"]) for v in slots.values()}
        except REDIS_ERRORS as e:  # keep the last view; the write itself will meet the trouble
            log.debug("cluster_slots_failed", error=repr(e))
        view = (now, counts)
        client._replica_view = view
    out = {}
    for k in keys:
        owners = client.nodes_manager.slots_cache.get(client.keyslot(k)) or []
        if owners and view[1].get(owners[0].name, 0) > 0 and _wait_rest.get(owners[0].name, 0.0) <= now:
            out[owners[0].name] = owners[0]
    return list(out.values())


async def run_pipeline(client: Any, build: Callable[[Any], None], *, scripts: Iterable[LuaScript] = (),
                       replicate: Iterable[str] = ()) -> list:
    """Run the commands ``build(pipe)`` queues in one pipeline (not a transaction) and return their replies.

    ``scripts``: the :class:`LuaScript` s it may call; a node that does not know one (a fresh or promoted master)
    gets it loaded and the pipeline runs once more, so its commands must be idempotent or scripts.
    ``replicate``: keys whose writes must reach a replica before this returns: on a Redis Cluster a ``WAIT 1`` goes
    to each master serving them, on the same connection as the writes, so it covers them (``SLICESCHED_REDIS_WAIT_MS``
    bounds the wait; a WAIT that times out is logged and that master is not waited on for 5 s)."""
    client = unwrap(client)
    if isinstance(client, AsyncRedisCluster) and client._initialize:
        await client.initialize()
    keys = list(replicate)
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        build(pipe)
        n = len(pipe)
        masters = await _masters_with_replicas(client, keys)
        for node in masters:
            pipe.execute_command("WAIT", 1, wait_ms(), target_nodes=node)
        try:
            replies = await pipe.execute()
        except NoScriptError:
            if attempt == 2:
                raise
            for s in scripts:
                await client.script_load(s.text)  # on a cluster: every master
            continue
        _check_waits(masters, replies[n:])
        return replies[:n]
    raise AssertionError("unreachable")


def _check_waits(masters: list, replies: list) -> None:
    global unreplicated_writes
    for node, acked in zip(masters, replies):
        if int(acked) < 1:
            unreplicated_writes += 1
            _wait_rest[node.name] = time.monotonic() + _WAIT_REST_S
            log.warning("redis_write_unreplicated", master=node.name, wait_ms=wait_ms())


async def disconnect_now(client: aioredis.Redis) -> None:
    """Close every connection of ``client`` at once (wakes a blocked XREAD); the client reconnects if used."""
    if isinstance(client, _Deferred) and client._client is None:
        return
    client = unwrap(client)
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

