"""WorkerLiveness: a worker's death is known within ttl of its last heartbeat (fake clock, no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from schemas.worker import WorkerHeartbeatEvent, WorkerLoad
from services.liveness import WorkerDied, WorkerLiveness

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, draining: bool = False, interval_s: float = 1.0) -> WorkerHeartbeatEvent:
    return WorkerHeartbeatEvent(worker_id=worker_id, role="decode", host_id="h", load=WorkerLoad(),
                                is_draining=draining, interval_s=interval_s)


async def started(clock: Clock, ttl: float = 3.0) -> WorkerLiveness:
    live = WorkerLiveness(ttl, clock=clock)
    live._started_at = clock()  # as start() does, without a bus
    return live


async def test_watch_resolves_after_ttl_of_silence_and_not_before():
    clock = Clock()
    live = await started(clock)
    await live.observe(beat("w1"))
    dead = live.watch("w1")
    clock.now += 2.9
    await live.observe(beat("w1", draining=True))  # a draining worker is finishing work: alive
    clock.now += 2.9
    live.sweep()
    assert not dead.done()
    clock.now += 0.2
    live.sweep()
    assert dead.done()
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert live.num_watches == 0  # resolved futures are forgotten


async def test_unknown_worker_gets_ttl_from_the_start_of_listening():
    clock = Clock()
    live = await started(clock)
    assert not live.is_dead("never-seen")
    clock.now += 3.1
    assert live.is_dead("never-seen")
    assert live.watch("never-seen").done()


async def test_guard_raises_worker_died_and_cancels_the_work():
    clock = Clock()
    live = await started(clock, ttl=1.0)
    await live.observe(beat("p1", interval_s=0.2))
    work = asyncio.Event()
    cancelled = []

    async def forever():
        try:
            await work.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def kill_later():
        await asyncio.sleep(0)
        clock.now += 1.5
        live.sweep()

    killer = asyncio.create_task(kill_later())
    with pytest.raises(WorkerDied, match="p1 sent no heartbeat"):
        await live.guard(forever(), "p1", "prefill")
    await killer
    await asyncio.sleep(0)
    assert cancelled == [True] and live.num_watches == 0


async def test_guard_returns_the_result_while_alive():
    clock = Clock()
    live = await started(clock)

    async def answer():
        return 42

    assert await live.guard(answer(), "p1", "prefill") == 42
    await asyncio.sleep(0)
    assert live.num_watches == 0


async def test_a_slow_heartbeat_gets_three_intervals():
    clock = Clock()
    live = await started(clock, ttl=3.0)
    await live.observe(beat("slow", interval_s=5.0))
    clock.now += 14.0
    assert not live.is_dead("slow")
    clock.now += 1.1
    assert live.is_dead("slow")
