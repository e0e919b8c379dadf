"""Fixtures for the transport tests: peer processes that are always reaped."""
from __future__ import annotations

import pytest

from shared.transport.peer import PeerProcess


@pytest.fixture
async def spawn_peer():
    """Start peer processes (fresh interpreters); every one is killed at teardown if still running."""
    peers: list[PeerProcess] = []

    async def spawn() -> PeerProcess:
        p = await PeerProcess.spawn()
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.kill()
        await p.proc.wait()
