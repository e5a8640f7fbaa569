"""L3: content-addressed page files in a directory, each with a checksum.

One file per page, ``<dir>/<layout key>/<page hash as 16 hex digits>.kvp``:
a fixed header (magic, page hash, parent hash, token count, payload size,
CRC-32 of tokens and payload), the token ids, the page bytes. The layout key
(model, dtype, page shape, fp8 scales) keeps incompatible pages apart. Files
are written to a temporary name and renamed, so a crash never leaves a
half-written page under a real name. On start the directory is re-indexed
(names and sizes only; checksums are verified on every read), so hits survive
a restart. A page whose checksum fails is deleted, counted and reported as a
miss: it is recomputed, never served. LRU by last use, bounded by ``max_pages``.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"KVBPAGE1"
_HEADER = struct.Struct("<8sQQIII")  # magic, hash, parent, num_tokens, payload bytes, crc32


class DiskTier:
    def __init__(self, root: str | os.PathLike, layout_key: str, page_bytes: int, max_pages: int):
        self.dir = Path(root) / layout_key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_bytes, self.max_pages = page_bytes, max_pages
        self.pages: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.num_corrupted = 0
        self.num_written = 0
        self.num_evicted = 0
        self._reindex()

    def _path(self, page_hash: int) -> Path:
        return self.dir / f"{page_hash:016x}.kvp"

    def _reindex(self) -> None:
        for path in self.dir.glob("*.tmp"):  # a write a crash interrupted
            path.unlink(missing_ok=True)
        found = []
        for path in self.dir.glob("*.kvp"):
            try:
                found.append((path.stat().st_mtime, int(path.stem, 16)))
            except (ValueError, OSError):
                continue
        for _, page_hash in sorted(found):  # sizes and checksums are checked at every read
            self.pages[page_hash] = None
        if found:
            log.info("L3 %s: re-indexed %d pages", self.dir, len(found))

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def write(self, page_hash: int, parent_hash: int, token_ids: list[int], data: np.ndarray) -> None:
        if page_hash in self.pages:
            self.pages.move_to_end(page_hash)
            return
        tokens = np.asarray(token_ids, dtype=np.uint32).tobytes()
        payload = data.reshape(-1).view(np.uint8).tobytes()
        crc = zlib.crc32(payload, zlib.crc32(tokens))
        header = _HEADER.pack(MAGIC, page_hash, parent_hash, len(token_ids), len(payload), crc)
        path = self._path(page_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header + tokens + payload)
        os.replace(tmp, path)
        self.pages[page_hash] = None
        self.num_written += 1
        while len(self.pages) > self.max_pages:
            old, _ = self.pages.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
            self.num_evicted += 1

    def read(self, page_hash: int) -> tuple[int, list[int], bytes] | None:
        """``(parent hash, token ids, page bytes)``, or None if absent or corrupted (then dropped)."""
        if page_hash not in self.pages:
            return None
        path = self._path(page_hash)
        try:
            blob = path.read_bytes()
        except OSError:
            self.pages.pop(page_hash, None)
            return None
        why = None
        if len(blob) < _HEADER.size:
            why = "truncated header"
        else:
            magic, h, parent, num_tokens, num_bytes, crc = _HEADER.unpack_from(blob)
            body = blob[_HEADER.size :]
            if magic != MAGIC or h != page_hash:
                why = "bad magic or hash"
            elif num_bytes != self.page_bytes or len(body) != 4 * num_tokens + num_bytes:
                why = f"size {len(body)} B does not match its header"
            elif zlib.crc32(body[4 * num_tokens :], zlib.crc32(body[: 4 * num_tokens])) != crc:
                why = "checksum mismatch"
        if why is not None:
            self.num_corrupted += 1
            log.warning("L3 page %016x dropped: %s (%s)", page_hash, why, path)
            self.pages.pop(page_hash, None)
            path.unlink(missing_ok=True)
            return None
        self.pages.move_to_end(page_hash)
        tokens = np.frombuffer(body[: 4 * num_tokens], dtype=np.uint32).tolist()
        return parent, tokens, body[4 * num_tokens :]
