"""Shared fixtures: a real redis-server per test session (or $REDIS_URL), a unique key prefix per test."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from shared.procutil import RedisServer

REPO = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("SLICESCHED_TRACES", REPO.parent / "shared" / "traces"))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


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
