"""Fixtures for tests that start the whole mesh like ``make up`` does."""
from __future__ import annotations

import pytest

from support.mesh import start_mesh, stop_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("mesh"))
    try:
        yield m
    finally:
        stop_mesh(m)


@pytest.fixture(scope="module")
def cluster_mesh(tmp_path_factory):
    """The mesh on a private 3-master Redis Cluster (``slicesched up --redis-cluster 3``)."""
    m = start_mesh(tmp_path_factory.mktemp("cluster-mesh"), redis_cluster=3)
    try:
        yield m
    finally:
        stop_mesh(m)
