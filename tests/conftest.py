"""Shared fixtures: a real redis-server per test session (or $REDIS_URL), a real 3-master Redis Cluster per session
when a test asks for one (or $REDIS_CLUSTER_URL), a unique key prefix per test.

``redis_url`` is the single server; a module that should also run against the cluster imports the parametrized
``redis_url`` of ``support/redis_kinds.py``."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from shared.procutil import LocalRedisCluster, RedisServer

REPO = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("SLICESCHED_TRACES", REPO.parent / "shared" / "traces"))


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory) -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server_url) -> str:
    return redis_server_url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory) -> str:
    """A node of a private Redis Cluster: 3 masters with one replica each, on loopback."""
    url = os.environ.get("REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3).start()
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture
async def redis(redis_url, prefix):
    from shared.redis_util import command_client

    r = command_client(redis_url)
    try:
        yield r
    finally:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await r.delete(*keys)
        await r.aclose()
