"""Rows, not only pages: token-granular reuse of a page's first rows (tails).

Where a request's full pages stop matching, its next page may still begin like a cached one.
When a sequence is freed, the computed part of its last, partial page (the answer of a chat turn
but its last token, which never went through the model) is indexed as a *tail* under
``hash_tail(parent, those tokens)`` and cached like any page (LRU, lower tiers, KV events). At
admission, after the full pages, the cached page (tail or full) with the same parent that shares
the longest run of the request's next tokens has those rows copied into the request's own next
page (L1), or the longest exact tail is loaded into it (a lower tier): the next turn of a
conversation recomputes 1 token of the answer, not up to ``page_size``, and an answer cut short
by a stop string keeps the rows before the cut. Pages copied from are never written (a tail is
never owned by a sequence).

:class:`TailReuse` keeps the index of row sources and decides; the rows are copied by the
``copy_rows(src, dst, num_rows)`` its owner was given (the engine's KV pool), so the block
manager never touches a KV tensor. Without ``copy_rows`` (a block manager with no KV, in tests)
tails are off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from os.path import commonprefix  # any sequences, not only paths
from typing import TYPE_CHECKING

from services.engine.page_hash import hash_tail
from services.engine.sequence import Sequence

if TYPE_CHECKING:
    from services.engine.block_manager import BlockManager, Page

log = logging.getLogger(__name__)

MAX_ROW_SOURCES = 16
"""Most cached pages compared for a partial-page match (same parent and first token)."""

CopyRows = Callable[[int, int, int], None]
"""``copy_rows(src_page_id, dst_page_id, num_rows)``: copy a page's first rows, every layer, K and V."""


class TailReuse:
    def __init__(self, bm: BlockManager, copy_rows: CopyRows | None, enabled: bool):
        self.bm = bm
        self.copy_rows = copy_rows
        self.enabled = enabled
        """Index the computed part of a freed sequence's partial last page and reuse it (a tail)."""
        self.row_sources: dict[tuple[int, int], dict[int, None]] = {}
        """(parent hash, first token) -> indexed pages (full and tails), newest last: what a
        partial-page match compares."""
        self.num_hits = 0  # partial pages whose rows were copied from L1 (a tail or a page's start)
        self.num_loads = 0  # tails loaded back from a lower tier

    @property
    def is_active(self) -> bool:
        return self.enabled and self.copy_rows is not None

    # ---- the index of row sources (every indexed page) -------------------------

    def add_source(self, page: Page) -> None:
        if self.enabled:
            self.row_sources.setdefault((page.parent_hash, page.token_ids[0]), {})[page.page_id] = None

    def drop_source(self, page: Page) -> None:
        if self.enabled:
            key = (page.parent_hash, page.token_ids[0])
            sources = self.row_sources[key]
            del sources[page.page_id]
            if not sources:
                del self.row_sources[key]

    # ---- release and admission -------------------------------------------------

    def keep(self, seq: Sequence) -> None:
        """Index the computed rows of ``seq``'s partial last page as a tail (``seq`` is being freed)."""
        if not self.is_active or seq.imported_kv is not None:
            return
        bm = self.bm
        size = bm.page_size
        full, rows = divmod(seq.num_computed_tokens, size)
        if rows == 0 or full >= len(seq.page_ids):
            return
        page = bm.pages[seq.page_ids[full]]
        if page.page_hash is not None or page.ref_count != 1:
            return
        parent = bm.update_hashes(seq)[full - 1] if full else bm.root_hash
        tokens = tuple(seq.token_ids[full * size : full * size + rows])
        h = hash_tail(parent, tokens)
        if h not in bm.hash_to_page_id:  # (else the same tail is cached already)
            bm.index_page(page, h, parent, tokens)

    def candidates(self, token_ids, k: int) -> list[tuple[int, ...]]:
        """Tokens of the tails that may follow ``k`` full pages in a prompt of ``token_ids``,
        longest first; its last token is left out (hash one with ``page_hash.hash_tail``)."""
        start = k * self.bm.page_size
        return [tuple(token_ids[start : start + m])
                for m in range(min(self.bm.page_size - 1, len(token_ids) - 1 - start), 0, -1)]

    def reuse(self, seq: Sequence, k: int) -> tuple[int, int]:
        """Fill the first rows of ``seq``'s page ``k`` (after ``k`` full pages) from the cache: the
        L1 page with the same parent sharing the longest run of ``seq``'s next tokens (rows
        copied), or a longer exact tail a lower tier holds (loaded).

        Returns ``(tokens reused, of which loaded from a lower tier)``. The last token is
        always left to compute (its logits are needed)."""
        bm = self.bm
        if not self.is_active or seq.imported_kv is not None or k >= len(seq.page_ids):
            return 0, 0
        parent = bm.update_hashes(seq)[k - 1] if k else bm.root_hash
        candidates = self.candidates(seq.token_ids, k)
        if not candidates:
            return 0, 0
        dst, want = seq.page_ids[k], candidates[0]
        best, src = 0, None
        for n, page_id in enumerate(reversed(self.row_sources.get((parent, want[0]), {}))):
            if n == MAX_ROW_SOURCES:
                break
            common = len(commonprefix([bm.pages[page_id].token_ids, want]))
            if common > best:
                best, src = common, page_id
        longer = len(want) - best  # candidates[:longer]: the tails longer than L1's rows
        if bm.hooks.is_tier and longer > 0:  # (first: a failed load may have written into dst)
            hashes = [hash_tail(parent, t) for t in candidates[:longer]]  # (only a tier is asked by hash)
            try:
                i = bm.hooks.find_tail(hashes)
                if i is not None and bm.hooks.load_back([hashes[i]], [candidates[i]], [dst]) == 1:
                    self.num_loads += 1
                    return len(candidates[i]), len(candidates[i])
            except Exception:  # a lower tier failing must not fail the request
                log.exception("loading a tail page failed; recomputing it")
        if src is None:
            return 0, 0
        self.copy_rows(src, dst, best)
        bm.touch(src)
        self.num_hits += 1
        return best, 0
