"""The engine's side of HiCache: a cache tier (``tier_hooks.CacheTierHooks``) over the host's L2 arena.

Data path on one host: pages are copied between the engine's KV pool and the
shared-memory arena (``arena.py``) directly; the kv_store only hands out empty
slots (leases, fetched ahead of need) and records which slot holds which page
(commits). Nothing the engine step calls waits on the bus:

- write-back: :meth:`write_back` takes a leased slot and queues the copy; a copy
  thread copies the page into the slot (a plain memcpy, no OpenMP region: see
  ``engine_thread.py``), commits it, and reports the page id back
  (:meth:`poll_written`) so the block manager may reuse the page;
- lookup: a local map page hash -> slot, filled by this engine's own commits and
  by :meth:`prefetch`, which the worker awaits before it queues a request (the
  kv_store promotes L3 hits into L2 then); every entry is verified against the
  slot's header in the arena, so a stale entry is only a miss;
- load-back: copies slots into pool pages under the arena's seqlock, verifying
  hash and tokens; a page that changed meanwhile is recomputed, never served.
  :meth:`start_load` queues the copies to the copy thread (the engine keeps
  stepping; :meth:`poll_loaded` reports them), ahead of the write-backs queued
  there (a request waits for its load; nobody waits for a write-back but the
  page it frees); :meth:`load_back` copies on the caller's thread (short runs).

On CUDA the copies use a dedicated stream (``self.stream``): write-back enqueues
the device -> pinned host copy there with an event (after the engine's stream,
so the page's KV is complete), the copy thread waits on the event and memcpys
into the slot; load-back verifies into pinned staging on the copy thread, then
copies staging -> device on the copy stream, and :meth:`poll_loaded` makes the
engine's stream wait on that copy's event (no host sync on the engine thread).

If the kv_store is gone the engine keeps serving: lookups are misses or hit pages
still mapped, write-back stops for want of leases. :meth:`reconnect` (the
worker calls it periodically) attaches again and switches to a new arena.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from services.engine.tier_hooks import CacheTierHooks
from services.kv_store.arena import Arena, prefault_in_background
from services.kv_store.policies import make_write_policy

log = logging.getLogger(__name__)


def layout_key(kv_pool, model: str = "") -> str:
    scales = [float(kv_pool.k_scale), float(kv_pool.v_scale)] if kv_pool.is_fp8 else []
    shape = "x".join(str(d) for d in kv_pool.data.shape[1:])
    return f"{model}-{shape}-{str(kv_pool.dtype).removeprefix('torch.')}" + "".join(f"-s{s:g}" for s in scales)


_LOAD, _WRITE, _STOP = 0, 1, 2
"""The copy thread's job kinds, in the order it takes queued ones (then first queued, first run)."""


