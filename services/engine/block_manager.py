"""Pages of the KV pool: allocation, reference counts and the prefix cache.

Page lifecycle::

    free --allocate--> owned (ref >= 1) --last release--> free        (partial page)
                                        \\-last release--> cached (LRU) (full, indexed page)
    cached --matched by a new request--> owned
    cached --evicted (hooks.on_removed)--> free

A full page is indexed under its chained page hash once its KV is computed,
so any later request whose prompt starts with the same tokens reuses it. A
page with no owner stays cached until the pool needs it; the least recently
released goes first, and a sequence releases its pages last-to-first so a
chain is evicted from its tail.

Lower tiers (``tier_hooks.py``): a cached page near the LRU end is copied out
asynchronously ahead of its eviction (:meth:`tier_tick`, once a step); while
the copy runs the page stays usable (indexed pages never change) but cannot be
reused; once it landed the page is "clean" and evicting it costs nothing. Only
if the pool runs dry before that does eviction wait for a copy.

Collaborators, each in its own module: :class:`~services.engine.load_back.LoadBack` takes
pages a lower tier holds at admission (on the spot, or asynchronously while the engine keeps
stepping), :class:`~services.engine.tails.TailReuse` reuses the first rows of a partial page
(token-granular prefix caching), and :class:`~services.engine.held_pages.HeldPages` keeps the
cached prefixes of waiting requests until every page nobody waits for is evicted. The block manager never touches a KV tensor: the row copies
tails need go through the ``copy_rows`` the engine hands it, and the tier hooks get the pool from
the engine (``hooks.bind``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

from services.engine.held_pages import HeldPages
from services.engine.load_back import ASYNC_LOAD_MIN_PAGES, LOAD_TIMEOUT_S, LoadBack
from services.engine.page_hash import hash_page, root_hash
from services.engine.sequence import Sequence
from services.engine.tails import CopyRows, TailReuse
from services.engine.tier_hooks import CacheTierHooks, combine

log = logging.getLogger(__name__)

__all__ = ["ASYNC_LOAD_MIN_PAGES", "LOAD_TIMEOUT_S", "BlockManager", "Page"]


L1_ONLY, COPYING, CLEAN = 0, 1, 2
"""A cached page's standing with the lower tier."""


class Page:
    __slots__ = ("page_id", "ref_count", "page_hash", "token_ids", "parent_hash", "tier_state", "hold_count")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_count = 0
        self.page_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent_hash = 0
        self.tier_state = L1_ONLY
        self.hold_count = 0  # waiting sequences that hold it (held_pages.py)


