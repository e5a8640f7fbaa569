"""Waiting on a condition in async tests: poll it, never sleep a fixed time, fail with what was awaited."""

from __future__ import annotations

import asyncio
import time


async def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    """Return once ``cond()`` is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
