"""A prompt's pages named as a worker names them (``services/engine/page_hash.py``), hashed once per decision.

The router must hash exactly as the workers do: the chain starts at the worker's advertised root
(its cache salt, hashed), pages are ``page_size`` tokens, and only the full pages before the
prompt's last token count (the last token is always computed: its logits are needed). After a
run of ``k`` full pages, the engine may also reuse a *tail*: the first 1 to page_size - 1 tokens of
page ``k``, left by an earlier request (a conversation's previous answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from services.engine.page_hash import SCHEME, hash_tail, page_hashes, root_hash

__all__ = ["SCHEME", "PromptPages", "unsalted_root"]


@lru_cache(maxsize=1)
def unsalted_root() -> int:
    return root_hash(b"")


class PromptPages:
    """The hashes of one prompt's cacheable full pages for one (page size, root), and its tails."""

    __slots__ = ("token_ids", "page_size", "hashes", "_parents", "_tails")

    def __init__(self, token_ids: Sequence[int], page_size: int, root: int):
        self.token_ids = token_ids
        self.page_size = page_size
        limit = max(len(token_ids) - 1, 0) // page_size
        self.hashes = page_hashes(token_ids[: limit * page_size], page_size, parent=root)
        self._parents = [root, *self.hashes]  # parent of page k
        self._tails: dict[int, list[tuple[int, int]]] = {}

    def tails(self, k: int) -> list[tuple[int, int]]:
        """``(num_tokens, hash)`` of the tails that may follow ``k`` full pages, longest first
        (as ``BlockManager.tail_candidates``: the prompt's last token is left out)."""
        if k not in self._tails:
            start = k * self.page_size
            longest = min(self.page_size - 1, len(self.token_ids) - 1 - start)
            parent = self._parents[k] if k < len(self._parents) else None
            self._tails[k] = [] if parent is None else [
                (m, hash_tail(parent, self.token_ids[start : start + m])) for m in range(longest, 0, -1)]
        return self._tails[k]