def _delegate(collaborator: str, name: str, *, settable: bool = True) -> property:
    """An attribute of the block manager that is ``self.<collaborator>.<name>``."""

    def get(self):
        return getattr(getattr(self, collaborator), name)

    def set_(self, value) -> None:
        setattr(getattr(self, collaborator), name, value)

    return property(get, set_ if settable else None, doc=f"``{collaborator}.{name}``")


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        salt: str | bytes = b"",
        enable_prefix_caching: bool = True,
        hooks: CacheTierHooks | list[CacheTierHooks] | None = None,
        write_back_window: int | None = None,
        reuse_tails: bool = True,
        hold_waiting: bool = True,
        copy_rows: CopyRows | None = None,
        async_load_min_pages: int = ASYNC_LOAD_MIN_PAGES,
        load_timeout: float = LOAD_TIMEOUT_S,
        clock=time.monotonic,
    ):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hooks: CacheTierHooks = combine(hooks)
        self.root_hash = root_hash(salt)
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_page_ids: deque[int] = deque(range(num_pages))
        self.cached_page_ids: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self.hash_to_page_id: dict[int, int] = {}
        self.num_evictions = 0
        self.write_back_window = max(2, num_pages // 4) if write_back_window is None else write_back_window
        """How many of the least recently used cached pages are copied out ahead of eviction."""
        self.num_copying = 0
        self.loads = LoadBack(self, min_async_pages=async_load_min_pages, timeout=load_timeout, clock=clock)
        self.tails = TailReuse(self, copy_rows, enabled=enable_prefix_caching and reuse_tails)
        self.holds = HeldPages(self, enabled=enable_prefix_caching and hold_waiting)

    # ---- counts ----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free plus evictable cached, held ones included)."""
        return len(self.free_page_ids) + len(self.cached_page_ids) + len(self.holds.held)

    @property
    def num_reusable_pages(self) -> int:
        """Pages that can be handed out without waiting for a copy-out to land."""
        return len(self.free_page_ids) + sum(1 for p in self._evictable() if self.pages[p].tier_state != COPYING)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Indexed pages nobody owns (held by waiting sequences or not)."""
        return len(self.cached_page_ids) + len(self.holds.held)

    @property
    def num_held_pages(self) -> int:
        return len(self.holds.held)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- the collaborators' knobs and counters, read (and set) where they always were ----------

    reuse_tails = _delegate("tails", "enabled", settable=False)
    row_sources = _delegate("tails", "row_sources", settable=False)
    num_tail_hits = _delegate("tails", "num_hits", settable=False)
    num_tail_loads = _delegate("tails", "num_loads", settable=False)
    async_load_min_pages = _delegate("loads", "min_async_pages")
    load_timeout = _delegate("loads", "timeout")
    clock = _delegate("loads", "clock")
    num_loaded_back = _delegate("loads", "num_loaded_back", settable=False)
    num_async_loads = _delegate("loads", "num_async", settable=False)
    num_loads_cancelled = _delegate("loads", "num_cancelled", settable=False)
    num_load_timeouts = _delegate("loads", "num_timeouts", settable=False)

    @property
    def num_loading(self) -> int:
        """Loads in flight (including those of sequences freed meanwhile)."""
        return len(self.loads.in_flight)

    def tail_candidates(self, token_ids, k: int) -> list[tuple[int, ...]]:
        return self.tails.candidates(token_ids, k)

    def poll_loads(self) -> list[Sequence]:
        """Once a step: sequences whose lower-tier pages landed (or whose load was given up); they may run."""
        return self.loads.poll()

    def wait_loads(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a load to land (the step has nothing else to do)."""
        self.loads.wait(timeout)

    def wait_for_loads(self, timeout: float = 30.0) -> None:
        """Block until no load is in flight (tests, shutdown)."""
        self.loads.wait_all(timeout)

    # ---- hashing ---------------------------------------------------------

    def update_hashes(self, seq: Sequence) -> list[int]:
        """Extend ``seq.page_hashes`` to every full page of its tokens."""
        hashes, tokens, size = seq.page_hashes, seq.token_ids, self.page_size
        parent = hashes[-1] if hashes else self.root_hash
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hash_page(parent, tokens[start : start + size])
            hashes.append(parent)
        return hashes

    def cacheable_pages(self, seq: Sequence) -> int:
        """Full pages of ``seq`` a cache may supply. The last token always goes through the
        model (its logits are needed), so at most the full pages before it."""
        return (seq.num_tokens - 1) // self.page_size if self.enable_prefix_caching else 0

    def _match(self, seq: Sequence) -> list[int]:
        """Page ids of the longest indexed prefix of ``seq`` (no refs taken)."""
        limit = self.cacheable_pages(seq)
        if limit == 0:
            return []
        hashes = self.update_hashes(seq)
        matched = []
        size = self.page_size
        for i in range(limit):
            page_id = self.hash_to_page_id.get(hashes[i])
            if page_id is None:
                break
            if self.pages[page_id].token_ids != tuple(seq.token_ids[i * size : (i + 1) * size]):
                break  # a 64-bit collision: treat as a miss
            matched.append(page_id)
        return matched

    def num_matched_pages(self, seq: Sequence) -> int:
        """Full pages of ``seq``'s prefix the cache holds now (extends ``seq.page_hashes``)."""
        return len(self._match(seq))

    def matched_page_ids(self, seq: Sequence) -> list[int]:
        """Page ids of ``seq``'s cached prefix (no references taken)."""
        return self._match(seq)

    # ---- the waiting queue ------------------------------------------------

    def hold(self, seq: Sequence, *, first: bool = False) -> None:
        """``seq`` waits to be admitted: keep its cached prefix past other cached pages (held_pages.py)."""
        self.holds.hold(seq, first=first)

    def release_held(self, seq: Sequence) -> None:
        """``seq`` stopped waiting without being admitted (aborted)."""
        if seq.held_pages:
            self.holds.release(seq)

    # ---- admission -------------------------------------------------------

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether ``seq`` can get pages for all its tokens, keeping ``reserve`` free."""
        matched = self._match(seq)
        num_revived = sum(1 for p in matched if self.pages[p].ref_count == 0)
        num_new = self.pages_for(seq.num_tokens) - len(matched)
        return num_new + reserve <= self.num_free_pages - num_revived

    def allocate(self, seq: Sequence, *, may_wait: bool = False) -> int:
        """Give ``seq`` pages for all its tokens, reusing its cached prefix.

        Sets ``seq.num_computed_tokens`` to the cached length and returns it.
        The caller checked :meth:`can_allocate`. ``may_wait``: pages a lower tier
        holds may load asynchronously; if they do, ``seq.loading_ticket`` is set and
        ``seq`` must not run until :meth:`poll_loads` hands it back.
        """
        assert not seq.page_ids, f"{seq} already holds pages"
        matched = self._match(seq)
        for page_id in matched:
            self._ref(page_id)
            page = self.pages[page_id]
            if self.hooks.on_hit(page.page_hash, page_id):
                self._start_copy(page)
        seq.page_ids = list(matched)
        seq.num_indexed_pages = len(matched)
        if seq.held_pages:
            self.holds.release(seq)  # (after the references: its matched pages stay out of the LRU list)
        loaded = self.loads.load(seq, may_wait)
        while len(seq.page_ids) < self.pages_for(seq.num_tokens):
            seq.page_ids.append(self.take_free_page())
        num_cached = (len(matched) + loaded) * self.page_size
        tail = host_tail = 0
        if seq.loading_ticket is None:  # (else the tail is looked for when the load lands)
            tail, host_tail = self.tails.reuse(seq, len(matched) + loaded)
            if not seq.is_admitted_once:
                seq.num_loaded_tokens = loaded * self.page_size + host_tail
        seq.num_computed_tokens = num_cached + tail
        return seq.num_computed_tokens

    def touch(self, page_id: int) -> None:
        """Another request read ``page_id``'s rows: it becomes the most recently used, and a hit."""
        if page_id in self.cached_page_ids:
            self.cached_page_ids.move_to_end(page_id)
        page = self.pages[page_id]
        if self.hooks.on_hit(page.page_hash, page_id):
            self._start_copy(page)

    # ---- growth ----------------------------------------------------------

    def num_pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(seq.page_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_pages_needed(seq, num_tokens) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens in ``seq``'s pages."""
        for _ in range(self.num_pages_needed(seq, num_tokens)):
            seq.page_ids.append(self.take_free_page())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s pages past the first ``num_tokens`` tokens (speculative decoding's
        rollback of rejected drafts: those pages are private, unindexed, and go back free)."""
        keep = self.pages_for(num_tokens)
        assert keep >= seq.num_indexed_pages, f"{seq}: truncating indexed pages"
        while len(seq.page_ids) > keep:
            self.unref(seq.page_ids.pop())

    # ---- indexing --------------------------------------------------------

    def index_computed_pages(self, seq: Sequence) -> None:
        """Index every page of ``seq`` that is full and computed."""
        if self.enable_prefix_caching:
            self.index_pages(seq, min(seq.num_computed_tokens // self.page_size, len(seq.page_ids)))

    def index_pages(self, seq: Sequence, upto: int, *, clean: bool = False) -> None:
        """Index pages ``[num_indexed_pages, upto)`` of ``seq``; ``clean``: loaded from a lower tier."""
        if upto <= seq.num_indexed_pages:
            return
        hashes = self.update_hashes(seq)
        size = self.page_size
        for i in range(seq.num_indexed_pages, upto):
            page = self.pages[seq.page_ids[i]]
            h = hashes[i]
            if page.page_hash is None and h not in self.hash_to_page_id:
                self.index_page(page, h, hashes[i - 1] if i else self.root_hash,
                                tuple(seq.token_ids[i * size : (i + 1) * size]), clean)
            # else: another sequence computed the same page first; this copy
            # stays private and goes back to the free list when released.
        seq.num_indexed_pages = upto

    def index_page(self, page: Page, h: int, parent: int, tokens: tuple[int, ...], clean: bool = False) -> None:
        """Put ``page`` (full, or a tail of ``tokens``) in the prefix cache under ``h``."""
        page.page_hash, page.parent_hash, page.token_ids = h, parent, tokens
        page.tier_state = CLEAN if clean else L1_ONLY
        self.hash_to_page_id[h] = page.page_id
        self.tails.add_source(page)
        if self.hooks.on_stored(h, parent, page.page_id) and not clean:
            self._start_copy(page)

    # ---- release ---------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first, and reset its progress (while its pages
        load, they are released when the copy landed)."""
        if seq.loading_ticket is not None:
            self.loads.cancel(seq)
        else:
            self.tails.keep(seq)
            for page_id in reversed(seq.page_ids):
                self.unref(page_id)
            self.loads.forget(seq)  # landed but not yet handed back: nobody runs it now
        seq.page_ids = []
        seq.num_computed_tokens = 0
        seq.num_indexed_pages = 0

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached page (for tests and cache resets)."""
        count = self.num_cached_pages
        while self.cached_page_ids or self.holds.held:
            self.free_page_ids.append(self._evict_one())
        return count

    # ---- lower tiers ------------------------------------------------------

    def tier_tick(self) -> None:
        """Once a step: take back pages whose copy landed, start copies of pages near eviction."""
        if not self.hooks.is_tier:  # nothing below L1: no cost per step
            return
        self._reclaim(self.hooks.poll_written())
        if self.write_back_window <= 0:
            return
        for n, page_id in enumerate(self._evictable()):
            if n >= self.write_back_window:
                break
            page = self.pages[page_id]
            if page.tier_state == L1_ONLY and self.hooks.wants_write_back(page.page_hash):
                if not self._start_copy(page):
                    break  # the tier takes no more now (no free slots, queue full)

    def _start_copy(self, page: Page) -> bool:
        if page.tier_state != L1_ONLY:
            return page.tier_state == COPYING
        if not self.hooks.write_back(page.page_hash, page.parent_hash, page.token_ids, page.page_id):
            return False
        page.tier_state = COPYING
        self.num_copying += 1
        return True

    def _reclaim(self, done: list[tuple[int, bool]]) -> None:
        for page_id, ok in done:
            page = self.pages[page_id]
            if page.tier_state == COPYING:
                page.tier_state = CLEAN if ok else L1_ONLY
                self.num_copying -= 1

    def wait_for_copies(self, timeout: float = 30.0) -> None:
        """Block until no copy-out is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.num_copying and time.monotonic() < deadline:
            self._reclaim(self.hooks.wait_written(min(1.0, deadline - time.monotonic())))

    # ---- references and eviction -------------------------------------------

    def _evictable(self):
        """Unowned cached pages in eviction order: the LRU list, then the held pages."""
        yield from self.cached_page_ids
        yield from self.holds.eviction_order()

    def _ref(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            self._uncache(page_id)
        page.ref_count += 1

    def _uncache(self, page_id: int) -> None:
        """Take an unowned cached page out of the LRU list or the held pages, wherever it is."""
        if page_id in self.cached_page_ids:
            del self.cached_page_ids[page_id]
        else:
            del self.holds.held[page_id]

    def unref(self, page_id: int) -> None:
        """Drop one reference; the last one frees the page, or caches it when it is indexed."""
        page = self.pages[page_id]
        page.ref_count -= 1
        if page.ref_count > 0:
            return
        assert page.ref_count == 0, f"page {page_id} released twice"
        if page.page_hash is not None:
            if not self.holds.keeps(page):
                self.cached_page_ids[page_id] = None
        else:
            self.free_page_ids.append(page_id)

    def take_free_page(self) -> int:
        """A page with one reference: a free one, else the least recently used cached one, evicted."""
        page_id = self.free_page_ids.popleft() if self.free_page_ids else self._evict_one()
        self.pages[page_id].ref_count = 1
        return page_id

    def _evict_one(self) -> int:
        if not self.cached_page_ids and not self.holds.held:
            raise RuntimeError("KV pool exhausted (the scheduler should have checked)")
        page_id = next((p for p in self._evictable() if self.pages[p].tier_state != COPYING), None)
        while page_id is None:  # every evictable page is being copied out: wait for one copy
            self._reclaim(self.hooks.wait_written(1.0))
            page_id = next((p for p in self._evictable() if self.pages[p].tier_state != COPYING), None)
        self._uncache(page_id)
        page = self.pages[page_id]
        self.holds.evicted(page)
        h = page.page_hash
        assert h is not None
        if page.tier_state == L1_ONLY and self.hooks.wants_write_back(h):
            self.hooks.write_back_sync(h, page.parent_hash, page.token_ids, page_id)
        self.hooks.on_removed(h, page_id, clean=page.tier_state == CLEAN)
        del self.hash_to_page_id[h]
        self.tails.drop_source(page)
        page.page_hash = None
        page.token_ids = ()
        page.tier_state = L1_ONLY
        self.num_evictions += 1
        return page_id