class HostTierClient(CacheTierHooks):
    is_tier = True

    def __init__(self, link, *, owner: str, model: str = "", write_policy: str = "write_back",
                 selective_hits: int = 2, min_load_pages: int = 1, lease_batch: int = 32, prefault: bool = True):
        self.link, self.owner, self.model = link, owner, model
        self.policy = make_write_policy(write_policy, selective_hits)
        self.min_load_pages, self.lease_batch = max(1, min_load_pages), max(1, lease_batch)
        self.pool = None
        self.arena: Arena | None = None
        self.mirror: dict[int, int] = {}  # page hash -> slot in self.arena
        self._leased: deque[int] = deque()
        self._refilling = False
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()  # (kind, number, job): loads first, then in order
        self._job_numbers = itertools.count()
        self._done: deque[tuple[int, bool]] = deque()
        self._loads_done: deque[tuple] = deque()  # landed loads, for poll_loaded (see _load_job)
        self._next_ticket = 0
        self.stream = None  # the CUDA copy stream (a CUDA pool only)
        self._landed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.prefault = prefault
        """Map the arena's pages into this process ahead of use (see :meth:`use_arena`)."""
        self.prefault_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self.stats = {k: 0 for k in ("written_back", "write_back_bytes", "loaded_back", "load_back_bytes",
                                     "hits", "misses", "dropped", "written_sync", "verify_failed", "load_back_seconds")}
        self.observe_load_back: Callable[[float], None] | None = None
        """Called with each load-back's seconds (the worker's latency histogram), on the engine thread."""

    # ---- setup -----------------------------------------------------------------------

    def bind(self, kv_pool) -> None:
        self.pool = kv_pool
        self.page_bytes = kv_pool.data[0].numel() * kv_pool.data.element_size()
        self.layout_key = layout_key(kv_pool, self.model)
        if kv_pool.data.is_cuda:
            self.stream = torch.cuda.Stream(device=kv_pool.data.device)
        self._thread = threading.Thread(target=self._copy_loop, name="kvbus-kv-copy", daemon=True)
        self._thread.start()
        if self.link.is_local:
            self.attach_now()

    def attach_request(self) -> dict:
        return dict(owner=self.owner, layout_key=self.layout_key, page_bytes=self.page_bytes,
                    page_size=self.pool.page_size, pool_bytes=self.pool.num_bytes, reset_leases=self.arena is None)

    def attach_now(self) -> None:
        """Attach synchronously (local link, or from the worker's event loop)."""
        name, layout = self.link.attach(**self.attach_request())
        self.use_arena(name, layout)

    def use_arena(self, name: str, layout) -> None:
        if self.arena is not None and self.arena.name == name:
            return
        arena = Arena.attach(name, layout)
        # Copies queued for the old arena still complete against it (each job holds its arena).
        self.mirror, self._leased, self.arena = {}, deque(), arena
        self._refilling = False  # a lease asked of the old store may never be answered
        log.info("HiCache: attached to L2 arena %s (%d slots)", name, layout.num_slots)
        self._refill()
        if self.prefault:
            # a page the kv_store committed still faults on this side at its first touch, on the copy
            # thread beside the forward pass (costs in arena.py's docstring); mapping ahead: ~0.3 s a GB
            self.prefault_thread = prefault_in_background(arena, self._closing, "HiCache: mapping L2 into this engine")

    @property
    def is_attached(self) -> bool:
        return self.arena is not None and self.pool is not None

    def close(self) -> None:
        self._closing.set()
        self._queue(_STOP, None)  # after the copies queued before it

    def _queue(self, kind: int, job) -> None:
        self._jobs.put((kind, next(self._job_numbers), job))

    # ---- policy ----------------------------------------------------------------------

    def on_stored(self, page_hash, parent_hash, page_id) -> bool:
        return self.is_attached and self.policy.on_stored(page_hash)

    def on_hit(self, page_hash, page_id) -> bool:
        return self.is_attached and self.policy.on_hit(page_hash)

    def wants_write_back(self, page_hash) -> bool:
        return self.is_attached and self.policy.on_evict(page_hash)

    def on_removed(self, page_hash, page_id, *, clean) -> None:
        self.policy.forget(page_hash)

    def write_back_sync(self, page_hash, parent_hash, token_ids, page_id) -> None:
        # The pool ran dry before write-back reached this page: copy it now, on the engine
        # thread (a memcpy, no bus), or lose it if no slot is at hand.
        if not self.is_attached or self._in_l2(page_hash):
            return
        if len(self._leased) < self.lease_batch // 2:
            self._refill()
        if not self._leased:
            self.stats["dropped"] += 1
            return
        self._copy(self.arena, self._leased.popleft(), page_hash, parent_hash, tuple(token_ids), page_id)
        self.stats["written_sync"] += 1

    # ---- write-back --------------------------------------------------------------------

    def _in_l2(self, page_hash: int) -> bool:
        slot = self.mirror.get(page_hash)
        return slot is not None and self.arena.slot_hash(slot) == page_hash

    def write_back(self, page_hash, parent_hash, token_ids, page_id) -> bool:
        if not self.is_attached:
            return False
        if self._in_l2(page_hash):
            self._land(page_id, True)
            return True
        if len(self._leased) < self.lease_batch // 2:
            self._refill()
        if not self._leased:
            return False
        slot = self._leased.popleft()
        try:
            staged = self._stage_out(page_id) if self.stream is not None else None
        except Exception:  # e.g. no pinned memory: the page stays in L1 only, the step goes on
            log.exception("staging page %d for write-back failed", page_id)
            self._leased.appendleft(slot)
            return False
        job = (self.arena, slot, page_hash, parent_hash, tuple(token_ids), page_id, staged)
        self._queue(_WRITE, (self._write_job, job))
        return True

    def _stage_out(self, page_id: int):
        """CUDA: enqueue the page's device -> pinned host copy on the copy stream, after
        everything the engine's stream did so far (the forward that wrote the page)."""
        page = self.pool.data[page_id]
        self.stream.wait_stream(torch.cuda.current_stream(page.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(page.shape, dtype=page.dtype, pin_memory=True)
            host.copy_(page, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return host, event

    def _copy_loop(self) -> None:
        while (job := self._jobs.get()[2]) is not None:
            run, args = job
            run(*args)

    def _copy(self, arena, slot, page_hash, parent_hash, tokens, page_id, staged=None) -> bool:
        ok = False
        try:
            if staged is not None:  # CUDA: copied out on the copy stream; wait for that copy only
                page, event = staged
                event.synchronize()
            else:
                page = self.pool.data[page_id]
                if page.is_cuda:  # write_back_sync: the pool ran dry, copy now
                    page = page.to("cpu", non_blocking=False)
            arena.write(slot, page_hash, tokens, page.view(torch.uint8).reshape(-1).numpy())
            if arena is self.arena:
                self.mirror[page_hash] = slot
            self.link.commit(self.owner, arena.name, [(slot, page_hash, parent_hash)])
            self.stats["written_back"] += 1
            self.stats["write_back_bytes"] += self.page_bytes
            ok = True
        except Exception:
            log.exception("write-back of page %d failed", page_id)
        return ok

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

    @property
    def num_leased(self) -> int:
        return len(self._leased)

    @property
    def num_queued(self) -> int:
        """Copies queued for the copy thread and not yet started (write-backs; a load waits there
        only while the copy before it runs)."""
        return self._jobs.qsize()

    def _refill(self) -> None:
        if self._refilling or self.arena is None:
            return
        self._refilling = True
        arena_name = self.arena.name

        def got(slots: list[int] | None) -> None:
            self._refilling = False
            if slots and self.arena is not None and self.arena.name == arena_name:
                self._leased.extend(slots)

        self.link.lease(self.owner, arena_name, self.lease_batch - len(self._leased), got)

    # ---- load-back ---------------------------------------------------------------------

    def remember(self, arena_name: str, hashes: Sequence[int], slots: Sequence[int]) -> None:
        """Record where L2 holds pages (a lookup reply)."""
        if self.arena is not None and self.arena.name == arena_name:
            self.mirror.update(zip(hashes, slots))

    async def prefetch(self, page_hashes: Sequence[int]) -> int:
        """Before a request is queued: ask the kv_store which leading pages it holds (promoting
        L3 hits into L2) so that the engine's lookup finds them. Returns how many."""
        if not self.is_attached or not page_hashes:
            return 0
        todo = [h for h in page_hashes]
        while todo and self._in_l2(todo[0]):
            todo.pop(0)
        if not todo:
            return len(page_hashes)
        arena_name, hashes, slots = await self.link.lookup_async(todo)
        self.remember(arena_name, hashes, slots)
        return len(page_hashes) - len(todo) + len(hashes)

    async def prefetch_tail(self, tail_hashes: Sequence[int]) -> bool:
        """Before a request is queued: whether L2 holds one of a page's tails (``tail_hashes``,
        longest first), learnt now so that :meth:`find_tail` needs no round trip."""
        if not self.is_attached or not tail_hashes:
            return False
        if any(self._in_l2(h) for h in tail_hashes):
            return True
        arena_name, found = await self.link.find_first_async(tail_hashes)
        if found is None:
            return False
        self.remember(arena_name, [found[0]], [found[1]])
        return self._in_l2(found[0])

    def lookup(self, page_hashes) -> int:
        if not self.is_attached:
            return 0
        n = 0
        while n < len(page_hashes) and self._in_l2(page_hashes[n]):
            n += 1
        if n < len(page_hashes) and self.link.is_local:  # in-process store: no round trip
            arena_name, hashes, slots = self.link.lookup(page_hashes[n:])
            self.remember(arena_name, hashes, slots)
            while n < len(page_hashes) and self._in_l2(page_hashes[n]):
                n += 1
        if n < self.min_load_pages:
            self.stats["misses"] += 1
            return 0
        return n

    def find_tail(self, tail_hashes):
        if not self.is_attached:
            return None
        for i, h in enumerate(tail_hashes):
            if self._in_l2(h):
                return i
        if not self.link.is_local:  # over the bus: only what this engine wrote or prefetched
            return None
        arena_name, found = self.link.find_first(tail_hashes)
        if found is None:
            return None
        self.remember(arena_name, [found[0]], [found[1]])
        return list(tail_hashes).index(found[0]) if self._in_l2(found[0]) else None

    def load_back(self, page_hashes, token_ids, page_ids) -> int:
        t0 = time.perf_counter()
        n = 0
        arena = self.arena
        if arena is None:
            return 0
        for h, tokens, page_id in zip(page_hashes, token_ids, page_ids):
            slot = self.mirror.get(h)
            page = self.pool.data[page_id]
            if slot is None:
                break
            if page.is_cuda:
                staging = torch.empty(page.shape, dtype=page.dtype)
                ok = arena.read_into(slot, h, tokens, staging.view(torch.uint8).reshape(-1).numpy())
                if ok:
                    page.copy_(staging)
            else:
                ok = arena.read_into(slot, h, tokens, page.view(torch.uint8).reshape(-1).numpy())
            if not ok:
                self.stats["verify_failed"] += 1
                self.mirror.pop(h, None)
                break
            n += 1
        self.stats["hits"] += 1 if n else 0
        self.stats["loaded_back"] += n
        self.stats["load_back_bytes"] += n * self.page_bytes
        seconds = time.perf_counter() - t0
        self.stats["load_back_seconds"] += seconds
        if self.observe_load_back is not None:
            self.observe_load_back(seconds)
        if n:
            self.link.touch(list(page_hashes[:n]))
        return n

    # ---- asynchronous load-back (the copy thread) ----------------------------------------

    def start_load(self, page_hashes, token_ids, page_ids):
        arena = self.arena
        if arena is None or self.pool is None or self._thread is None or not page_ids:
            return None
        slots = []
        for h in page_hashes[: len(page_ids)]:
            slot = self.mirror.get(h)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return None
        ready = None
        if self.stream is not None:  # the pages' earlier users (forwards on the engine's stream) come first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.pool.data.device))
        ticket = self._next_ticket
        self._next_ticket += 1
        self._queue(_LOAD, (self._load_job, (ticket, arena, slots, list(page_hashes[: len(slots)]),
                                             [tuple(t) for t in token_ids[: len(slots)]], list(page_ids), ready)))
        return ticket

    def _read_verified(self, arena, slots, hashes, tokens, outs) -> tuple[int, int | None]:
        """Verified reads (seqlock, hash, tokens) into ``outs`` in order, up to the first failure:
        ``(how many, the hash that failed or None)``."""
        for n, (slot, h, toks, out) in enumerate(zip(slots, hashes, tokens, outs)):
            if not arena.read_into(slot, h, toks, out.view(torch.uint8).reshape(-1).numpy()):
                return n, h
        return len(slots), None

    def _load_job(self, ticket, arena, slots, hashes, tokens, page_ids, ready) -> None:
        t0 = time.perf_counter()
        n, failed, event, staging = 0, None, None, None
        try:
            if self.stream is None:  # CPU: straight into the pool's pages (no one else uses them now)
                n, failed = self._read_verified(arena, slots, hashes, tokens, [self.pool.data[p] for p in page_ids])
            else:  # CUDA: verify into pinned staging, then staging -> device on the copy stream
                first = self.pool.data[page_ids[0]]
                staging = torch.empty((len(slots), *first.shape), dtype=first.dtype, pin_memory=True)
                n, failed = self._read_verified(arena, slots, hashes, tokens, list(staging))
                self.stream.wait_event(ready)
                with torch.cuda.stream(self.stream):
                    for i in range(n):
                        self.pool.data[page_ids[i]].copy_(staging[i], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.stream)
        except Exception:
            log.exception("load-back of %d pages failed; recomputing them", len(slots))
            n = 0
            if self.stream is not None:  # whatever was enqueued must finish before the pages are reused
                event = torch.cuda.Event()
                event.record(self.stream)
        with self._landed:
            self._loads_done.append((ticket, n, failed, event, staging, time.perf_counter() - t0, hashes[:n]))
            self._landed.notify_all()

    def poll_loaded(self):
        out = []
        while self._loads_done:
            ticket, n, failed, event, staging, seconds, hashes = self._loads_done.popleft()
            if event is not None:  # the engine's stream waits for the copy (no host sync)
                torch.cuda.current_stream(self.pool.data.device).wait_event(event)
            if failed is not None:
                self.stats["verify_failed"] += 1
                self.mirror.pop(failed, None)
            self.stats["hits"] += 1 if n else 0
            self.stats["loaded_back"] += n
            self.stats["load_back_bytes"] += n * self.page_bytes
            self.stats["load_back_seconds"] += seconds
            if n:
                self.link.touch(list(hashes))
            out.append((ticket, n))
        return out

    def wait_loaded(self, timeout: float):
        with self._landed:
            self._landed.wait_for(lambda: bool(self._loads_done), timeout)
        return self.poll_loaded()
