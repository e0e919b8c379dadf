"""Fixtures for the gateway integration tests; the harness itself lives in gateway_harness.py."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_harness import Harness, Responder, make_gateway  # noqa: E402


@pytest.fixture
async def gw(redis, redis_url, prefix):
    svc = make_gateway(redis_url, prefix)
    await svc.start()
    responder = Responder(redis_url, prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    try:
        yield Harness(svc, responder)
    finally:
        stop.set()
        await svc.stop()
        await task
