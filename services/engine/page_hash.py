"""Chained page hashes: the name of a full KV page on every tier.

``h_i = H(h_{i-1} || token_ids of page i)`` where ``H`` is BLAKE2b with an
8-byte digest and ``h_{-1}`` is derived from a fixed seed and a salt (model,
tenant, adapter...). Token ids are packed as little-endian uint32, so the
result is identical across processes, machines and Python versions (no
``hash()`` randomisation). The engine's prefix cache, the router's index, the
KV store and the KV events all use these values, so the function must never
change without a new seed.

Only full pages are named by the chain. The one exception is a *tail*: the
computed part of a finished sequence's last, partial page (its KV no longer
changes). :func:`hash_tail` names it from its parent and its 1 to page_size - 1
tokens, in its own domain (a BLAKE2b personalization), so a tail never matches a
full page and is never a parent.
This module imports nothing heavy; the router and kv_store import it directly.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

SEED = b"kvbus-page-hash-v1"
DIGEST_SIZE = 8
SCHEME = SEED.decode()
"""What workers advertise in heartbeats (``hash_scheme``): a router hashes prompts as they do only
when this matches its own."""


def root_hash(salt: str | bytes = b"") -> int:
    """``h_{-1}``: the parent of a sequence's first page, for this salt."""
    if isinstance(salt, str):
        salt = salt.encode()
    digest = hashlib.blake2b(SEED + b"\x00" + salt, digest_size=DIGEST_SIZE).digest()
    return int.from_bytes(digest, "little")


def _digest(parent: int, token_ids: Sequence[int], person: bytes = b"") -> int:
    payload = parent.to_bytes(DIGEST_SIZE, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=DIGEST_SIZE, person=person).digest(), "little")


def hash_page(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one page given its parent's hash and its token ids."""
    return _digest(parent, token_ids)


TAIL_PERSON = b"kvbus-tail-v1"


def hash_tail(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of a tail: the first ``len(token_ids)`` tokens of the page after ``parent``."""
    return _digest(parent, token_ids, TAIL_PERSON)


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    salt: str | bytes = b"",
    *,
    parent: int | None = None,
    start_page: int = 0,
) -> list[int]:
    """Hashes of every full page of ``token_ids``, from page ``start_page`` on.

    ``parent`` is the hash of page ``start_page - 1`` when resuming a chain
    (``None`` means the chain's root for ``salt``).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if parent is None and start_page:
        raise ValueError("resuming a chain at start_page > 0 needs the parent hash")
    h = root_hash(salt) if parent is None else parent
    out = []
    for start in range(start_page * page_size, len(token_ids) - page_size + 1, page_size):
        h = hash_page(h, token_ids[start : start + page_size])
        out.append(h)
    return out
