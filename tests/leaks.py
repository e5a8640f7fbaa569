"""Counting what a fault could leak: KV pages, shared-memory segments, subscriptions, asyncio tasks.

Take a :class:`Snapshot` before a fault test and call ``await snapshot.assert_no_leaks()``
after it: it waits (on conditions, up to a timeout) until every engine worker is
idle with every page free, no kvbus segment is left in /dev/shm beyond those
there before, the in-process bus holds no more subscriptions or pending
replies, and no more asyncio tasks run than before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

from bus.errors import BusError
from bus.subjects import WORKER_HEALTH
from schemas.common import HealthRequest

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvbus-"


def pid_of(system, worker_id: str) -> int:
    """Pid of the service ``worker_id`` that a :class:`services.local_system.LocalSystem` started."""
    import psutil

    for child in psutil.Process(system.proc.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:  # exited meanwhile, or a zombie not yet reaped (ZombieProcess)
            continue
        if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == worker_id:
            return child.pid
    raise LookupError(worker_id)


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:
        return set()


def our_tasks() -> int:
    """asyncio tasks of this process, less nats-py's own (its connection's readers, flushers, inbox mux)."""
    def is_nats(task: asyncio.Task) -> bool:
        code = getattr(task.get_coro(), "cr_code", None)
        return code is not None and f"{os.sep}nats{os.sep}" in code.co_filename

    return sum(1 for t in asyncio.all_tasks() if not is_nats(t))


async def engine_states(bus, workers: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Each (role, worker id)'s health detail; a worker not answering maps to {}."""
    out = {}
    for role, wid in workers:
        try:
            out[wid] = (await bus.request(WORKER_HEALTH, HealthRequest(), timeout=2.0, role=role,
                                          worker_id=wid)).detail
        except BusError:
            out[wid] = {}
    return out


def is_idle(detail: dict[str, str]) -> bool:
    return (bool(detail) and detail.get("running") == "0" and detail.get("waiting") == "0"
            and detail.get("free_pages") == detail.get("total_pages"))


@dataclasses.dataclass
class Snapshot:
    bus: object
    workers: list[tuple[str, str]]
    """(role, worker id) of every engine worker to check."""
    segments: set[str] = dataclasses.field(default_factory=shm_segments)
    num_tasks: int = dataclasses.field(default_factory=our_tasks)
    num_subscriptions: int = 0
    num_pending: int = 0

    def __post_init__(self) -> None:
        self.num_subscriptions = len(self.bus._subscriptions)
        self.num_pending = len(self.bus._pending)

    async def assert_no_leaks(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = await engine_states(self.bus, self.workers)
            problems = [f"{wid}: {d or 'no answer'}" for wid, d in states.items() if not is_idle(d)]
            # only segments of the workers under test (the machine may run other systems)
            extra = {n for n in shm_segments() - self.segments
                     if any(n.startswith(f"{SEGMENT_PREFIX}{wid}-") for _, wid in self.workers)}
            if extra:
                problems.append(f"shared-memory segments left: {sorted(extra)}")
            if len(self.bus._subscriptions) > self.num_subscriptions:
                problems.append(f"subscriptions: {len(self.bus._subscriptions)} > {self.num_subscriptions}")
            if len(self.bus._pending) > self.num_pending:
                problems.append(f"pending replies: {len(self.bus._pending)} > {self.num_pending}")
            tasks = our_tasks()
            if tasks > self.num_tasks:
                problems.append(f"asyncio tasks: {tasks} > {self.num_tasks}")
            if not problems:
                return
            assert time.monotonic() < deadline, "leaked after the fault: " + "; ".join(problems)
            await asyncio.sleep(0.2)
