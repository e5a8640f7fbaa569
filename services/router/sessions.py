"""Conversation affinity: a session (``session_id``) stays on the decode worker that holds its turns.

A session is pinned to the worker its first request went to. It stays there until it has been idle
for ``ttl`` seconds (then it is forgotten, and its next request is placed afresh), its worker leaves
(the pin is marked and the next request moves, counted as ``left``), or its worker is busy past the
router's thresholds (the request moves to the lowest cost, counted as ``busy``); a request that
excludes the worker (a retry after it failed) moves too (``excluded``). A move re-pins the session.
At most ``max_sessions`` are kept; past it the least recently used one is forgotten.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Callable


@dataclasses.dataclass(slots=True)
class Pin:
    worker_id: str
    last_used: float
    has_left: bool = False
    """Its worker left since the session's last request."""


class SessionTable:
    def __init__(self, ttl: float, max_sessions: int = 100_000, *, clock: Callable[[], float] = time.monotonic):
        self.ttl, self.max_sessions, self.clock = ttl, max_sessions, clock
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # least recently used first
        self.num_pins = 0
        """Sessions pinned (a first request, or the first after the TTL)."""
        self.num_moves: Counter[str] = Counter()
        """Sessions moved to another worker, by reason (busy, left, excluded)."""
        self.num_expired = 0

    @property
    def is_enabled(self) -> bool:
        return self.ttl > 0

    def get(self, session_id: str) -> Pin | None:
        """The session's pin, if it has one that is not idle past the TTL."""
        pin = self._pins.get(session_id)
        if pin is not None and self.clock() - pin.last_used >= self.ttl:
            del self._pins[session_id]
            self.num_expired += 1
            return None
        return pin

    def pin(self, session_id: str, worker_id: str, *, moved: str | None = None) -> None:
        """The session's request went to ``worker_id``; ``moved``: it left its pinned worker, and why."""
        pin = self._pins.get(session_id)
        if pin is None:
            self.num_pins += 1
            self._pins[session_id] = Pin(worker_id, self.clock())
            while len(self._pins) > self.max_sessions:
                self._pins.popitem(last=False)
            return
        if moved is not None and worker_id != pin.worker_id:
            self.num_moves[moved] += 1
        pin.worker_id, pin.last_used, pin.has_left = worker_id, self.clock(), False
        self._pins.move_to_end(session_id)

    def worker_left(self, worker_id: str) -> None:
        """Its sessions move on their next request (counted then), even if a worker of the same id
        comes back meanwhile: its cache is gone."""
        for pin in self._pins.values():
            if pin.worker_id == worker_id:
                pin.has_left = True

    def expire(self) -> int:
        """Forget sessions idle past the TTL (the least recently used come first); how many."""
        deadline, num = self.clock() - self.ttl, 0
        while self._pins:
            session_id, pin = next(iter(self._pins.items()))
            if pin.last_used > deadline:
                break
            del self._pins[session_id]
            num += 1
        self.num_expired += num
        return num

    def __len__(self) -> int:
        return len(self._pins)
