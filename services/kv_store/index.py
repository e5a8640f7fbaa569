"""The L2 index: which arena slot holds which page, leases, LRU order and hit counts.

Every slot is in exactly one state::

    free --lease--> leased (an engine fills it) --commit--> stored (indexed, LRU)
      ^                |  release / duplicate commit           |
      +----------------+---------------------------------------+ evict (LRU, oldest first)

No memory here: the arena holds the bytes; this is bookkeeping only, so it is
easy to test and to count (``free + leased + stored == num_slots`` always).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass
class StoredPage:
    slot: int
    parent_hash: int
    hits: int = 0


class SlotIndex:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the L2 arena needs at least one slot")
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.leases: dict[str, set[int]] = {}
        self.stored: OrderedDict[int, StoredPage] = OrderedDict()  # page hash -> page, LRU first
        self.slot_to_hash: dict[int, int] = {}

    # ---- counts ----------------------------------------------------------

    @property
    def num_leased(self) -> int:
        return sum(len(s) for s in self.leases.values())

    @property
    def num_stored(self) -> int:
        return len(self.stored)

    def check(self) -> None:
        """Raise if a slot is lost or counted twice (tests and debugging)."""
        leased = [s for slots in self.leases.values() for s in slots]
        every = list(self.free) + leased + [p.slot for p in self.stored.values()]
        if sorted(every) != list(range(self.num_slots)):
            raise AssertionError(f"slot accounting broken: {len(self.free)} free, {len(leased)} leased, "
                                 f"{len(self.stored)} stored of {self.num_slots}")

    # ---- leases ----------------------------------------------------------

    def take_free(self) -> int | None:
        return self.free.popleft() if self.free else None

    def lease(self, owner: str, slot: int) -> None:
        self.leases.setdefault(owner, set()).add(slot)

    def release(self, owner: str, slots) -> list[int]:
        """Give leased slots back unused; returns those that were really leased by ``owner``."""
        held = self.leases.get(owner, set())
        back = [s for s in slots if s in held]
        for s in back:
            held.discard(s)
            self.free.append(s)
        return back

    def release_owner(self, owner: str) -> int:
        held = self.leases.pop(owner, set())
        self.free.extend(held)
        return len(held)

    # ---- pages -----------------------------------------------------------

    def commit(self, owner: str, slot: int, page_hash: int, parent_hash: int) -> bool:
        """A leased slot now holds ``page_hash``; False (slot freed) if the page was stored already."""
        held = self.leases.get(owner)
        if held is None or slot not in held:
            return False
        held.discard(slot)
        if page_hash in self.stored:
            self.free.append(slot)
            return False
        self.stored[page_hash] = StoredPage(slot, parent_hash)
        self.slot_to_hash[slot] = page_hash
        return True

    def store_into(self, slot: int, page_hash: int, parent_hash: int, hits: int = 0) -> None:
        """Index a slot the kv_store filled itself (a page promoted from disk)."""
        self.stored[page_hash] = StoredPage(slot, parent_hash, hits)
        self.slot_to_hash[slot] = page_hash

    def get(self, page_hash: int) -> StoredPage | None:
        return self.stored.get(page_hash)

    def touch(self, page_hash: int, hits: int = 1) -> StoredPage | None:
        page = self.stored.get(page_hash)
        if page is not None:
            page.hits += hits
            self.stored.move_to_end(page_hash)
        return page

    def pop_lru(self) -> tuple[int, StoredPage] | None:
        """Evict the least recently used page; its slot is the caller's to reuse."""
        if not self.stored:
            return None
        page_hash, page = self.stored.popitem(last=False)
        del self.slot_to_hash[page.slot]
        return page_hash, page
