"""Cached pages a waiting request will reuse: evicted only after every page nobody waits for.

Plain LRU evicts the wrong pages once requests queue. A conversation's pages are released when its
turn ends and its next turn joins the back of the queue; when the pool cannot hold every queued
conversation, the pages released longest ago, those of the request about to run, go first, and the
request finds its prefix evicted just before it is scheduled (the router's 1P2D workload under pool
pressure: 81,320 cached tokens predicted at routing, 26,410 found at admission).

So a waiting sequence *holds* the cached pages of its prefix (:meth:`HeldPages.hold`, when it joins
the queue or is preempted back into it): they leave the LRU list for :attr:`HeldPages.held` and are
evicted only when no unheld cached page is left, those of the sequence that will run last first,
each sequence's tail before its head: Belady's rule, with the waiting queue as the known future.
A sequence joining the queue holds behind every earlier one; a preempted sequence, first in line
again, holds ahead of them (``first=True``). A page several waiting sequences share keeps the place
of the earliest. Holds end at admission (:meth:`BlockManager.allocate`) or when the sequence leaves
the queue otherwise (:meth:`release`).

Holding takes no reference: held pages stay free (``num_free_pages`` counts them) and any allocation
may still take them, so holding never blocks admission or growth and never deadlocks; it only orders
eviction. Nothing waits, nothing is held: an idle engine evicts by LRU as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.block_manager import BlockManager, Page


class HeldPages:
    def __init__(self, bm: BlockManager, *, enabled: bool = True):
        self.bm = bm
        self.enabled = enabled
        self.held: OrderedDict[int, None] = OrderedDict()
        """Unreferenced cached pages some waiting sequence holds, the first to run first (evicted from
        the end)."""
        self.num_holds = 0  # sequences that held at least one page
        self.num_evicted = 0  # held pages evicted all the same (the pool needed them)

    # ---- the waiting queue's side ----------------------------------------------

    def hold(self, seq: Sequence, *, first: bool = False) -> None:
        """``seq`` waits: hold the cached pages of its prefix (``first``: it runs before every other
        waiting sequence)."""
        if not self.enabled or seq.held_pages:
            return
        bm = self.bm
        matched = bm.matched_page_ids(seq)
        if not matched:
            return
        seq.held_pages = [(p, bm.pages[p].page_hash) for p in matched]
        for page_id in (reversed(matched) if first else matched):
            page = bm.pages[page_id]
            page.hold_count += 1
            if page.ref_count:
                continue  # owned now: it comes here when its last owner lets go
            if page_id in bm.cached_page_ids:
                del bm.cached_page_ids[page_id]
                self.held[page_id] = None
            if first:
                self.held.move_to_end(page_id, last=False)
        self.num_holds += 1

    def release(self, seq: Sequence) -> None:
        """``seq`` no longer waits (admitted, aborted): its pages nobody else holds are plain cached
        pages again, the most recently used."""
        bm = self.bm
        for page_id, page_hash in seq.held_pages:
            page = bm.pages[page_id]
            if page.page_hash != page_hash or page.hold_count <= 0:
                continue  # evicted meanwhile (and maybe reused): the hold went with it
            page.hold_count -= 1
            if page.hold_count == 0 and page_id in self.held:
                del self.held[page_id]
                bm.cached_page_ids[page_id] = None
        seq.held_pages = []

    # ---- the block manager's side ------------------------------------------------

    def keeps(self, page: Page) -> bool:
        """Whether ``page``, just released by its last owner, is held (then it is kept here)."""
        if page.hold_count <= 0:
            return False
        self.held[page.page_id] = None
        return True

    def evicted(self, page: Page) -> None:
        """``page`` leaves the cache (taken from :attr:`held` by the caller, or never held)."""
        if page.hold_count:
            page.hold_count = 0
            self.num_evicted += 1

    def eviction_order(self) -> Iterator[int]:
        """Held pages, the first to evict first."""
        return reversed(self.held)
