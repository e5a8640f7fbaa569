"""A prompt's pages named as a worker names them (``services/engine/page_hash.py``), hashed lazily.

The router must hash exactly as the workers do: the chain starts at the worker's advertised root
(its cache salt, hashed), pages are ``page_size`` tokens, and only the full pages before the
prompt's last token count (the last token is always computed: its logits are needed). After a
run of ``k`` full pages, the engine may also reuse a *tail*: the first 1 to page_size - 1 tokens of
page ``k``, left by an earlier request (a conversation's previous answer).

Hashing is most of a decision's time, so it is done only as far as a lookup reads (a cold prompt
stops at its first page), and page hashes seen recently are remembered by their exact input bytes
(parent hash + tokens): a conversation's history is hashed once, not once per turn. Same bytes, same
BLAKE2b as ``page_hash``: the results are identical (tested against it).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Iterator, Sequence
from functools import lru_cache

from bus.errors import InvalidArgument
from services.engine.page_hash import DIGEST_SIZE, SCHEME, hash_tail, root_hash

__all__ = ["SCHEME", "PromptPages", "unsalted_root"]

MEMO_PAGES = 200_000
"""Page hashes remembered (two generations of half as many: the least recently used go first)."""
HASH_AHEAD = 8
"""Pages hashed at once when a lookup reads past what is hashed."""
_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


@lru_cache(maxsize=1)
def unsalted_root() -> int:
    return root_hash(b"")


class _Memo:
    """Recently used page digests by their input bytes: a new generation, and the one before it (a
    digest used again moves to the new one; when the new one is full, the old one is dropped)."""

    def __init__(self, limit: int):
        self.half = max(limit // 2, 1)
        self.new: dict[bytes, bytes] = {}
        self.old: dict[bytes, bytes] = {}


_memo = _Memo(MEMO_PAGES)


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, as ``page_hash`` packs them."""
    try:
        if _NATIVE_U32:
            return array.array("I", token_ids).tobytes()
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except (OverflowError, TypeError, struct.error):
        raise InvalidArgument("prompt_token_ids must be integers in [0, 2**32)") from None


class PromptPages:
    """The chained hashes of one prompt's cacheable full pages for one (page size, root), computed
    on demand; iterating yields them in order, hashing as it goes."""

    __slots__ = ("token_ids", "page_size", "root", "num_pages", "computed", "_buf", "_tails")

    def __init__(self, token_ids: Sequence[int], page_size: int, root: int):
        self.token_ids = token_ids
        self.page_size = page_size
        self.root = root
        self.num_pages = max(len(token_ids) - 1, 0) // page_size
        self.computed: list[int] = []
        """The hashes of the first pages, as far as anyone read."""
        self._buf: bytes | None = None
        self._tails: dict[int, list[tuple[int, int]]] = {}

    def extend(self, num: int = HASH_AHEAD) -> bool:
        """Hash up to ``num`` more pages; False when every page is hashed already."""
        k = len(self.computed)
        if k >= self.num_pages:
            return False
        if self._buf is None:
            self._buf = _pack(self.token_ids[: self.num_pages * self.page_size])
        buf, step, computed = self._buf, self.page_size * 4, self.computed
        blake2b, memo, new, old = hashlib.blake2b, _memo, _memo.new, _memo.old
        parent = (computed[-1] if k else self.root).to_bytes(DIGEST_SIZE, "little")
        for i in range(k, min(k + num, self.num_pages)):
            key = parent + buf[i * step:(i + 1) * step]
            digest = new.get(key)
            if digest is None:
                digest = old.get(key) or blake2b(key, digest_size=DIGEST_SIZE).digest()
                new[key] = digest
                if len(new) >= memo.half:
                    memo.old, memo.new = new, {}
                    new, old = memo.new, memo.old
            computed.append(int.from_bytes(digest, "little"))
            parent = digest
        return True

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            computed = self.computed
            while i < len(computed):
                yield computed[i]
                i += 1
            if not self.extend():
                return

    def __len__(self) -> int:
        return self.num_pages

    @property
    def hashes(self) -> list[int]:
        """Every page's hash (hashing the rest)."""
        while self.extend(self.num_pages):
            pass
        return self.computed

    def tails(self, k: int) -> list[tuple[int, int]]:
        """``(num_tokens, hash)`` of the tails that may follow ``k`` full pages, longest first
        (as ``BlockManager.tail_candidates``: the prompt's last token is left out). Pages up to
        ``k`` must be hashed already (a lookup read them)."""
        if k not in self._tails:
            start = k * self.page_size
            longest = min(self.page_size - 1, len(self.token_ids) - 1 - start)
            parent = self.root if k == 0 else self.computed[k - 1] if k <= len(self.computed) else None
            self._tails[k] = [] if parent is None else [
                (m, hash_tail(parent, self.token_ids[start:start + m])) for m in range(longest, 0, -1)]
        return self._tails[k]
