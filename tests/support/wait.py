"""Polling for a condition in asyncio tests, instead of a fixed sleep that a loaded runner can outlast."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


async def until(pred: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """Call ``pred`` (plain or async) every ``interval_s`` until it returns something truthy and return that;
    return None once ``timeout_s`` has passed (the caller asserts on it, or its later assertions say what is
    missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(interval_s)
