"""A core lease: engines on one host that share its cores take turns stepping.

Two engines on a small host (a prefill and a decode worker on 2 cores) can split the cores (each
steps on half of them, all the time) or share them. Sharing with both running at once is the
worst of the three: OpenMP's spinning workers collapse when another busy process takes their
core (a decode step went from 42-55 ms to 190 ms). With a lease, each step takes every core while
the others wait: a prefill chunk runs at the whole machine's rate, decode steps slot in between
chunks, and no two OpenMP pools ever compete.

The lease is an exclusive ``flock`` on a file every engine of the host opens (``kvbus up`` makes
it per run and passes ``--core-lease PATH:SLOT``). The kernel drops a dead process's lock, so a killed
engine never leaves the others waiting. ``flock`` wakes a waiter but does not queue it: an
engine that releases and steps again at once would take the lock back first. So a release hands
off: each engine marks itself waiting in a small shared map (a byte per slot, with a count of its
acquisitions beside it), and an engine that releases while others wait does not return until one
of them has taken the lease (bounded by ``handoff_timeout``; a slot that never takes it, a
waiter that died, is cleared).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time

log = logging.getLogger(__name__)

SLOTS = 64
"""Engines one lease file serves (slot ids 0 .. SLOTS - 1)."""


def parse_spec(spec: str) -> tuple[str, int]:
    """``PATH:SLOT`` -> (path, slot); ValueError with the reason."""
    path, sep, slot = spec.rpartition(":")
    if not sep or not path or not slot.isdigit():
        raise ValueError(f"core lease {spec!r}: expected PATH:SLOT, e.g. /tmp/kvbus-cores.lease:0")
    if not 0 <= int(slot) < SLOTS:
        raise ValueError(f"core lease {spec!r}: the slot must be in [0, {SLOTS})")
    return path, int(slot)


class CoreLease:
    def __init__(self, spec: str, handoff_timeout: float = 0.2):
        path, self.slot = parse_spec(spec)
        self.path = path
        self.handoff_timeout = handoff_timeout
        # kvbus up makes the file (mkstemp: owner-only, an unguessable name); never follow a link
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(self._fd).st_size < 2 * SLOTS:
                os.ftruncate(self._fd, 2 * SLOTS)  # every opener truncates to the same size: no race
            self._map = mmap.mmap(self._fd, 2 * SLOTS)
        except BaseException:
            os.close(self._fd)
            raise
        self.held = False
        self.acquisitions = 0
        self.wait_seconds = 0.0  # time spent waiting for the lease
        self.handoff_seconds = 0.0  # time spent handing it to a waiter after a release

    def acquire(self) -> None:
        w, c = 2 * self.slot, 2 * self.slot + 1
        self._map[w] = 1
        t0 = time.perf_counter()
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # releases the GIL while it waits
        self.wait_seconds += time.perf_counter() - t0
        self.held = True
        self.acquisitions += 1
        self._map[w] = 0
        self._map[c] = (self._map[c] + 1) & 0xFF  # last: a releaser waiting on it may go on

    def release(self) -> None:
        m = self._map
        waiting = {i: m[2 * i + 1] for i in range(SLOTS) if i != self.slot and m[2 * i]}
        self.held = False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        if not waiting:
            return
        t0 = time.perf_counter()
        deadline = t0 + self.handoff_timeout
        while all(m[2 * i + 1] == count for i, count in waiting.items()):
            if time.perf_counter() > deadline:
                for i in waiting:  # a waiter that died while waiting: forget it
                    if m[2 * i + 1] == waiting[i]:
                        m[2 * i] = 0
                log.warning("core lease: slot(s) %s waited but did not take the lease within %.2f s",
                            sorted(waiting), self.handoff_timeout)
                break
            time.sleep(50e-6)
        self.handoff_seconds += time.perf_counter() - t0

    def __enter__(self) -> CoreLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        if self.held:
            self.release()
        self._map.close()
        os.close(self._fd)
