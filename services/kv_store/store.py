"""The kv_store's state without the bus: arena, L2 index, L3 and KV events.

Thread-safe (one lock), so tests and an in-process engine can call it
directly; the actor (``actor.py``) puts it on the bus. The arena is created
by the first engine that attaches (its page layout and pool size decide the
slot size and, with ``hicache_ratio`` x ``hicache_engines``, the slot count); later engines must
have the same layout (model, KV dtype, page shape, fp8 scales) or they are
refused and run without L2.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from bus.errors import InvalidArgument
from services.config import ConfigError
from services.kv_store.arena import Arena, ArenaLayout, prefault_in_background
from services.kv_store.config import KVStoreConfig
from services.kv_store.disk import DiskTier
from services.kv_store.index import SlotIndex
from services.kv_store.policies import admit_to_l3

log = logging.getLogger(__name__)

GB = 1024**3

EventSink = Callable[[str, str, list[int], list[int]], None]
"""(kind "stored"/"removed", tier "host"/"disk", page hashes, parent hashes)."""


def available_memory_bytes() -> int:
    """MemAvailable, and no more than what /dev/shm still has room for."""
    from services.engine.kv_pool import free_memory_bytes
    import torch

    avail = free_memory_bytes(torch.device("cpu"))
    try:
        st = os.statvfs("/dev/shm")
        avail = min(avail, st.f_bavail * st.f_frsize)
    except OSError:
        pass
    return avail


def check_size(num_bytes: int, reserve_gb: float) -> None:
    avail = available_memory_bytes()
    if num_bytes > avail - reserve_gb * GB:
        raise ConfigError(
            f"kv_store: an L2 of {num_bytes / GB:.2f} GB does not fit: {avail / GB:.2f} GB available "
            f"(RAM and /dev/shm) minus a {reserve_gb:g} GB reserve; lower --hicache-size or --hicache-ratio")


class StoreCore:
    def __init__(self, config: KVStoreConfig, *, on_event: EventSink | None = None):
        self.config = config
        self.on_event = on_event or (lambda *a: None)
        self.lock = threading.RLock()
        self.arena: Arena | None = None
        self.index: SlotIndex | None = None
        self.disk: DiskTier | None = None
        self.layout_key: str | None = None
        self.sizing_pool_bytes = 0
        """The KV pool of the engine that sized the arena (0: none attached yet)."""
        self.counters = {k: 0 for k in ("hits_host", "hits_disk", "misses", "committed", "duplicates",
                                        "evicted_host", "spilled_disk", "corrupted_disk", "bytes_in_disk",
                                        "remote_in", "remote_out")}
        self._closing = threading.Event()
        self.prefault_thread: threading.Thread | None = None
        if config.hicache_size is not None:
            check_size(int(config.hicache_size * GB), config.memory_reserve)

    # ---- engines ---------------------------------------------------------

    def attach(self, owner: str, layout_key: str, page_bytes: int, page_size: int, pool_bytes: int,
               reset_leases: bool = True) -> Arena:
        """Map an engine in; creates the arena for the first one. ``reset_leases``: the owner starts
        afresh, so slots it leased before (and may never commit) go back to the free list."""
        with self.lock:
            if self.arena is None:
                self._create(layout_key, page_bytes, page_size, pool_bytes)
            elif layout_key != self.layout_key or page_bytes != self.arena.layout.page_bytes:
                raise InvalidArgument(f"kv_store holds pages of layout {self.layout_key!r}; "
                                      f"engine {owner} has {layout_key!r}")
            elif self.config.hicache_size is None and pool_bytes > self.sizing_pool_bytes:
                # The arena was sized by the first engine; it cannot grow under engines mapping it.
                log.warning("kv_store: engine %s has a larger KV pool (%.2f GB) than the engine that sized L2; "
                            "L2 is %.2f GB, not %g x its pool per engine. Give the kv_store --hicache-size GB "
                            "to size it for the largest engine.", owner, pool_bytes / GB,
                            self.arena.layout.total_bytes / GB, self.config.hicache_ratio)
            if reset_leases:
                self.index.release_owner(owner)
            return self.arena

    def _create(self, layout_key: str, page_bytes: int, page_size: int, pool_bytes: int) -> None:
        cfg = self.config
        if page_bytes <= 0 or page_size <= 0:
            raise InvalidArgument("page_bytes and page_size must be > 0")
        size = int(cfg.hicache_size * GB) if cfg.hicache_size is not None else self._ratio_size(pool_bytes, page_bytes)
        layout = ArenaLayout(max(1, size // page_bytes), page_bytes, page_size)
        check_size(layout.total_bytes, cfg.memory_reserve)
        self.arena = Arena.create(layout, tag=str(os.getpid()))
        self.sizing_pool_bytes = pool_bytes
        self.index = SlotIndex(layout.num_slots)
        self.layout_key = layout_key
        if cfg.hicache_storage_dir:
            safe_key = "".join(c if c.isalnum() or c in "-_" else "_" for c in layout_key)
            self.disk = DiskTier(cfg.hicache_storage_dir, safe_key, page_bytes,
                                 max(1, int(cfg.hicache_storage_size * GB // page_bytes)))
        log.info("kv_store: L2 arena %s, %d slots x %d B (%.2f GB)%s", self.arena.name, layout.num_slots,
                 page_bytes, layout.total_bytes / GB, f", L3 {self.disk.dir} ({len(self.disk)} pages)" if self.disk else "")
        if cfg.hicache_prefault:  # commit its memory (engines use the arena meanwhile)
            self.prefault_thread = prefault_in_background(self.arena, self._closing, "kv_store: committing L2's memory")

    def _ratio_size(self, pool_bytes: int, page_bytes: int) -> int:
        """``hicache_ratio`` pools for each of ``hicache_engines``, but no more than half of the memory
        free now (less the reserve): the engines' own pools may still be on their way. An explicit
        ``hicache_size`` is checked instead, and refused when it does not fit."""
        cfg = self.config
        size = int(cfg.hicache_ratio * pool_bytes * cfg.hicache_engines)
        room = (available_memory_bytes() - int(cfg.memory_reserve * GB)) // 2
        if size > room >= page_bytes:
            log.warning("kv_store: L2 of %g x %d engines' KV pools (%.2f GB) is more than half of the %.2f GB "
                        "free beyond the reserve; L2 is %.2f GB. Give --hicache-size GB to choose its size.",
                        cfg.hicache_ratio, cfg.hicache_engines, size / GB, 2 * room / GB, room / GB)
            size = room
        return size

    def detach(self, owner: str) -> None:
        with self.lock:
            if self.index is not None:
                self.index.release_owner(owner)

    # ---- write-back --------------------------------------------------------

    def lease(self, owner: str, n: int) -> list[int]:
        """Up to ``n`` empty slots for ``owner`` to fill, evicting L2's LRU pages if needed."""
        with self.lock:
            idx = self._need_index()
            # Leases are bounded by a share of the arena, so promotions and other engines find slots.
            cap = min(self.config.max_lease, max(1, int(idx.num_slots * self.config.lease_share)))
            n = max(0, min(n, cap - len(idx.leases.get(owner, ()))))
            out = []
            for _ in range(n):
                slot = idx.take_free()
                if slot is None:
                    slot = self._evict_one()
                    if slot is None:
                        break
                idx.lease(owner, slot)
                out.append(slot)
            return out

    def release(self, owner: str, slots: Sequence[int]) -> None:
        with self.lock:
            if self.index is not None:
                self.index.release(owner, slots)

    def commit(self, owner: str, entries: Sequence[tuple[int, int, int]]) -> list[int]:
        """``(slot, page hash, parent hash)`` filled by ``owner``; returns the hashes newly stored."""
        stored, parents = [], []
        with self.lock:
            if self.arena is None:  # closed (a staging arena at shutdown): nothing to commit into
                return []
            idx = self._need_index()
            for slot, page_hash, parent in entries:
                if not 0 <= slot < idx.num_slots:
                    continue
                if self.arena.slot_hash(slot) != page_hash:  # not (or no longer) what was written
                    idx.release(owner, [slot])
                    continue
                if idx.commit(owner, slot, page_hash, parent):
                    stored.append(page_hash)
                    parents.append(parent)
                else:
                    self.counters["duplicates"] += 1
                    if idx.slot_to_hash.get(slot) is None and slot in idx.free:
                        self.arena.invalidate(slot)
            self.counters["committed"] += len(stored)
        if stored:
            self.on_event("stored", "host", stored, parents)
        return stored

    # ---- load-back ---------------------------------------------------------

    def lookup(self, page_hashes: Sequence[int], *, promote: bool = True) -> list[tuple[int, int]]:
        """``(hash, slot)`` of the leading pages L2 holds, promoting L3 hits into L2 first."""
        out = []
        with self.lock:
            if self.index is None:
                return out
            for h in page_hashes:
                page = self.index.touch(h)
                if page is None and promote and self.disk is not None and h in self.disk:
                    page = self._promote(h, protect={x for x, _ in out})
                    if page is not None:
                        self.counters["hits_disk"] += 1
                elif page is not None:
                    self.counters["hits_host"] += 1
                if page is None:
                    self.counters["misses"] += 1
                    break
                out.append((h, page.slot))
        return out

    def find_first(self, page_hashes: Sequence[int]) -> tuple[int, int] | None:
        """``(hash, slot)`` of the first of ``page_hashes`` L2 holds (promoting an L3 hit), or None:
        the tails of one page, longest first (``page_hash.hash_tail``). One hit or one miss."""
        with self.lock:
            if self.index is None:
                return None
            for h in page_hashes:
                page = self.index.touch(h)
                if page is None and self.disk is not None and h in self.disk:
                    page = self._promote(h, protect=set())
                    if page is not None:
                        self.counters["hits_disk"] += 1
                        return h, page.slot
                elif page is not None:
                    self.counters["hits_host"] += 1
                    return h, page.slot
            self.counters["misses"] += 1
            return None

    def touch(self, page_hashes: Sequence[int]) -> None:
        """Engines report L2 hits they served (LRU order and the L3 admission filter)."""
        with self.lock:
            if self.index is not None:
                for h in page_hashes:
                    self.index.touch(h)

    def _promote(self, page_hash: int, protect: set[int]):
        got = self.disk.read(page_hash)
        if got is None:
            self.counters["corrupted_disk"] = self.disk.num_corrupted
            return None
        parent, tokens, payload = got
        # L2 too small for this chain: stop rather than evict a page of the same lookup.
        return self.put(page_hash, parent, tokens, np.frombuffer(payload, dtype=np.uint8), hits=1, protect=protect)

    def put(self, page_hash: int, parent_hash: int, token_ids: Sequence[int], data: np.ndarray, *,
            hits: int = 0, protect: set[int] | frozenset = frozenset()):
        """Store a page given by value (an L3 promotion, a write-back from an engine on another host)
        in a free slot, evicting L2's LRU page if needed (never one in ``protect``). Returns the
        stored page (the one already held for a duplicate), or None when no slot is to be had."""
        with self.lock:
            idx = self._need_index()
            held = idx.get(page_hash)
            if held is not None:
                self.counters["duplicates"] += 1
                return held
            slot = idx.take_free()
            if slot is None:
                if protect and next(iter(idx.stored), None) in protect:
                    return None
                slot = self._evict_one()
                if slot is None:
                    return None
            self.arena.write(slot, page_hash, token_ids, data)
            idx.store_into(slot, page_hash, parent_hash, hits=hits)
            self.on_event("stored", "host", [page_hash], [parent_hash])
            return idx.get(page_hash)

    def read_stored(self, page_hashes: Sequence[int]) -> tuple[list[int], list[int], list[list[int]], np.ndarray]:
        """The pages of ``page_hashes`` that L2 holds, by value, each read verified (seqlock, hash);
        the others are left out: ``(hashes, parent hashes, token ids, [n, page_bytes] uint8)``."""
        with self.lock:
            if self.index is None:
                return [], [], [], np.empty((0, 0), dtype=np.uint8)
            kept, parents, tokens = [], [], []
            out = np.empty((len(page_hashes), self.arena.layout.page_bytes), dtype=np.uint8)
            for h in page_hashes:
                page = self.index.get(h)
                if page is None:
                    continue
                got_hash, toks = self.arena.read_header(page.slot)
                if got_hash != h or not self.arena.read_into(page.slot, h, toks, out[len(kept)]):
                    continue
                kept.append(h)
                parents.append(page.parent_hash)
                tokens.append(toks)
            return kept, parents, tokens, out[: len(kept)]

    def read_pages(self, page_hashes: Sequence[int], max_pages: int) -> tuple[list[int], list[list[int]], np.ndarray]:
        """The leading pages of ``page_hashes`` that L2 holds (L3 hits promoted first), by value:
        ``(parent hashes, token ids, [n, page_bytes] uint8)``, each read verified (seqlock, hash)."""
        with self.lock:
            found = [h for h, _ in self.lookup(list(page_hashes[:max_pages]))]
            kept, parents, tokens, data = self.read_stored(found)
        n = 0  # the leading run: up to the first page that did not read back
        while n < len(kept) and kept[n] == found[n]:
            n += 1
        return parents[:n], tokens[:n], data[:n]

    # ---- eviction ----------------------------------------------------------

    def _evict_one(self) -> int | None:
        popped = self.index.pop_lru()
        if popped is None:
            return None
        page_hash, page = popped
        if self.disk is not None and admit_to_l3(page.hits, self.config.hicache_l3_admit_hits):
            h, tokens = self.arena.read_header(page.slot)
            if h == page_hash:
                try:
                    self.disk.write(page_hash, page.parent_hash, tokens, self.arena.slot_data(page.slot))
                    self.counters["spilled_disk"] += 1
                    self.counters["bytes_in_disk"] += self.arena.layout.page_bytes
                    self.on_event("stored", "disk", [page_hash], [page.parent_hash])
                except OSError:
                    log.exception("L3 write of page %016x failed", page_hash)
        self.arena.invalidate(page.slot)
        self.counters["evicted_host"] += 1
        self.on_event("removed", "host", [page_hash], [page.parent_hash])
        return page.slot

    def _need_index(self) -> SlotIndex:
        if self.index is None:
            raise InvalidArgument("no engine attached yet: attach first")
        return self.index

    # ---- introspection -------------------------------------------------------

    def stored_pages(self) -> list[tuple[int, int]]:
        """``(hash, parent)`` of every L2 page, LRU first (the KV-event dump)."""
        with self.lock:
            return [] if self.index is None else [(h, p.parent_hash) for h, p in self.index.stored.items()]

    def close(self) -> None:
        self._closing.set()
        with self.lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
