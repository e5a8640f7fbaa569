"""Pages of the KV pool: allocation, reference counts and the prefix cache.

Page lifecycle::

    free --allocate--> owned (ref >= 1) --last release--> free        (partial page)
                                        \\-last release--> cached (LRU) (full, indexed page)
    cached --matched by a new request--> owned
    cached --evicted (hooks.on_evict)--> free

A full page is indexed under its chained page hash once its KV is computed,
so any later request whose prompt starts with the same tokens reuses it. A
page with no owner stays cached until the pool needs it; the least recently
released goes first, and a sequence releases its pages last-to-first so a
chain is evicted from its tail.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from services.engine.page_hash import hash_page, root_hash
from services.engine.sequence import Sequence
from services.engine.tier_hooks import CacheTierHooks, NoTierHooks

log = logging.getLogger(__name__)


class Page:
    __slots__ = ("page_id", "ref_count", "page_hash", "token_ids")

    def __init__(self, page_id: int):
        self.page_id = page_id
        self.ref_count = 0
        self.page_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        salt: str | bytes = b"",
        enable_prefix_caching: bool = True,
        hooks: CacheTierHooks | None = None,
    ):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hooks: CacheTierHooks = hooks or NoTierHooks()
        self.root_hash = root_hash(salt)
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_page_ids: deque[int] = deque(range(num_pages))
        self.cached_page_ids: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self.hash_to_page_id: dict[int, int] = {}
        self.num_evictions = 0

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

    # ---- admission -------------------------------------------------------

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether ``seq`` can get pages for all its tokens, keeping ``reserve`` free."""
        matched = self._match(seq)
        num_revived = sum(1 for p in matched if self.pages[p].ref_count == 0)
        num_new = self.pages_for(seq.num_tokens) - len(matched)
        return num_new + reserve <= self.num_free_pages - num_revived

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` pages for all its tokens, reusing its cached prefix.

        Sets ``seq.num_computed_tokens`` to the cached length and returns it.
        The caller checked :meth:`can_allocate`.
        """
        assert not seq.page_ids, f"{seq} already holds pages"
        matched = self._match(seq)
        for page_id in matched:
            self._ref(page_id)
        seq.page_ids = list(matched)
        seq.num_indexed_pages = len(matched)
        loaded = self._load_from_lower_tier(seq)
        num_cached = (len(matched) + loaded) * self.page_size
        while len(seq.page_ids) < self.pages_for(seq.num_tokens):
            seq.page_ids.append(self._take_free_page())
        seq.num_computed_tokens = num_cached
        return num_cached

    def _load_from_lower_tier(self, seq: Sequence) -> int:
        start, limit = len(seq.page_ids), self._cacheable_pages(seq)
        if start >= limit:
            return 0
        want = seq.page_hashes[start:limit]
        num_hits = min(self.hooks.lookup(want), len(want))
        if num_hits <= 0:
            return 0
        page_ids = [self._take_free_page() for _ in range(num_hits)]
        try:
            self.hooks.load_back(want[:num_hits], page_ids)
        except Exception:  # a lower tier failing must not fail the request
            log.exception("load_back of %d pages failed; recomputing them", num_hits)
            for page_id in reversed(page_ids):
                self._unref(page_id)
            return 0
        seq.page_ids.extend(page_ids)
        self.index_pages(seq, start + num_hits)
        return num_hits

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

    def index_pages(self, seq: Sequence, upto: int) -> None:
        if upto <= seq.num_indexed_pages:
            return
        hashes = self.update_hashes(seq)
        size = self.page_size
        for i in range(seq.num_indexed_pages, upto):
            page = self.pages[seq.page_ids[i]]
            h = hashes[i]
            if page.page_hash is None and h not in self.hash_to_page_id:
                page.page_hash = h
                page.token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
                self.hash_to_page_id[h] = page.page_id
                self.hooks.on_stored(h, page.page_id)
            # else: another sequence computed the same page first; this copy
            # stays private and goes back to the free list when released.
        seq.num_indexed_pages = upto

    # ---- release ---------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first, and reset its progress."""
        for page_id in reversed(seq.page_ids):
            self._unref(page_id)
        seq.page_ids = []
        seq.num_computed_tokens = 0
        seq.num_indexed_pages = 0

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached page (for tests and cache resets)."""
        count = len(self.cached_page_ids)
        while self.cached_page_ids:
            self.free_page_ids.append(self._evict_one())
        return count

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
        page_id, _ = self.cached_page_ids.popitem(last=False)
        page = self.pages[page_id]
        h = page.page_hash
        assert h is not None
        self.hooks.on_evict(h, page_id)
        del self.hash_to_page_id[h]
        page.page_hash = None
        page.token_ids = ()
        self.num_evictions += 1
        return page_id
