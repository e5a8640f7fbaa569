"""Recent HiCache page moves by page hash, for traces: when each was loaded back, queued for
write-back, and landed in L2.

Kept only by a worker that traces requests (``HostTierClient.trace_log``); the engine thread and the
copy thread write it, the worker's event loop reads it once a traced request finished and turns the
moves of that request's pages into its ``hicache.load_back`` and ``hicache.write_back`` spans
(services/workers/trace_spans.py). Bounded: the oldest pages are forgotten first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

MAX_PAGES = 16384


class TierTraceLog:
    def __init__(self, max_pages: int = MAX_PAGES):
        self.max_pages = max_pages
        self._lock = threading.Lock()
        self._loads: OrderedDict[int, tuple[float, float]] = OrderedDict()
        """page hash -> (start, end) of the load-back that filled it (time.monotonic())."""
        self._writes: OrderedDict[int, list] = OrderedDict()
        """page hash -> [queued, landed or None, ok]."""

    def loaded(self, page_hashes: Iterable[int], seconds: float) -> None:
        """Pages just loaded back (accounted now, copied over the last ``seconds``)."""
        end = time.monotonic()
        with self._lock:
            for h in page_hashes:
                self._put(self._loads, h, (end - seconds, end))

    def queued(self, page_hash: int) -> None:
        with self._lock:
            self._put(self._writes, page_hash, [time.monotonic(), None, False])

    def landed(self, page_hash: int, ok: bool) -> None:
        with self._lock:
            entry = self._writes.get(page_hash)
            if entry is not None:
                entry[1], entry[2] = time.monotonic(), ok

    def _put(self, table: OrderedDict, key: int, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.max_pages:
            table.popitem(last=False)

    def loads_of(self, page_hashes: Sequence[int], since: float) -> list[tuple[float, float]]:
        """(start, end) of each of ``page_hashes`` loaded back at or after ``since``."""
        with self._lock:
            return [t for h in page_hashes if (t := self._loads.get(h)) is not None and t[1] >= since]

    def writes_of(self, page_hashes: Sequence[int], since: float) -> list[tuple[float, float | None, bool]]:
        """(queued, landed or None, ok) of each of ``page_hashes`` queued for write-back at or after ``since``."""
        with self._lock:
            return [tuple(w) for h in page_hashes if (w := self._writes.get(h)) is not None and w[0] >= since]
