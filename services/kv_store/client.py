"""The engine's side of HiCache: a cache tier (``tier_hooks.CacheTierHooks``) over the host's L2 arena.

Data path on one host: pages are copied between the engine's KV pool and the
shared-memory arena (``arena.py``) directly; the kv_store only hands out empty
slots (leases, fetched ahead of need) and records which slot holds which page
(commits). Nothing the engine step calls waits on the bus. The client decides
what moves when, through four collaborators, one job each:

- ``leases.Attachment``: the arena mapped and the empty slots leased in it;
- ``policies``: when a page is copied to L2 (the write policy, by name);
- ``mirror.LookupMirror``: which slot holds which page, verified on every read;
- ``copier``: how a page moves for the pool's device (CPU, or CUDA with a copy stream);

and the link to the store (``links.TierLink``: in process, same host, another host).

- write-back: :meth:`write_back` takes a leased slot and queues the copy; a copy
  thread copies the page into the slot (a plain memcpy, no OpenMP region: see
  ``engine_thread.py``), commits it, and reports the page id back
  (:meth:`poll_written`) so the block manager may reuse the page;
- lookup: the mirror, filled by this engine's own commits and by :meth:`prefetch`,
  which the worker awaits before it queues a request (the kv_store promotes L3
  hits into L2 then); a stale entry is only a miss;
- load-back: copies slots into pool pages under the arena's seqlock, verifying
  hash and tokens; a page that changed meanwhile is recomputed, never served.
  :meth:`start_load` queues the copies to the copy thread (the engine keeps
  stepping; :meth:`poll_loaded` reports them), ahead of the write-backs queued
  there (a request waits for its load; nobody waits for a write-back but the
  page it frees); :meth:`load_back` copies on the caller's thread (short runs).
  Both paths account a load in one place (:meth:`_account_load`, on the engine
  thread): counters, the load-back histogram, the store's LRU.

If the kv_store is gone the engine keeps serving: lookups are misses or hit pages
still mapped, write-back stops for want of leases. The worker attaches again
periodically (:meth:`attach_request`, then :meth:`use_arena`), and a new arena replaces the old.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from services.engine.tier_hooks import CacheTierHooks
from services.kv_store.copier import CpuCopier, make_copier
from services.kv_store.leases import LEASE_BATCH, Attachment
from services.kv_store.mirror import LookupMirror
from services.kv_store.policies import make_write_policy

log = logging.getLogger(__name__)


def layout_key(kv_pool, model: str = "") -> str:
    scales = [float(kv_pool.k_scale), float(kv_pool.v_scale)] if kv_pool.is_fp8 else []
    shape = "x".join(str(d) for d in kv_pool.data.shape[1:])
    return f"{model}-{shape}-{str(kv_pool.dtype).removeprefix('torch.')}" + "".join(f"-s{s:g}" for s in scales)


_LOAD, _WRITE, _STOP = 0, 1, 2
"""The copy thread's job kinds, in the order it takes queued ones (then first queued, first run).
Read when a job is queued (bench/load_back_bench.py swaps them to measure queue order)."""


class HostTierClient(CacheTierHooks):
    is_tier = True

    def __init__(self, link, *, owner: str, model: str = "", write_policy: str = "write_back",
                 selective_hits: int = 2, min_load_pages: int = 1, lease_batch: int = LEASE_BATCH, prefault: bool = True):
        self.link, self.owner, self.model = link, owner, model
        self.policy = make_write_policy(write_policy, selective_hits)
        self.min_load_pages = max(1, min_load_pages)
        self.mirror = LookupMirror(link)
        self.leases = Attachment(link, owner, lease_batch=lease_batch, prefault=prefault, on_switch=self.mirror.reset)
        self.pool = None
        self.copier: CpuCopier | None = None
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()  # (kind, number, job): loads first, then in order
        self._job_numbers = itertools.count()
        self._done: deque[tuple[int, bool]] = deque()
        self._loads_done: deque[tuple] = deque()  # landed loads, for poll_loaded (see _load_job)
        self._next_ticket = 0
        self._landed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.stats = {k: 0 for k in ("written_back", "write_back_bytes", "loaded_back", "load_back_bytes",
                                     "hits", "misses", "dropped", "written_sync", "verify_failed", "load_back_seconds")}
        self.observe_load_back: Callable[[float], None] | None = None
        """Called with each load-back's seconds (the worker's latency histogram), on the engine thread."""
        self.trace_log = None
        """A trace_log.TierTraceLog when the worker traces requests: each page's moves, for its spans."""

    # ---- setup -----------------------------------------------------------------------

    def bind(self, kv_pool) -> None:
        self.pool = kv_pool
        self.page_bytes = kv_pool.data[0].numel() * kv_pool.data.element_size()
        self.layout_key = layout_key(kv_pool, self.model)
        self.copier = make_copier(kv_pool)
        self._thread = threading.Thread(target=self._copy_loop, name="kvbus-kv-copy", daemon=True)
        self._thread.start()
        self.attach_now()

    def attach_request(self) -> dict:
        return dict(owner=self.owner, layout_key=self.layout_key, page_bytes=self.page_bytes,
                    page_size=self.pool.page_size, pool_bytes=self.pool.num_bytes, reset_leases=self.arena is None)

    def attach_now(self) -> None:
        """Attach on this thread if the link can without a round trip (else the worker's loop attaches)."""
        attached = self.link.attach_now(**self.attach_request())
        if attached is not None:
            self.use_arena(*attached)

    def use_arena(self, name: str, layout) -> None:
        """Map arena ``name`` (an attach's answer); a new one replaces the mirror and the leases."""
        self.leases.use(name, layout)

    @property
    def arena(self):
        return self.leases.arena

    @property
    def prefault_thread(self) -> threading.Thread | None:
        return self.leases.prefault_thread

    @property
    def stream(self):
        """The CUDA copy stream (None on a CPU pool)."""
        return self.copier.stream if self.copier is not None else None

    @stream.setter
    def stream(self, stream) -> None:  # bench/cuda_copy_bench.py: None copies on the engine's stream
        self.copier.stream = stream

    @property
    def is_attached(self) -> bool:
        return self.arena is not None and self.pool is not None

    def close(self) -> None:
        self.leases.close()
        self._queue(_STOP, None)  # after the copies queued before it

    def _queue(self, kind: int, job) -> None:
        self._jobs.put((kind, next(self._job_numbers), job))

    def _copy_loop(self) -> None:
        while (job := self._jobs.get()[2]) is not None:
            run, args = job
            run(*args)

    @property
    def num_leased(self) -> int:
        return self.leases.num_leased

    @property
    def num_queued(self) -> int:
        """Copies queued for the copy thread and not yet started (write-backs; a load waits there
        only while the copy before it runs)."""
        return self._jobs.qsize()

    # ---- policy ----------------------------------------------------------------------

    def on_stored(self, page_hash, parent_hash, page_id) -> bool:
        return self.is_attached and self.policy.on_stored(page_hash)

    def on_hit(self, page_hash, page_id) -> bool:
        return self.is_attached and self.policy.on_hit(page_hash)

    def wants_write_back(self, page_hash) -> bool:
        return self.is_attached and self.policy.on_evict(page_hash)

    def on_removed(self, page_hash, page_id, *, clean) -> None:
        self.policy.forget(page_hash)

    # ---- write-back --------------------------------------------------------------------

    def write_back(self, page_hash, parent_hash, token_ids, page_id) -> bool:
        if not self.is_attached:
            return False
        if self.mirror.holds(page_hash):
            self._land(page_id, True)
            return True
        slot = self.leases.take()
        if slot is None:
            return False
        try:
            staged = self.copier.stage_out(page_id)
        except Exception:  # e.g. no pinned memory: the page stays in L1 only, the step goes on
            log.exception("staging page %d for write-back failed", page_id)
            self.leases.give_back(slot)
            return False
        job = (self.arena, slot, page_hash, parent_hash, tuple(token_ids), page_id, staged)
        if self.trace_log is not None:
            self.trace_log.queued(page_hash)
        self._queue(_WRITE, (self._write_job, job))
        return True

    def write_back_sync(self, page_hash, parent_hash, token_ids, page_id) -> None:
        # The pool ran dry before write-back reached this page: copy it now, on the engine
        # thread (a memcpy, no bus), or lose it if no slot is at hand.
        if not self.is_attached or self.mirror.holds(page_hash):
            return
        slot = self.leases.take()
        if slot is None:
            self.stats["dropped"] += 1
            return
        if self.trace_log is not None:
            self.trace_log.queued(page_hash)
        self._copy(self.arena, slot, page_hash, parent_hash, tuple(token_ids), page_id)
        self.stats["written_sync"] += 1

    def _copy(self, arena, slot, page_hash, parent_hash, tokens, page_id, staged=None) -> bool:
        try:
            arena.write(slot, page_hash, tokens, self.copier.page_bytes(page_id, staged))
            self.mirror.note(arena, page_hash, slot)
            self.link.commit(self.owner, arena.name, [(slot, page_hash, parent_hash)])
            self.stats["written_back"] += 1
            self.stats["write_back_bytes"] += self.page_bytes
            if self.trace_log is not None:
                self.trace_log.landed(page_hash, True)
            return True
        except Exception:
            log.exception("write-back of page %d failed", page_id)
            if self.trace_log is not None:
                self.trace_log.landed(page_hash, False)
            return False

    def _write_job(self, arena, slot, page_hash, parent_hash, tokens, page_id, staged) -> None:
        self._land(page_id, self._copy(arena, slot, page_hash, parent_hash, tokens, page_id, staged))

    def _land(self, page_id: int, ok: bool) -> None:
        with self._landed:
            self._done.append((page_id, ok))
            self._landed.notify_all()

    def poll_written(self):
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def wait_written(self, timeout: float):
        with self._landed:
            self._landed.wait_for(lambda: bool(self._done), timeout)
        return self.poll_written()

    # ---- lookup ------------------------------------------------------------------------

    def remember(self, arena_name: str, hashes: Sequence[int], slots: Sequence[int]) -> None:
        """Record where L2 holds pages (a lookup reply)."""
        self.mirror.remember(arena_name, hashes, slots)

    async def prefetch(self, page_hashes: Sequence[int]) -> int:
        """Before a request is queued: ask the kv_store which leading pages it holds (promoting
        L3 hits into L2) so that the engine's lookup finds them. Returns how many."""
        if not self.is_attached or not page_hashes:
            return 0
        return await self.mirror.prefetch(page_hashes)

    async def prefetch_tail(self, tail_hashes: Sequence[int]) -> bool:
        """Before a request is queued: whether L2 holds one of a page's tails (``tail_hashes``,
        longest first), learnt now so that :meth:`find_tail` needs no round trip."""
        if not self.is_attached or not tail_hashes:
            return False
        return await self.mirror.prefetch_tail(tail_hashes)

    def lookup(self, page_hashes) -> int:
        if not self.is_attached:
            return 0
        n = self.mirror.lookup(page_hashes)
        if n < self.min_load_pages:
            self.stats["misses"] += 1
            return 0
        return n

    def find_tail(self, tail_hashes):
        if not self.is_attached:
            return None
        return self.mirror.find_first(tail_hashes)

    # ---- load-back ---------------------------------------------------------------------

    def load_back(self, page_hashes, token_ids, page_ids) -> int:
        t0 = time.perf_counter()
        arena = self.arena
        if arena is None:
            return 0
        n, failed = 0, None
        for h, tokens, page_id in zip(page_hashes, token_ids, page_ids):
            slot = self.mirror.get(h)
            if slot is None:
                break
            if not self.copier.load_now(arena, slot, h, tokens, page_id):
                failed = h
                break
            n += 1
        self._account_load(n, failed, time.perf_counter() - t0, page_hashes)
        return n

    def start_load(self, page_hashes, token_ids, page_ids):
        arena = self.arena
        if arena is None or self.pool is None or self._thread is None or not page_ids:
            return None
        slots = self.mirror.leading_slots(page_hashes[: len(page_ids)])
        if not slots:
            return None
        ready = self.copier.load_ready()
        ticket = self._next_ticket
        self._next_ticket += 1
        self._queue(_LOAD, (self._load_job, (ticket, arena, slots, list(page_hashes[: len(slots)]),
                                             [tuple(t) for t in token_ids[: len(slots)]], list(page_ids), ready)))
        return ticket

    def _load_job(self, ticket, arena, slots, hashes, tokens, page_ids, ready) -> None:
        """On the copy thread: the load's copies; the engine thread accounts it (:meth:`poll_loaded`)."""
        t0 = time.perf_counter()
        try:
            n, failed, landed = self.copier.load(arena, slots, hashes, tokens, page_ids, ready)
        except Exception:
            log.exception("load-back of %d pages failed; recomputing them", len(slots))
            n, failed, landed = 0, None, self.copier.fence()
        with self._landed:
            self._loads_done.append((ticket, n, failed, landed, time.perf_counter() - t0, hashes))
            self._landed.notify_all()

    def poll_loaded(self):
        out = []
        while self._loads_done:
            ticket, n, failed, landed, seconds, hashes = self._loads_done.popleft()
            self.copier.land(landed)  # CUDA: the engine's stream waits for the copy (no host sync)
            self._account_load(n, failed, seconds, hashes)
            out.append((ticket, n))
        return out

    def wait_loaded(self, timeout: float):
        with self._landed:
            self._landed.wait_for(lambda: bool(self._loads_done), timeout)
        return self.poll_loaded()

    def _account_load(self, n: int, failed: int | None, seconds: float, page_hashes: Sequence[int]) -> None:
        """One load-back (synchronous or asynchronous), on the engine thread: ``n`` leading pages of
        ``page_hashes`` loaded, ``failed`` the hash that failed verification (forgotten: recomputed)."""
        if failed is not None:
            self.stats["verify_failed"] += 1
            self.mirror.forget(failed)
        self.stats["hits"] += 1 if n else 0
        self.stats["loaded_back"] += n
        self.stats["load_back_bytes"] += n * self.page_bytes
        self.stats["load_back_seconds"] += seconds
        if self.observe_load_back is not None:
            self.observe_load_back(seconds)
        if self.trace_log is not None and n:
            self.trace_log.loaded(page_hashes[:n], seconds)
        if n:
            self.link.touch(list(page_hashes[:n]))
