"""Which engine workers are still alive, from their heartbeats: fast death detection for callers.

The router drops a worker that has been silent for ``worker_ttl`` seconds; a
caller waiting on that worker (the gateway streaming from a decode worker, a
decode worker waiting for a prefill) would otherwise learn of the death only
from its own, much longer timeout. :class:`WorkerLiveness` listens to the same
heartbeats and resolves ``watch(worker_id)`` futures within about ``ttl`` (plus
one sweep) of a worker's last beat.

A draining worker still beats (with ``is_draining``): it is finishing its work,
so it counts as alive. A worker never heard of counts as alive for ``ttl``
seconds after the watch started listening (the caller may have learnt of it
from the router a moment before we heard its first beat). A worker that beats
slowly (its ``interval_s``) gets at least three intervals, so a configured
slow heartbeat never reads as a death.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from bus.errors import Unavailable
from bus.subjects import WORKER_HEARTBEAT
from schemas.worker import WorkerHeartbeatEvent

T = TypeVar("T")


class WorkerDied(Unavailable):
    """The worker serving a request stopped beating; the request may move elsewhere."""


class WorkerLiveness:
    def __init__(self, ttl: float, *, clock: Callable[[], float] = time.monotonic):
        if not ttl > 0:
            raise ValueError(f"liveness ttl must be > 0, got {ttl}")
        self.ttl = ttl
        self.clock = clock
        self.sweep_interval = min(0.25, ttl / 4)
        self._last_seen: dict[str, float] = {}
        self._ttl_of: dict[str, float] = {}
        self._transfer_backends: dict[str, tuple[str, ...]] = {}
        self._started_at: float | None = None
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._sub = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, bus) -> None:
        self._started_at = self.clock()
        self._sub = await bus.subscribe(WORKER_HEARTBEAT, self.observe)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="liveness-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for futures in self._waiters.values():
            for fut in futures:
                fut.cancel()
        self._waiters.clear()

    async def observe(self, event: WorkerHeartbeatEvent) -> None:
        self._last_seen[event.worker_id] = self.clock()
        self._ttl_of[event.worker_id] = max(self.ttl, 3 * event.interval_s)
        if event.transfer_backends:
            self._transfer_backends[event.worker_id] = tuple(event.transfer_backends)

    def transfer_backends(self, worker_id: str) -> tuple[str, ...] | None:
        """The KV transfer backends ``worker_id`` last advertised; None if it advertised none (yet)."""
        return self._transfer_backends.get(worker_id)

    def is_dead(self, worker_id: str) -> bool:
        seen = self._last_seen.get(worker_id, self._started_at)
        if seen is None:  # not listening yet: we know nothing, so we claim nothing
            return False
        return self.clock() - seen > self._ttl_of.get(worker_id, self.ttl)

    def watch(self, worker_id: str) -> asyncio.Future:
        """A future that resolves when ``worker_id`` is taken for dead; cancel it when done watching."""
        fut = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(worker_id, set())
        waiters.add(fut)
        fut.add_done_callback(lambda f: self._forget(worker_id, f))
        if self.is_dead(worker_id):
            fut.set_result(None)
        return fut

    async def guard(self, work: Awaitable[T], worker_id: str, what: str) -> T:
        """Await ``work``; raise WorkerDied (and cancel it) if ``worker_id`` dies first."""
        task = asyncio.ensure_future(work)
        dead = self.watch(worker_id)
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise WorkerDied(f"{what}: worker {worker_id} sent no heartbeat for {self.ttl:g}s")
        finally:
            dead.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @property
    def num_watches(self) -> int:
        return sum(len(f) for f in self._waiters.values())

    def _forget(self, worker_id: str, fut: asyncio.Future) -> None:
        waiters = self._waiters.get(worker_id)
        if waiters is not None:
            waiters.discard(fut)
            if not waiters:
                del self._waiters[worker_id]

    def sweep(self) -> None:
        for worker_id in [w for w in self._waiters if self.is_dead(w)]:
            for fut in list(self._waiters.get(worker_id, ())):
                if not fut.done():
                    fut.set_result(None)
        # forget workers silent for long (replaced ids would otherwise pile up)
        horizon = self.clock() - 10 * self.ttl
        for worker_id in [w for w, seen in self._last_seen.items() if seen < horizon]:
            del self._last_seen[worker_id]
            self._ttl_of.pop(worker_id, None)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            self.sweep()
