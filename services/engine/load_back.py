"""Pages a lower cache tier holds, loaded back into a sequence's pages at admission.

The block manager asks its :class:`LoadBack` for the pages after a request's L1 prefix
(:meth:`LoadBack.load`). A run shorter than ``min_async_pages`` (or when nothing else could
step meanwhile) is copied on the spot; a longer one is started on the tier's copy thread and the
sequence waits with ``seq.loading_ticket`` set while the engine keeps stepping, until
:meth:`LoadBack.poll` reports the copy landed. Then the verified pages are indexed and
``seq.num_computed_tokens`` covers them (the first page that failed verification and everything
after it is computed).

A sequence freed while loading gives its pages back only when the copy landed: the copy thread
never writes into a page someone else holds. A load still in flight after ``timeout`` seconds is
given up: its request gets fresh pages and computes what the load would have brought (nothing
stale is ever read: the late copy lands in pages nobody uses, which are freed then); if the pool
has no room for them yet, the request keeps waiting, and a copy that lands is used.

It works on its block manager's pages through the allocator's own calls (``take_free_page``,
``unref``, ``index_pages``) and talks to the tier through ``block_manager.hooks``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.block_manager import BlockManager

log = logging.getLogger(__name__)


ASYNC_LOAD_MIN_PAGES = 8
"""Shorter lower-tier runs are loaded on the engine thread at admission. An asynchronous load
makes its request wait at least one more step (it lands after this step's forward) to spare
the others the copy; a short copy stalls them for less than that is worth (bench/load_back_bench.py:
8 pages of the default model, 5.6 MiB, copy in about 0.3 ms on CPU, a few % of one decode step)."""


LOAD_TIMEOUT_S = 5.0
"""Seconds an asynchronous load may stay in flight before its request computes those pages instead.
A load is a local copy (tens of ms for a long prompt, behind the write-backs queued before it), so
this fires only for a copy thread that stalls; recomputing a long prompt costs seconds."""


class _Load:
    """A lower-tier load in flight into a sequence's pages."""

    __slots__ = ("seq", "start", "count", "started", "page_ids", "first_admission", "cancelled")

    def __init__(self, seq: Sequence, start: int, count: int, started: float, first_admission: bool):
        self.seq, self.start, self.count, self.started = seq, start, count, started
        self.first_admission = first_admission
        self.page_ids: list[int] = []  # once cancelled: the pages the copy writes, freed when it lands
        self.cancelled = False


class LoadBack:
    def __init__(self, bm: BlockManager, *, min_async_pages: int = ASYNC_LOAD_MIN_PAGES,
                 timeout: float = LOAD_TIMEOUT_S, clock=time.monotonic):
        self.bm = bm
        self.min_async_pages = min_async_pages
        """Fewest lower-tier pages loaded asynchronously (``allocate(may_wait=True)``)."""
        self.timeout = timeout
        """Seconds an asynchronous load may take before its request recomputes those pages."""
        self.clock = clock
        self.in_flight: dict[object, _Load] = {}  # ticket -> load
        self._landed: list[Sequence] = []  # loads landed (or given up), not yet reported by poll
        self.num_loaded_back = 0  # pages loaded and verified, either way
        self.num_async = 0
        self.num_cancelled = 0  # sequences freed while their pages were loading
        self.num_timeouts = 0  # loads given up for taking longer than timeout

    # ---- at admission ------------------------------------------------------

    def load(self, seq: Sequence, may_wait: bool) -> int:
        """Take pages for what a lower tier holds after ``seq``'s pages so far: returns how many
        were loaded now (0 when the load runs asynchronously: ``seq.loading_ticket`` is set)."""
        bm = self.bm
        start, limit = len(seq.page_ids), bm.cacheable_pages(seq)
        if start >= limit:
            return 0
        want = seq.page_hashes[start:limit]
        num_hits = min(bm.hooks.lookup(want), len(want))
        if num_hits <= 0:
            return 0
        size = bm.page_size
        tokens = [seq.token_ids[(start + i) * size : (start + i + 1) * size] for i in range(num_hits)]
        page_ids = [bm.take_free_page() for _ in range(num_hits)]
        if may_wait and num_hits >= self.min_async_pages:
            try:
                ticket = bm.hooks.start_load(want[:num_hits], tokens, page_ids)
            except Exception:  # a lower tier failing must not fail the request
                log.exception("start_load of %d pages failed; loading synchronously", num_hits)
                ticket = None
            if ticket is not None:
                self.in_flight[ticket] = _Load(seq, start, num_hits, self.clock(), not seq.is_admitted_once)
                self.num_async += 1
                seq.loading_ticket = ticket
                seq.page_ids.extend(page_ids)  # filled by the tier; indexed when they land
                return 0
        try:
            loaded = max(0, min(bm.hooks.load_back(want[:num_hits], tokens, page_ids), num_hits))
        except Exception:  # a lower tier failing must not fail the request
            log.exception("load_back of %d pages failed; recomputing them", num_hits)
            loaded = 0
        for page_id in reversed(page_ids[loaded:]):  # not loaded: recomputed into fresh pages
            bm.unref(page_id)
        seq.page_ids.extend(page_ids[:loaded])
        bm.index_pages(seq, start + loaded, clean=True)
        self.num_loaded_back += loaded
        return loaded

    # ---- while loads are in flight -----------------------------------------------

    def poll(self) -> list[Sequence]:
        """Once a step: sequences whose pages landed since the last call, or whose load was given
        up for taking longer than ``timeout``; they may run now."""
        if self.in_flight:
            for ticket, n in self.bm.hooks.poll_loaded():
                self._land(ticket, n)
            now = self.clock()
            for load in list(self.in_flight.values()):
                if not load.cancelled and now - load.started > self.timeout:
                    self._give_up(load)
        ready, self._landed = self._landed, []
        return ready

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a load to land (the step has nothing else to do)."""
        if self.in_flight:
            for ticket, n in self.bm.hooks.wait_loaded(timeout):
                self._land(ticket, n)

    def wait_all(self, timeout: float = 30.0) -> None:
        """Block until no load is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            self.wait(min(1.0, deadline - time.monotonic()))

    def cancel(self, seq: Sequence) -> None:
        """``seq`` is being freed while its pages load: they go back when the copy landed."""
        load = self.in_flight[seq.loading_ticket]
        load.cancelled = True
        self.num_cancelled += 1
        load.page_ids = list(seq.page_ids)  # (the sequence is being freed: all its pages wait for the copy)
        seq.loading_ticket = None

    def forget(self, seq: Sequence) -> None:
        """``seq`` is being freed after its load landed but before :meth:`poll` handed it back."""
        if seq in self._landed:
            self._landed.remove(seq)

    def _give_up(self, load: _Load) -> None:
        """The load is late: its request computes those pages in fresh ones (if the pool has room;
        else it keeps waiting), and the pages the copy writes are freed when it lands."""
        bm = self.bm
        # (pages being copied out wait for the copy thread, which may be the one that is late)
        if bm.num_reusable_pages < load.count:
            return
        seq = load.seq
        end = load.start + load.count
        load.page_ids = seq.page_ids[load.start : end]
        load.cancelled = True
        seq.page_ids[load.start : end] = [bm.take_free_page() for _ in range(load.count)]
        seq.loading_ticket = None
        seq.num_computed_tokens = load.start * bm.page_size
        if load.first_admission:
            seq.num_loaded_tokens = 0
        self.num_timeouts += 1
        log.warning("a load of %d pages took over %.1f s; recomputing them for %s", load.count, self.timeout,
                    seq.request_id)
        self._landed.append(seq)

    def _land(self, ticket: object, num_loaded: int) -> None:
        bm = self.bm
        load = self.in_flight.pop(ticket, None)
        if load is None:
            log.warning("a load nobody asked for landed (ticket %r)", ticket)
            return
        if load.cancelled:  # freed while loading: the copy thread is done with its pages now
            for page_id in reversed(load.page_ids):
                bm.unref(page_id)
            return
        seq = load.seq
        seq.loading_ticket = None
        n = max(0, min(num_loaded, bm.cacheable_pages(seq) - load.start))
        # Pages past the verified ones stay in seq (private, unindexed): they are computed.
        bm.index_pages(seq, load.start + n, clean=True)
        tail, host_tail = bm.tails.reuse(seq, load.start + n)
        seq.num_computed_tokens = (load.start + n) * bm.page_size + tail
        if load.first_admission:
            seq.num_loaded_tokens = n * bm.page_size + host_tail
        self.num_loaded_back += n
        self._landed.append(seq)
