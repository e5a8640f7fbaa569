"""The tier client's lookup mirror: which slot of the arena holds which page, as far as this engine knows.

Filled by this engine's own commits (write-back) and by lookups: :meth:`LookupMirror.prefetch`,
which the worker awaits before it queues a request (the kv_store promotes L3 hits into L2 then),
and the link's answers that need no round trip (an in-process store). Every entry is checked
against the slot's header in the arena before it counts (:meth:`LookupMirror.holds`), so a stale
entry is only a miss; a load that fails verification forgets its page.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_store.arena import Arena


class LookupMirror:
    """Page hash -> slot in :attr:`arena` (the arena the client maps now)."""

    def __init__(self, link):
        self.link = link
        self.arena: Arena | None = None
        self.slots: dict[int, int] = {}

    def reset(self, arena: Arena) -> None:
        """The client switched to ``arena``: nothing known of it yet."""
        self.slots, self.arena = {}, arena

    # ---- the map ---------------------------------------------------------------------

    def __getitem__(self, page_hash: int) -> int:
        return self.slots[page_hash]

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, page_hash: int) -> int | None:
        return self.slots.get(page_hash)

    def note(self, arena: Arena, page_hash: int, slot: int) -> None:
        """``slot`` of ``arena`` now holds ``page_hash`` (a write-back landed); ignored for an old arena."""
        if arena is self.arena:
            self.slots[page_hash] = slot

    def remember(self, arena_name: str, hashes: Sequence[int], slots: Sequence[int]) -> None:
        """Record where L2 holds pages (a lookup's answer about ``arena_name``)."""
        if self.arena is not None and self.arena.name == arena_name:
            self.slots.update(zip(hashes, slots))

    def forget(self, page_hash: int) -> None:
        self.slots.pop(page_hash, None)

    def holds(self, page_hash: int) -> bool:
        """The slot recorded for ``page_hash`` still carries it (checked in the arena's header)."""
        slot = self.slots.get(page_hash)
        return slot is not None and self.arena.slot_hash(slot) == page_hash

    def num_leading(self, page_hashes: Sequence[int], start: int = 0) -> int:
        """How many of ``page_hashes``, from ``start`` on, L2 holds in a row; ``start`` plus that."""
        n = start
        while n < len(page_hashes) and self.holds(page_hashes[n]):
            n += 1
        return n

    def leading_slots(self, page_hashes: Sequence[int]) -> list[int]:
        """Slots of the leading pages the map names (verified when read, by the copy)."""
        slots = []
        for h in page_hashes:
            slot = self.slots.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    # ---- lookups (the arena must be set) -------------------------------------------------

    def lookup(self, page_hashes: Sequence[int]) -> int:
        """How many leading pages L2 holds: from the map, then what the link answers without a round trip."""
        n = self.num_leading(page_hashes)
        if n < len(page_hashes):
            arena_name, hashes, slots = self.link.lookup_now(page_hashes[n:])
            if hashes:
                self.remember(arena_name, hashes, slots)
                n = self.num_leading(page_hashes, n)
        return n

    def find_first(self, tail_hashes: Sequence[int]) -> int | None:
        """Index of the first of ``tail_hashes`` (one page's tails, longest first) L2 holds, or None."""
        for i, h in enumerate(tail_hashes):
            if self.holds(h):
                return i
        arena_name, found = self.link.find_first_now(tail_hashes)  # over the bus: nothing; prefetched above
        if found is None:
            return None
        self.remember(arena_name, [found[0]], [found[1]])
        return list(tail_hashes).index(found[0]) if self.holds(found[0]) else None

    async def prefetch(self, page_hashes: Sequence[int]) -> int:
        """Ask the store which leading pages it holds after those the map knows; how many L2 holds."""
        known = self.num_leading(page_hashes)
        if known == len(page_hashes):
            return known
        arena_name, hashes, slots = await self.link.lookup_async(page_hashes[known:])
        self.remember(arena_name, hashes, slots)
        return known + len(hashes)

    async def prefetch_tail(self, tail_hashes: Sequence[int]) -> bool:
        """Whether L2 holds one of a page's tails, learnt now so that :meth:`find_first` needs no round trip."""
        if any(self.holds(h) for h in tail_hashes):
            return True
        arena_name, found = await self.link.find_first_async(tail_hashes)
        if found is None:
            return False
        self.remember(arena_name, [found[0]], [found[1]])
        return self.holds(found[0])
