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

Load-back (``allocate(seq, may_wait=True)``): pages a lower tier holds are taken
for ``seq`` and, when the run is at least ``async_load_min_pages`` long, filled
by the tier's copy thread while the engine keeps stepping; ``seq.loading_ticket``
is set until :meth:`poll_loads` reports the copy landed, and then the verified
pages are indexed and ``seq.num_computed_tokens`` covers them (the first page
that failed verification and everything after it is computed). A sequence freed
while loading gives its pages back only when the copy landed: the copy thread
never writes into a page someone else holds. A load still in flight after
``load_timeout`` seconds is given up: its request gets fresh pages and computes
what the load would have brought (nothing stale is ever read: the late copy
lands in pages nobody uses, which are freed then); if the pool has no room for
them yet, the request keeps waiting, and a copy that lands is used.

Rows, not only pages (token-granular reuse): where a request's full pages stop
matching, its next page may still begin like a cached one. When a sequence is
freed, the computed part of its last, partial page (the answer of a chat turn
but its last token, which never went through the model) is indexed as a *tail*
under ``hash_tail(parent, those tokens)`` and cached like any page (LRU, lower
tiers, KV events). At admission, after the full pages, the cached page (tail or
full) with the same parent that shares the longest run of the request's next
tokens has those rows copied into the request's own next page (L1), or the
longest exact tail is loaded into it (a lower tier): the next turn of a
conversation recomputes 1 token of the answer, not up to ``page_size``, and an
answer cut short by a stop string keeps the rows before the cut. Pages copied
from are never written (a tail is never owned by a sequence).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from os.path import commonprefix  # any sequences, not only paths

from services.engine.page_hash import hash_page, hash_tail, root_hash
from services.engine.sequence import Sequence
from services.engine.tier_hooks import CacheTierHooks, combine

log = logging.getLogger(__name__)


L1_ONLY, COPYING, CLEAN = 0, 1, 2
"""A cached page's standing with the lower tier."""


class Page:
    __slots__ = ("page_id", "ref_count", "page_hash", "token_ids", "parent_hash", "tier_state")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_count = 0
        self.page_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent_hash = 0
        self.tier_state = L1_ONLY


class _Load:
    """A lower-tier load in flight into a sequence's pages."""

    __slots__ = ("seq", "start", "count", "started", "page_ids", "first_admission", "cancelled")

    def __init__(self, seq: Sequence, start: int, count: int, started: float, first_admission: bool):
        self.seq, self.start, self.count, self.started = seq, start, count, started
        self.first_admission = first_admission
        self.page_ids: list[int] = []  # once cancelled: the pages the copy writes, freed when it lands
        self.cancelled = False


MAX_ROW_SOURCES = 16
"""Most cached pages compared for a partial-page match (same parent and first token)."""


ASYNC_LOAD_MIN_PAGES = 8
"""Shorter lower-tier runs are loaded on the engine thread at admission. An asynchronous load
makes its request wait at least one more step (it lands after this step's forward) to spare
the others the copy; a short copy stalls them for less than that is worth (bench/load_back_bench.py:
8 pages of the default model, 5.6 MiB, copy in about 0.3 ms on CPU, a few % of one decode step)."""


