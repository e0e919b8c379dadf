"""A ``redis_url`` fixture parametrized over a single redis-server and a 3-master Redis Cluster.

A test module runs against both when it imports it (``from support.redis_kinds import redis_url  # noqa: F401``);
the ``redis`` fixture and everything else that asks for ``redis_url`` in that module follow.
"""
from __future__ import annotations

import pytest


@pytest.fixture(params=["single", "cluster"])
def redis_url(request) -> str:
    return request.getfixturevalue("redis_server_url" if request.param == "single" else "redis_cluster_url")
