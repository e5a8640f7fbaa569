"""The L2 arena: one POSIX shared-memory segment of page slots, per host.

The kv_store creates it (mode 0600: only processes of the same user map it);
engines on the host map it too, so a page never crosses the bus on one host.

Layout: ``num_slots`` headers, then ``num_slots`` data slots of ``page_bytes``
each (4 KiB aligned). A header is ``[version u64, page_hash u64, num_tokens
u64, token ids u32 x page_size]``.

Concurrency is a seqlock per slot, so a reader needs no round trip to pin a
slot. Exactly one process writes a slot at a time: the engine that leased it
(filling it), or the kv_store (invalidating it when the slot is evicted, which
it never does to a leased slot). A writer makes ``version`` odd, writes, then
makes it even again. A reader reads ``version`` and ``page_hash``, copies the
data, and keeps the copy only if ``version`` is unchanged, even, and the hash
and tokens are the ones it wanted. A slot evicted and refilled while being
read is therefore detected, and the page is recomputed instead.

Memory: the segment is created empty (tmpfs pages appear on first touch), and
each process maps it on its own. A first touch costs a page fault per 4 KiB,
which dwarfs the copy (a page of the default model on the dev VM: 0.83-1.05 ms
to write never-touched memory, 0.48 ms memory another process committed, 0.08
ms once committed and mapped here), so the kv_store commits it up front and
every engine maps it ahead, in the background (:func:`prefault_in_background`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

try:
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "kvbus-kvstore-"
_ALIGN = 4096
_FIXED_WORDS = 3  # version, hash, num_tokens (u64 each)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14 (Python < 3.13 lacks the name)
PREFAULT_CHUNK = 64 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ArenaLayout:
    num_slots: int
    page_bytes: int
    page_size: int

    @property
    def header_bytes(self) -> int:
        return _round_up(8 * _FIXED_WORDS + 4 * self.page_size, 64)

    @property
    def data_offset(self) -> int:
        return _round_up(self.num_slots * self.header_bytes, _ALIGN)

    @property
    def slot_stride(self) -> int:
        return _round_up(self.page_bytes, 64)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_stride


def prefault_in_background(arena: "Arena", stop: threading.Event, what: str) -> threading.Thread:
    """Start a daemon thread that runs ``arena.prefault(stop)`` at the least CPU priority (nice 19;
    on Linux a thread id names that thread alone), so it takes only the time the engines' forward
    passes leave idle, and logs what it did as ``what`` (its start and its end, or why it could not)."""

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.monotonic()
        log.info("%s: %.2f GB, in the background", what, arena.layout.total_bytes / 2**30)
        try:
            done = arena.prefault(stop)
        except (OSError, ValueError) as e:  # an old kernel (< 5.14); or the mapping closed under the call
            log.warning("%s: not done ahead (%s); pages fault in at their first touch", what, e)
            return
        log.info("%s: %.2f GB done in %.1f s", what, done / 2**30, time.monotonic() - t0)

    thread = threading.Thread(target=run, name="kvbus-l2-prefault", daemon=True)
    thread.start()
    return thread


class Arena:
    """A mapping of the arena segment (the creator owns and unlinks it)."""

    def __init__(self, name: str, layout: ArenaLayout, mapping: mmap.mmap, *, owner: bool):
        self.name, self.layout, self._mapping, self.owner = name, layout, mapping, owner
        self._map_lock = threading.Lock()  # close() against a prefault chunk in flight
        buf = memoryview(mapping)
        hb = layout.header_bytes
        headers = np.frombuffer(buf, dtype=np.uint8, count=layout.num_slots * hb)
        self._headers = headers.reshape(layout.num_slots, hb)
        self._words = self._headers[:, : 8 * _FIXED_WORDS].view(np.uint64)  # [slots, 3]
        self._tokens = self._headers[:, 8 * _FIXED_WORDS : 8 * _FIXED_WORDS + 4 * layout.page_size].view(np.uint32)
        data = np.frombuffer(buf, dtype=np.uint8, count=layout.num_slots * layout.slot_stride,
                             offset=layout.data_offset)
        self._data = data.reshape(layout.num_slots, layout.slot_stride)[:, : layout.page_bytes]

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    def create(cls, layout: ArenaLayout, tag: str = "") -> "Arena":
        if _posixshmem is None:
            raise OSError("POSIX shared memory is not available on this platform")
        name = f"{SEGMENT_PREFIX}{tag}{'-' if tag else ''}{secrets.token_hex(4)}"
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            mapping = mmap.mmap(fd, layout.total_bytes)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        return cls(name, layout, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, layout: ArenaLayout) -> "Arena":
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise ValueError(f"not a kv_store arena: {name!r}")
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size < layout.total_bytes:
                raise ValueError(f"arena {name} holds {size} B, its layout needs {layout.total_bytes}")
            mapping = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        return cls(name, layout, mapping, owner=False)

    def close(self) -> None:
        """Drop this mapping (numpy views die with it); the owner also unlinks the segment."""
        with self._map_lock:
            self._headers = self._words = self._tokens = self._data = None
            try:
                self._mapping.close()
            except BufferError:  # a view still exported: the OS frees it with the process
                pass
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass

    def prefault(self, stop: threading.Event | None = None, chunk: int = PREFAULT_CHUNK) -> int:
        """Commit the segment's memory now, ``chunk`` bytes a call (``MADV_POPULATE_WRITE``: the
        pages are allocated as a write would, their bytes unchanged, so engines may use the arena
        meanwhile). Returns the bytes done; stops early when ``stop`` is set or the arena closes.
        Raises OSError where the kernel lacks the advice (Linux < 5.14). The store and the engines
        run it through :func:`prefault_in_background`."""
        done, total = 0, self.layout.total_bytes
        while done < total and not (stop is not None and stop.is_set()):
            n = min(chunk, total - done)
            with self._map_lock:
                if self._data is None:  # closed
                    break
                self._mapping.madvise(MADV_POPULATE_WRITE, done, n)
            done += n
        return done

    # ---- slot access -----------------------------------------------------

    def slot_data(self, slot: int) -> np.ndarray:
        """The slot's bytes (a view; write only to a slot you hold)."""
        return self._data[slot]

    def header(self, slot: int) -> tuple[int, int]:
        """``(version, page_hash)`` of a slot now."""
        w = self._words[slot]
        return int(w[0]), int(w[1])

    def slot_hash(self, slot: int) -> int | None:
        version, h = self.header(slot)
        return h if version % 2 == 0 and h else None

    def write(self, slot: int, page_hash: int, token_ids, data: np.ndarray) -> None:
        """Fill a slot this process holds (seqlock writer)."""
        w = self._words[slot]
        w[0] += 1  # odd: being written
        self._data[slot][:] = data.reshape(-1).view(np.uint8)
        self._tokens[slot][: len(token_ids)] = token_ids
        w[2] = len(token_ids)
        w[1] = page_hash
        w[0] += 1

    def invalidate(self, slot: int) -> None:
        """Forget a slot's page (the kv_store, before it reuses the slot)."""
        w = self._words[slot]
        w[0] += 1
        w[1] = 0
        w[2] = 0
        w[0] += 1

    def read_into(self, slot: int, page_hash: int, token_ids, out: np.ndarray) -> bool:
        """Copy the slot into ``out`` if it holds ``page_hash`` with ``token_ids``, consistently."""
        w = self._words[slot]
        v1 = int(w[0])
        if v1 % 2 or int(w[1]) != page_hash or int(w[2]) != len(token_ids):
            return False
        if not np.array_equal(self._tokens[slot][: len(token_ids)], np.asarray(token_ids, dtype=np.uint32)):
            return False
        out.reshape(-1).view(np.uint8)[:] = self._data[slot]
        return int(w[0]) == v1 and int(w[1]) == page_hash

    def read_header(self, slot: int) -> tuple[int, list[int]]:
        """``(page_hash or 0, token ids)`` of a stable slot (the kv_store, when spilling to disk)."""
        w = self._words[slot]
        return int(w[1]), self._tokens[slot][: int(w[2])].tolist()