LOAD_TIMEOUT_S = 5.0
"""Seconds an asynchronous load may stay in flight before its request computes those pages instead.
A load is a local copy (tens of ms for a long prompt, behind the write-backs queued before it), so
this fires only for a copy thread that stalls; recomputing a long prompt costs seconds."""


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
        self.num_loaded_back = 0
        self.async_load_min_pages = async_load_min_pages
        """Fewest lower-tier pages loaded asynchronously (``allocate(may_wait=True)``)."""
        self.load_timeout = load_timeout
        """Seconds an asynchronous load may take before its request recomputes those pages."""
        self.clock = clock
        self.loads: dict[object, _Load] = {}  # ticket -> load in flight
        self.num_async_loads = 0
        self.num_loads_cancelled = 0  # sequences freed while their pages were loading
        self.num_load_timeouts = 0  # loads given up for taking longer than load_timeout
        self._loaded: list[Sequence] = []  # loads landed, not yet reported by poll_loads
        self.reuse_tails = enable_prefix_caching and reuse_tails
        """Index the computed part of a freed sequence's partial last page and reuse it (a tail)."""
        self.kv_pool = None  # tails are copied within it; no tails before bind()
        self.row_sources: dict[tuple[int, int], dict[int, None]] = {}
        """(parent hash, first token) -> indexed pages (full and tails), newest last: what a
        partial-page match compares."""
        self.num_tail_hits = 0  # partial pages whose rows were copied from L1 (a tail or a page's start)
        self.num_tail_loads = 0  # tails loaded back from a lower tier

    def bind(self, kv_pool) -> None:
        """Hand the hooks the KV pool (it is built after the hooks are made)."""
        self.kv_pool = kv_pool
        self.hooks.bind(kv_pool)

    # ---- counts ----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free plus evictable cached)."""
        return len(self.free_page_ids) + len(self.cached_page_ids)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached_page_ids)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- hashing ---------------------------------------------------------

    def update_hashes(self, seq: Sequence) -> list[int]:
        """Extend ``seq.page_hashes`` to every full page of its tokens."""
        hashes, tokens, size = seq.page_hashes, seq.token_ids, self.page_size
        parent = hashes[-1] if hashes else self.root_hash
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hash_page(parent, tokens[start : start + size])
            hashes.append(parent)
        return hashes

    def _cacheable_pages(self, seq: Sequence) -> int:
        # The last token always goes through the model (its logits are needed),
        # so a prefix hit covers at most the full pages before it.
        return (seq.num_tokens - 1) // self.page_size if self.enable_prefix_caching else 0

    def _match(self, seq: Sequence) -> list[int]:
        """Page ids of the longest indexed prefix of ``seq`` (no refs taken)."""
        limit = self._cacheable_pages(seq)
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
        loaded = self._load_from_lower_tier(seq, may_wait)
        while len(seq.page_ids) < self.pages_for(seq.num_tokens):
            seq.page_ids.append(self._take_free_page())
        num_cached = (len(matched) + loaded) * self.page_size
        tail = host_tail = 0
        if seq.loading_ticket is None:  # (else the tail is looked for when the load lands)
            tail, host_tail = self._reuse_tail(seq, len(matched) + loaded)
            if not seq.is_admitted_once:
                seq.num_loaded_tokens = loaded * self.page_size + host_tail
        seq.num_computed_tokens = num_cached + tail
        return seq.num_computed_tokens

    def _load_from_lower_tier(self, seq: Sequence, may_wait: bool = False) -> int:
        start, limit = len(seq.page_ids), self._cacheable_pages(seq)
        if start >= limit:
            return 0
        want = seq.page_hashes[start:limit]
        num_hits = min(self.hooks.lookup(want), len(want))
        if num_hits <= 0:
            return 0
        size = self.page_size
        tokens = [seq.token_ids[(start + i) * size : (start + i + 1) * size] for i in range(num_hits)]
        page_ids = [self._take_free_page() for _ in range(num_hits)]
        if may_wait and num_hits >= self.async_load_min_pages:
            try:
                ticket = self.hooks.start_load(want[:num_hits], tokens, page_ids)
            except Exception:  # a lower tier failing must not fail the request
                log.exception("start_load of %d pages failed; loading synchronously", num_hits)
                ticket = None
            if ticket is not None:
                self.loads[ticket] = _Load(seq, start, num_hits, self.clock(), not seq.is_admitted_once)
                self.num_async_loads += 1
                seq.loading_ticket = ticket
                seq.page_ids.extend(page_ids)  # filled by the tier; indexed when they land
                return 0
        try:
            loaded = max(0, min(self.hooks.load_back(want[:num_hits], tokens, page_ids), num_hits))
        except Exception:  # a lower tier failing must not fail the request
            log.exception("load_back of %d pages failed; recomputing them", num_hits)
            loaded = 0
        for page_id in reversed(page_ids[loaded:]):  # not loaded: recomputed into fresh pages
            self._unref(page_id)
        seq.page_ids.extend(page_ids[:loaded])
        self.index_pages(seq, start + loaded, clean=True)
        self.num_loaded_back += loaded
        return loaded

    # ---- asynchronous load-back --------------------------------------------

    @property
    def num_loading(self) -> int:
        """Loads in flight (including those of sequences freed meanwhile)."""
        return len(self.loads)

    def poll_loads(self) -> list[Sequence]:
        """Once a step: sequences whose pages landed since the last call, or whose load was given
        up for taking longer than ``load_timeout``; they may run now."""
        if self.loads:
            for ticket, n in self.hooks.poll_loaded():
                self._land(ticket, n)
            now = self.clock()
            for load in list(self.loads.values()):
                if not load.cancelled and now - load.started > self.load_timeout:
                    self._give_up(load)
        ready, self._loaded = self._loaded, []
        return ready

    def _give_up(self, load: _Load) -> None:
        """The load is late: its request computes those pages in fresh ones (if the pool has room;
        else it keeps waiting), and the pages the copy writes are freed when it lands."""
        # (pages being copied out wait for the copy thread, which may be the one that is late)
        room = len(self.free_page_ids) + sum(1 for p in self.cached_page_ids if self.pages[p].tier_state != COPYING)
        if room < load.count:
            return
        seq = load.seq
        end = load.start + load.count
        load.page_ids = seq.page_ids[load.start : end]
        load.cancelled = True
        seq.page_ids[load.start : end] = [self._take_free_page() for _ in range(load.count)]
        seq.loading_ticket = None
        seq.num_computed_tokens = load.start * self.page_size
        if load.first_admission:
            seq.num_loaded_tokens = 0
        self.num_load_timeouts += 1
        log.warning("a load of %d pages took over %.1f s; recomputing them for %s", load.count, self.load_timeout,
                    seq.request_id)
        self._loaded.append(seq)

    def wait_loads(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a load to land (the step has nothing else to do)."""
        if self.loads:
            for ticket, n in self.hooks.wait_loaded(timeout):
                self._land(ticket, n)

    def wait_for_loads(self, timeout: float = 30.0) -> None:
        """Block until no load is in flight (tests, shutdown)."""
        import time

        deadline = time.monotonic() + timeout
        while self.loads and time.monotonic() < deadline:
            self.wait_loads(min(1.0, deadline - time.monotonic()))

    def _land(self, ticket: object, num_loaded: int) -> None:
        load = self.loads.pop(ticket, None)
        if load is None:
            log.warning("a load nobody asked for landed (ticket %r)", ticket)
            return
        if load.cancelled:  # freed while loading: the copy thread is done with its pages now
            for page_id in reversed(load.page_ids):
                self._unref(page_id)
            return
        seq = load.seq
        seq.loading_ticket = None
        limit = self._cacheable_pages(seq)
        n = max(0, min(num_loaded, limit - load.start))
        # Pages past the verified ones stay in seq (private, unindexed): they are computed.
        self.index_pages(seq, load.start + n, clean=True)
        tail, host_tail = self._reuse_tail(seq, load.start + n)
        seq.num_computed_tokens = (load.start + n) * self.page_size + tail
        if load.first_admission:
            seq.num_loaded_tokens = n * self.page_size + host_tail
        self.num_loaded_back += n
        self._loaded.append(seq)

    def _cancel_load(self, seq: Sequence) -> None:
        load = self.loads[seq.loading_ticket]
        load.cancelled = True
        self.num_loads_cancelled += 1
        load.page_ids = list(seq.page_ids)  # (the sequence is being freed: all its pages wait for the copy)
        seq.loading_ticket = None

    # ---- tails -------------------------------------------------------------

    def _keep_tail(self, seq: Sequence) -> None:
        """Index the computed rows of ``seq``'s partial last page as a tail (``seq`` is being freed)."""
        if not self.reuse_tails or self.kv_pool is None or seq.imported_kv is not None:
            return
        size = self.page_size
        full, rows = divmod(seq.num_computed_tokens, size)
        if rows == 0 or full >= len(seq.page_ids):
            return
        page = self.pages[seq.page_ids[full]]
        if page.page_hash is not None or page.ref_count != 1:
            return
        parent = self.update_hashes(seq)[full - 1] if full else self.root_hash
        tokens = tuple(seq.token_ids[full * size : full * size + rows])
        h = hash_tail(parent, tokens)
        if h not in self.hash_to_page_id:  # (else the same tail is cached already)
            self._index(page, h, parent, tokens)

    def tail_candidates(self, token_ids, k: int) -> list[tuple[int, ...]]:
        """Tokens of the tails that may follow ``k`` full pages in a prompt of ``token_ids``,
        longest first; its last token is left out (hash one with ``page_hash.hash_tail``)."""
        start = k * self.page_size
        return [tuple(token_ids[start : start + m]) for m in range(min(self.page_size - 1, len(token_ids) - 1 - start), 0, -1)]

    def _reuse_tail(self, seq: Sequence, k: int) -> tuple[int, int]:
        """Fill the first rows of ``seq``'s page ``k`` (after ``k`` full pages) from the cache: the
        L1 page with the same parent sharing the longest run of ``seq``'s next tokens (rows
        copied), or a longer exact tail a lower tier holds (loaded).

        Returns ``(tokens reused, of which loaded from a lower tier)``. The last token is
        always left to compute (its logits are needed)."""
        if not self.reuse_tails or self.kv_pool is None or seq.imported_kv is not None or k >= len(seq.page_ids):
            return 0, 0
        parent = self.update_hashes(seq)[k - 1] if k else self.root_hash
        candidates = self.tail_candidates(seq.token_ids, k)
        if not candidates:
            return 0, 0
        dst, want = seq.page_ids[k], candidates[0]
        best, src = 0, None
        for n, page_id in enumerate(reversed(self.row_sources.get((parent, want[0]), {}))):
            if n == MAX_ROW_SOURCES:
                break
            common = len(commonprefix([self.pages[page_id].token_ids, want]))
            if common > best:
                best, src = common, page_id
        longer = len(want) - best  # candidates[:longer]: the tails longer than L1's rows
        if self.hooks.is_tier and longer > 0:  # (first: a failed load may have written into dst)
            hashes = [hash_tail(parent, t) for t in candidates[:longer]]  # (only a tier is asked by hash)
            try:
                i = self.hooks.find_tail(hashes)
                if i is not None and self.hooks.load_back([hashes[i]], [candidates[i]], [dst]) == 1:
                    self.num_tail_loads += 1
                    return len(candidates[i]), len(candidates[i])
            except Exception:  # a lower tier failing must not fail the request
                log.exception("loading a tail page failed; recomputing it")
        if src is None:
            return 0, 0
        self.kv_pool.data[dst, :, :, :best] = self.kv_pool.data[src, :, :, :best]
        if src in self.cached_page_ids:
            self.cached_page_ids.move_to_end(src)
        if self.hooks.on_hit(self.pages[src].page_hash, src):
            self._start_copy(self.pages[src])
        self.num_tail_hits += 1
        return best, 0

    # ---- growth ----------------------------------------------------------

    def num_pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(seq.page_ids))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_pages_needed(seq, num_tokens) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens in ``seq``'s pages."""
        for _ in range(self.num_pages_needed(seq, num_tokens)):
            seq.page_ids.append(self._take_free_page())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s pages past the first ``num_tokens`` tokens (speculative decoding's
        rollback of rejected drafts: those pages are private, unindexed, and go back free)."""
        keep = self.pages_for(num_tokens)
        assert keep >= seq.num_indexed_pages, f"{seq}: truncating indexed pages"
        while len(seq.page_ids) > keep:
            self._unref(seq.page_ids.pop())

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
                self._index(page, h, hashes[i - 1] if i else self.root_hash,
                            tuple(seq.token_ids[i * size : (i + 1) * size]), clean)
            # else: another sequence computed the same page first; this copy
            # stays private and goes back to the free list when released.
        seq.num_indexed_pages = upto

    def _index(self, page: Page, h: int, parent: int, tokens: tuple[int, ...], clean: bool = False) -> None:
        page.page_hash, page.parent_hash, page.token_ids = h, parent, tokens
        page.tier_state = CLEAN if clean else L1_ONLY
        self.hash_to_page_id[h] = page.page_id
        if self.reuse_tails:
            self.row_sources.setdefault((parent, tokens[0]), {})[page.page_id] = None
        if self.hooks.on_stored(h, parent, page.page_id) and not clean:
            self._start_copy(page)

    # ---- release ---------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first, and reset its progress (while its pages
        load, they are released when the copy landed)."""
        if seq.loading_ticket is not None:
            self._cancel_load(seq)
        else:
            self._keep_tail(seq)
            for page_id in reversed(seq.page_ids):
                self._unref(page_id)
            if seq in self._loaded:  # landed but not yet handed back: nobody runs it now
                self._loaded.remove(seq)
        seq.page_ids = []
        seq.num_computed_tokens = 0
        seq.num_indexed_pages = 0

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached page (for tests and cache resets)."""
        count = len(self.cached_page_ids)
        while self.cached_page_ids:
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
        for n, page_id in enumerate(self.cached_page_ids):
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
        import time

        deadline = time.monotonic() + timeout
        while self.num_copying and time.monotonic() < deadline:
            self._reclaim(self.hooks.wait_written(min(1.0, deadline - time.monotonic())))

    # ---- internals -------------------------------------------------------

    def _ref(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            del self.cached_page_ids[page_id]
        page.ref_count += 1

    def _unref(self, page_id: int) -> None:
        page = self.pages[page_id]
        page.ref_count -= 1
        if page.ref_count > 0:
            return
        assert page.ref_count == 0, f"page {page_id} released twice"
        if page.page_hash is not None:
            self.cached_page_ids[page_id] = None
        else:
            self.free_page_ids.append(page_id)

    def _take_free_page(self) -> int:
        page_id = self.free_page_ids.popleft() if self.free_page_ids else self._evict_one()
        self.pages[page_id].ref_count = 1
        return page_id

    def _evict_one(self) -> int:
        if not self.cached_page_ids:
            raise RuntimeError("KV pool exhausted (the scheduler should have checked)")
        page_id = next((p for p in self.cached_page_ids if self.pages[p].tier_state != COPYING), None)
        while page_id is None:  # every evictable page is being copied out: wait for one copy
            self._reclaim(self.hooks.wait_written(1.0))
            page_id = next((p for p in self.cached_page_ids if self.pages[p].tier_state != COPYING), None)
        del self.cached_page_ids[page_id]
        page = self.pages[page_id]
        h = page.page_hash
        assert h is not None
        if page.tier_state == L1_ONLY and self.hooks.wants_write_back(h):
            self.hooks.write_back_sync(h, page.parent_hash, page.token_ids, page_id)
        self.hooks.on_removed(h, page_id, clean=page.tier_state == CLEAN)
        del self.hash_to_page_id[h]
        if self.reuse_tails:
            key = (page.parent_hash, page.token_ids[0])
            sources = self.row_sources[key]
            del sources[page_id]
            if not sources:
                del self.row_sources[key]
        page.page_hash = None
        page.token_ids = ()
        page.tier_state = L1_ONLY
        self.num_evictions += 1
        return page_id
