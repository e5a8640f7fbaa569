"""The seam between the device page pool (L1) and lower cache tiers.

The block manager calls these hooks; it never knows what sits below it. A
kv_store client implements them later (write-back to host memory, load-back
on a prefix miss). The default does nothing, so L1 behaves as a plain LRU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class CacheTierHooks(Protocol):
    def on_stored(self, page_hash: int, page_id: int) -> None:
        """A full page's KV is now computed and indexed under ``page_hash``.

        For write-through policies and for "stored" KV events.
        """

    def on_evict(self, page_hash: int, page_id: int) -> None:
        """``page_id`` is about to be reused; its content is still intact.

        A write-back tier copies the page out here, synchronously.
        """

    def lookup(self, page_hashes: Sequence[int]) -> int:
        """How many leading hashes of ``page_hashes`` a lower tier holds."""

    def load_back(self, page_hashes: Sequence[int], page_ids: Sequence[int]) -> None:
        """Fill device pages ``page_ids`` with the content of ``page_hashes``.

        Called with a prefix of what :meth:`lookup` promised. Raising makes the
        block manager treat those pages as a miss (they are recomputed).
        """


class NoTierHooks:
    """The default: no lower tier."""

    def on_stored(self, page_hash: int, page_id: int) -> None:
        pass

    def on_evict(self, page_hash: int, page_id: int) -> None:
        pass

    def lookup(self, page_hashes: Sequence[int]) -> int:
        return 0

    def load_back(self, page_hashes: Sequence[int], page_ids: Sequence[int]) -> None:
        pass
