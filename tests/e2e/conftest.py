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
