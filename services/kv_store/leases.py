"""The tier client's attachment: the arena it maps and the empty slots it holds leased there.

The kv_store hands out empty slots ahead of need (leases) so that a write-back never waits on the
bus for one, and a page evicted before its copy started is copied at once instead of dropped. An
engine asks ``FIRST_LEASES`` when it attaches (an engine that never evicts keeps no more of L2
empty), then up to ``lease_batch`` whenever it holds less than half of what it may hold: the
store caps each engine at a share of the arena (``lease_share``), and a reply with fewer slots than
asked tells the engine where that cap is, so it does not ask again on every write-back. At 32
slots, two decoders under pool pressure dropped ~300 write-backs each in a 100 s run; with their
window sized to the store's cap, none (docs/benchmarks.md). A new arena (the
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

FIRST_LEASES = 32
"""Slots asked at attach, before the engine has written back anything."""
LEASE_BATCH = 256
"""Most slots an engine asks to hold; the store's own cap (``KVStoreConfig.max_lease``, 1/8 of the
arena) is usually lower, and a short reply teaches the engine where it is."""


class Attachment:
    """The arena this engine maps (None until attached) and its leased slots."""

    def __init__(self, link, owner: str, *, lease_batch: int = LEASE_BATCH, prefault: bool = True,
                 on_switch: Callable[[Arena], None] = lambda arena: None):
        self.link, self.owner = link, owner
        self.lease_batch = max(1, lease_batch)
        self.prefault = prefault
        """Map the arena's pages into this process ahead of use (see :meth:`use`)."""
        self.on_switch = on_switch
        """Called with a new arena before any slot of it is leased (the lookup mirror resets)."""
        self.arena: Arena | None = None
        self.leased: deque[int] = deque()
        self.may_hold = self.lease_batch
        """The most slots this engine holds at once: ``lease_batch``, or less where the store capped it."""
        self._refilling = False
        self.prefault_thread: threading.Thread | None = None
        self.closing = threading.Event()

    def use(self, name: str, layout) -> None:
        """Map arena ``name`` (an attach's answer) unless it is the one mapped already."""
        if self.arena is not None and self.arena.name == name:
            return
        arena = Arena.attach(name, layout)
        self.on_switch(arena)
        self.leased, self.arena, self.may_hold = deque(), arena, self.lease_batch
        self._refilling = False  # a lease asked of the old store may never be answered
        log.info("HiCache: attached to L2 arena %s (%d slots)", name, layout.num_slots)
        self.refill(min(FIRST_LEASES, self.lease_batch))
        if self.prefault:
            # a page the kv_store committed still faults on this side at its first touch, on the copy
            # thread beside the forward pass (costs in arena.py's docstring); mapping ahead: ~0.3 s a GB
            self.prefault_thread = prefault_in_background(arena, self.closing, "HiCache: mapping L2 into this engine")

    def take(self) -> int | None:
        """A leased slot to write a page into, or None (none at hand: the page is not copied now)."""
        if len(self.leased) < max(1, self.may_hold // 2):
            self.refill()
        return self.leased.popleft() if self.leased else None

    def give_back(self, slot: int) -> None:
        """A slot taken but not written (staging the page failed): first to be taken again."""
        self.leased.appendleft(slot)

    @property
    def num_leased(self) -> int:
        return len(self.leased)

    def refill(self, upto: int | None = None) -> None:
        """Ask for leases up to ``upto`` held (default ``lease_batch``; one request in flight at a time)."""
        if self._refilling or self.arena is None:
            return
        asked = (self.lease_batch if upto is None else upto) - len(self.leased)
        if asked <= 0:
            return
        self._refilling = True
        arena_name = self.arena.name

        def got(slots: list[int] | None) -> None:
            self._refilling = False
            if slots is None or self.arena is None or self.arena.name != arena_name:
                return  # no answer (the link reports why), or an arena replaced meanwhile
            self.leased.extend(slots)
            if upto is None:  # a short reply: the store's cap on this engine (or a full arena) is here
                self.may_hold = self.lease_batch if len(slots) >= asked else len(self.leased)

        self.link.lease(self.owner, arena_name, asked, got)

    def close(self) -> None:
        """Stop mapping ahead (the client is closing)."""
        self.closing.set()
