"""The seam between the device page pool (L1) and what listens below it.

The block manager calls these hooks; it never knows what sits below it. Two
kinds of listeners plug in (several at once, through :class:`TierHooksList`):

- a cache tier (the kv_store client, ``services/kv_store/client.py``): it copies
  pages out (write-back, asynchronously) and fills pages back in (load-back);
- observers (the KV-event publisher): they only hear pages stored and removed.

``bind`` hands every listener the KV pool once it exists (the hooks are made
before the engine builds its pool). Every method has a do-nothing default, so a
listener overrides only what it needs.

A page a tier is copying out stays in the pool (it may even be hit meanwhile:
an indexed page never changes) and is not reused until its copy landed
(:meth:`poll_written`). A page whose copy landed is "clean": evicting it costs
nothing, because a lower tier holds it.
"""

from __future__ import annotations

from collections.abc import Sequence


class CacheTierHooks:
    """The default and the base class: no lower tier, nobody listening."""

    is_tier = False
    """True for a listener that stores pages (at most one per block manager)."""

    def bind(self, kv_pool) -> None:
        """The engine built its KV pool: pages are ``kv_pool.data[page_id]``."""

    def on_stored(self, page_hash: int, parent_hash: int, page_id: int) -> bool:
        """A full page is computed and indexed. True: copy it to the lower tier now (write-through)."""
        return False

    def on_hit(self, page_hash: int, page_id: int) -> bool:
        """A new request reuses an indexed page. True: copy it to the lower tier now."""
        return False

    def wants_write_back(self, page_hash: int) -> bool:
        """Whether an L1-only page near the LRU end should be copied out before it is evicted."""
        return False

    def on_removed(self, page_hash: int, page_id: int, *, clean: bool) -> None:
        """The page leaves L1 (its slot is reused). ``clean``: a lower tier already holds it.

        A tier may copy a page that is not clean synchronously here (the pool ran dry
        before write-back reached it) or let it go.
        """

    def write_back(self, page_hash: int, parent_hash: int, token_ids: Sequence[int], page_id: int) -> bool:
        """Start copying a page out, asynchronously. True if started (see :meth:`poll_written`)."""
        return False

    def write_back_sync(self, page_hash: int, parent_hash: int, token_ids: Sequence[int], page_id: int) -> None:
        """Copy a page out now: it is being evicted before write-back reached it (the pool ran dry)."""

    def poll_written(self) -> list[tuple[int, bool]]:
        """``(page_id, ok)`` of copies that finished since the last call; never blocks."""
        return []

    def wait_written(self, timeout: float) -> list[tuple[int, bool]]:
        """Like :meth:`poll_written`, but waits up to ``timeout`` s for at least one."""
        return []

    def lookup(self, page_hashes: Sequence[int]) -> int:
        """How many leading hashes of ``page_hashes`` a lower tier can load back (0: recompute)."""
        return 0

    def find_tail(self, tail_hashes: Sequence[int]) -> int | None:
        """Index of the first of ``tail_hashes`` a lower tier can load back, or None. They name
        tails of one page (``page_hash.hash_tail``), longest first; a miss is not counted as one."""
        return None

    def load_back(self, page_hashes: Sequence[int], token_ids: Sequence[Sequence[int]],
                  page_ids: Sequence[int]) -> int:
        """Fill ``page_ids`` with those pages; returns how many leading pages were loaded and
        verified (the rest are recomputed). Never returns a page it could not verify."""
        return 0

    def start_load(self, page_hashes: Sequence[int], token_ids: Sequence[Sequence[int]],
                   page_ids: Sequence[int]) -> object | None:
        """Like :meth:`load_back`, asynchronously: queue the copies and return a ticket, or None
        when this tier cannot load asynchronously now (the caller loads synchronously instead).
        ``page_ids`` belong to the tier until the ticket comes back from :meth:`poll_loaded`."""
        return None

    def poll_loaded(self) -> list[tuple[object, int]]:
        """``(ticket, num_loaded)`` of loads that finished since the last call; never blocks.
        ``num_loaded`` leading pages were loaded and verified; on CUDA the engine's stream
        already waits for their copy (a stream dependency, not a host sync)."""
        return []

    def wait_loaded(self, timeout: float) -> list[tuple[object, int]]:
        """Like :meth:`poll_loaded`, but waits up to ``timeout`` s for at least one."""
        return []


NoTierHooks = CacheTierHooks


class TierHooksList(CacheTierHooks):
    """Several listeners; at most one of them is the cache tier (``is_tier``)."""

    def __init__(self, hooks: Sequence[CacheTierHooks]):
        self.hooks = list(hooks)
        tiers = [h for h in self.hooks if h.is_tier]
        if len(tiers) > 1:
            raise ValueError("at most one cache tier per block manager")
        self.tier = tiers[0] if tiers else CacheTierHooks()
        self.is_tier = bool(tiers)

    def bind(self, kv_pool) -> None:
        for h in self.hooks:
            h.bind(kv_pool)

    def on_stored(self, page_hash, parent_hash, page_id) -> bool:
        copy = False
        for h in self.hooks:
            copy = h.on_stored(page_hash, parent_hash, page_id) or copy
        return copy

    def on_hit(self, page_hash, page_id) -> bool:
        copy = False
        for h in self.hooks:
            copy = h.on_hit(page_hash, page_id) or copy
        return copy

    def on_removed(self, page_hash, page_id, *, clean) -> None:
        for h in self.hooks:
            h.on_removed(page_hash, page_id, clean=clean)

    def wants_write_back(self, page_hash) -> bool:
        return self.tier.wants_write_back(page_hash)

    def write_back(self, page_hash, parent_hash, token_ids, page_id) -> bool:
        return self.tier.write_back(page_hash, parent_hash, token_ids, page_id)

    def write_back_sync(self, page_hash, parent_hash, token_ids, page_id) -> None:
        self.tier.write_back_sync(page_hash, parent_hash, token_ids, page_id)

    def poll_written(self):
        return self.tier.poll_written()

    def wait_written(self, timeout):
        return self.tier.wait_written(timeout)

    def lookup(self, page_hashes) -> int:
        return self.tier.lookup(page_hashes)

    def find_tail(self, tail_hashes):
        return self.tier.find_tail(tail_hashes)

    def load_back(self, page_hashes, token_ids, page_ids) -> int:
        return self.tier.load_back(page_hashes, token_ids, page_ids)

    def start_load(self, page_hashes, token_ids, page_ids):
        return self.tier.start_load(page_hashes, token_ids, page_ids)

    def poll_loaded(self):
        return self.tier.poll_loaded()

    def wait_loaded(self, timeout):
        return self.tier.wait_loaded(timeout)


def combine(hooks: CacheTierHooks | Sequence[CacheTierHooks] | None) -> CacheTierHooks:
    if hooks is None:
        return CacheTierHooks()
    if isinstance(hooks, CacheTierHooks):
        return hooks
    return TierHooksList(hooks)
