"""The tier client's attachment: the arena it maps and the empty slots it holds leased there.

The kv_store hands out empty slots ahead of need (leases, ``lease_batch`` at a time, refilled
when half are used) so that a write-back never waits on the bus for one. A new arena (the
store restarted) replaces the old one: the leases asked of the old store are dropped, copies
already queued against the old arena complete there (each job holds its arena), and the pages
of the new one are mapped into this process ahead of use (``prefault``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from services.kv_store.arena import Arena, prefault_in_background

log = logging.getLogger(__name__)


class Attachment:
    """The arena this engine maps (None until attached) and its leased slots."""

    def __init__(self, link, owner: str, *, lease_batch: int = 32, prefault: bool = True,
                 on_switch: Callable[[Arena], None] = lambda arena: None):
        self.link, self.owner = link, owner
        self.lease_batch = max(1, lease_batch)
        self.prefault = prefault
        """Map the arena's pages into this process ahead of use (see :meth:`use`)."""
        self.on_switch = on_switch
        """Called with a new arena before any slot of it is leased (the lookup mirror resets)."""
        self.arena: Arena | None = None
        self.leased: deque[int] = deque()
        self._refilling = False
        self.prefault_thread: threading.Thread | None = None
        self.closing = threading.Event()

    def use(self, name: str, layout) -> None:
        """Map arena ``name`` (an attach's answer) unless it is the one mapped already."""
        if self.arena is not None and self.arena.name == name:
            return
        arena = Arena.attach(name, layout)
        self.on_switch(arena)
        self.leased, self.arena = deque(), arena
        self._refilling = False  # a lease asked of the old store may never be answered
        log.info("HiCache: attached to L2 arena %s (%d slots)", name, layout.num_slots)
        self.refill()
        if self.prefault:
            # a page the kv_store committed still faults on this side at its first touch, on the copy
            # thread beside the forward pass (costs in arena.py's docstring); mapping ahead: ~0.3 s a GB
            self.prefault_thread = prefault_in_background(arena, self.closing, "HiCache: mapping L2 into this engine")

    def take(self) -> int | None:
        """A leased slot to write a page into, or None (none at hand: the page is not copied now)."""
        if len(self.leased) < self.lease_batch // 2:
            self.refill()
        return self.leased.popleft() if self.leased else None

    def give_back(self, slot: int) -> None:
        """A slot taken but not written (staging the page failed): first to be taken again."""
        self.leased.appendleft(slot)

    @property
    def num_leased(self) -> int:
        return len(self.leased)

    def refill(self) -> None:
        """Ask for leases up to ``lease_batch`` (one request in flight at a time)."""
        if self._refilling or self.arena is None:
            return
        self._refilling = True
        arena_name = self.arena.name

        def got(slots: list[int] | None) -> None:
            self._refilling = False
            if slots and self.arena is not None and self.arena.name == arena_name:
                self.leased.extend(slots)

        self.link.lease(self.owner, arena_name, self.lease_batch - len(self.leased), got)

    def close(self) -> None:
        """Stop mapping ahead (the client is closing)."""
        self.closing.set()
