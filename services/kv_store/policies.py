"""Write policies (when a device page is copied to L2) and the L3 admission filter.

One registry, :data:`WRITE_POLICIES` (``--hicache-write-policy`` and its check take
their choices from it); the engine's tier client asks its policy at three moments
of a page's life in L1:

- ``write_back`` (default): when L1 evicts it. Cheapest: only pages that would
  otherwise be lost are copied, and only once.
- ``write_through``: as soon as it is computed. L2 then also holds pages still
  in L1 (another engine can hit them at once), at the cost of copying pages
  that are never reused.
- ``write_through_selective``: once it has been hit ``N`` times in L1 (hot
  prefixes such as system prompts reach L2 early), else at eviction.

Adding one: subclass :class:`WriteBack` (``__init__(hits)``, the three moments and
``forget``), then ``WRITE_POLICIES.register("name", "module:Class", doc=...)``.
"""

from __future__ import annotations

from collections import Counter

from services.plugins import Registry


class WriteBack:
    name = "write_back"

    def __init__(self, hits: int = 1):
        pass

    def on_stored(self, page_hash: int) -> bool:
        return False

    def on_hit(self, page_hash: int) -> bool:
        return False

    def on_evict(self, page_hash: int) -> bool:
        return True

    def forget(self, page_hash: int) -> None:
        pass


class WriteThrough(WriteBack):
    name = "write_through"

    def on_stored(self, page_hash: int) -> bool:
        return True


class WriteThroughSelective(WriteBack):
    name = "write_through_selective"

    def __init__(self, hits: int = 2):
        self.threshold = max(1, hits)
        self.hits: Counter[int] = Counter()

    def on_hit(self, page_hash: int) -> bool:
        self.hits[page_hash] += 1
        return self.hits[page_hash] == self.threshold

    def forget(self, page_hash: int) -> None:
        self.hits.pop(page_hash, None)


WRITE_POLICIES = Registry("write policy", {
    "write_back": "services.kv_store.policies:WriteBack",
    "write_through": "services.kv_store.policies:WriteThrough",
    "write_through_selective": "services.kv_store.policies:WriteThroughSelective",
}, docs={
    "write_back": "on L1 eviction",
    "write_through": "as soon as a page is computed",
    "write_through_selective": "after --hicache-selective-hits L1 hits, else on eviction",
})


def make_write_policy(name: str, hits: int = 2) -> WriteBack:
    """The policy registered as ``name``; an unknown name is a ValueError naming the choices."""
    return WRITE_POLICIES.get(name)(hits)


def admit_to_l3(hits: int, min_hits: int) -> bool:
    """L3 admission filter: only pages hit at least ``min_hits`` times in L2 are worth a disk write."""
    return hits >= min_hits
