"""The processes ``kvbus up`` started, kept running: start each (its CPU set, death with its parent),
stream its log with a role prefix, restart one that dies with exponential backoff, and stop them in
order (the services first, then nats-server).

Every child dies with ``kvbus up`` even when ``kvbus up`` itself is killed with SIGKILL (Linux:
PR_SET_PDEATHSIG); a replacement rejoins through its heartbeats and health subjects.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass

from services.up.report import say


@dataclass
class Child:
    name: str
    argv: list[str]
    cpus: frozenset[int] | None = None  # CPU affinity set before exec; None: inherit ours
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task | None = None
    num_restarts: int = 0
    """Restarts in a row (reset once a replacement stays up STABLE_AFTER_S)."""
    started_at: float = 0.0
    restart_at: float | None = None
    """When the dead process is due to be restarted (None: alive, or not yet noticed)."""
    metrics_port: int | None = None
    """Port of its Prometheus endpoint (engine workers and the kv_store)."""


RESTART_DELAY_S = 1.0
"""Delay before the first restart of a dead service; doubles per restart in a row."""
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0
"""A process up this long is healthy again: its next death restarts after RESTART_DELAY_S."""
PR_SET_PDEATHSIG = 1
_libc = None


def _child_setup(cpus: frozenset[int] | None, parent_pid: int):
    """What a child runs between fork and exec: CPU set, and death with its parent."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)  # loaded here, in the parent: nothing to load after fork
    libc = _libc

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if libc is not None:
            # SIGTERM when kvbus up dies, however it dies (services drain; nats-server stops)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took hold
                os._exit(1)

    return setup


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


class Supervisor:
    """Starts children, restarts the ones that die (``supervise``), stops them all (``stop_all``)."""

    def __init__(self, quiet: bool = False, stop_timeout: float = 40.0):
        self.children: list[Child] = []
        self.quiet = quiet
        self.stop_timeout = stop_timeout
        self.is_stopping = False
        self.num_restarts = 0

    async def start(self, child: Child) -> None:
        await self._spawn(child)
        self.children.append(child)

    async def _spawn(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop children in order
            # the child's every thread (OpenMP's included) inherits the CPU set
            preexec_fn=_child_setup(child.cpus, os.getpid()),
        )
        child.started_at = time.monotonic()
        child.pump = asyncio.create_task(self._pump(child))

    async def supervise(self) -> None:
        """Notice dead children and restart each when its backoff is over (call it every second or so)."""
        if self.is_stopping:
            return
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or child.proc.returncode is None:
                continue
            if child.restart_at is None:
                if now - child.started_at >= STABLE_AFTER_S:
                    child.num_restarts = 0
                delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** child.num_restarts)
                child.restart_at = now + delay
                say(f"{child.name} (pid {child.proc.pid}) exited with {describe_exit(child.proc.returncode)}; "
                    f"restarting in {delay:g}s")
            elif now >= child.restart_at:
                child.restart_at = None
                child.num_restarts += 1
                self.num_restarts += 1
                await self._spawn(child)
                say(f"{child.name} restarted (pid {child.proc.pid}, restart {child.num_restarts} in a row)")

    async def _pump(self, child: Child) -> None:
        assert child.proc and child.proc.stdout
        width = max(12, len(child.name))
        async for line in child.proc.stdout:
            if not self.quiet:
                sys.stdout.write(f"{child.name:<{width}} | {line.decode(errors='replace')}")
                sys.stdout.flush()

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.returncode is not None]

    async def stop(self, child: Child, timeout: float | None = None) -> None:
        timeout = self.stop_timeout if timeout is None else timeout
        if child.proc is None or child.proc.returncode is not None:
            return
        child.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                await child.proc.wait()
        except TimeoutError:
            child.proc.kill()
            await child.proc.wait()
        if child.pump:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await child.pump

    async def stop_all(self, last: Child | None = None, *, after_services: tuple[Child, ...] = ()) -> None:
        """Stop the services together, then ``after_services`` (the trace receiver: their last spans),
        then ``last`` (nats-server)."""
        self.is_stopping = True
        services = [c for c in self.children if c is not last and c not in after_services]
        await asyncio.gather(*(self.stop(c) for c in services))
        for child in (*after_services, last):
            if child is not None:
                await self.stop(child)

