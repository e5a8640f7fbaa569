"""How pages move between the engine's KV pool and L2 arena slots: a CPU and a CUDA copier.

The tier client (``client.py``) decides which pages to copy and when; a copier does the copy for
the pool's device, and :func:`make_copier` is the one place that chooses. Each call runs on a
fixed thread:

=====================  ===============  ==============================================================
call                   thread           job
=====================  ===============  ==============================================================
``stage_out``          engine           write-back: start taking the page out (CUDA: to pinned memory)
``page_bytes``         copy (or engine  the page's bytes, ready for the arena (``write_back_sync``
                       when the pool    copies on the engine thread)
                       ran dry)
``load_now``           engine           a synchronous load-back of one page, verified
``load_ready``         engine           ``start_load``: what an asynchronous load must wait for
``load``               copy             verified reads of a run of slots into pool pages
``fence``              copy             after a load that raised: what the pages' reuse waits for
``land``               engine           ``poll_loaded``: the engine may use the loaded pages
=====================  ===============  ==============================================================

Every read is verified by the arena (seqlock, hash, token ids) before a page counts as loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.kv_store.arena import Arena


def as_bytes(page: torch.Tensor) -> np.ndarray:
    """A CPU page as the flat uint8 array the arena reads and writes (no copy)."""
    return page.view(torch.uint8).reshape(-1).numpy()


def read_verified(arena: Arena, slots: Sequence[int], hashes: Sequence[int], tokens: Sequence[tuple[int, ...]],
                  outs: Sequence[torch.Tensor]) -> tuple[int, int | None]:
    """Verified reads into CPU pages ``outs``, in order, up to the first failure:
    ``(how many, the hash that failed or None)``."""
    for n, (slot, h, toks, out) in enumerate(zip(slots, hashes, tokens, outs)):
        if not arena.read_into(slot, h, toks, as_bytes(out)):
            return n, h
    return len(slots), None


class CpuCopier:
    """A CPU pool: the arena reads into and writes from the pool's pages directly; no ordering
    beyond the copy thread's (a page being loaded belongs to the tier until it lands)."""

    stream = None
    """The copy stream (CUDA only)."""

    def __init__(self, kv_pool):
        self.pool = kv_pool

    def stage_out(self, page_id: int):
        """Nothing to stage: the copy thread reads the page (it stays unchanged until it is reported written)."""
        return None

    def page_bytes(self, page_id: int, staged) -> np.ndarray:
        return as_bytes(self.pool.data[page_id])

    def load_now(self, arena: Arena, slot: int, page_hash: int, tokens, page_id: int) -> bool:
        return arena.read_into(slot, page_hash, tokens, as_bytes(self.pool.data[page_id]))

    def load_ready(self):
        return None

    def load(self, arena: Arena, slots, hashes, tokens, page_ids, ready) -> tuple[int, int | None, object]:
        """``(pages loaded, the hash that failed verification or None, what :meth:`land` takes)``."""
        n, failed = read_verified(arena, slots, hashes, tokens, [self.pool.data[p] for p in page_ids])
        return n, failed, None

    def fence(self):
        return None

    def land(self, landed) -> None:
        pass


class CudaCopier(CpuCopier):
    """A CUDA pool: copies run on a dedicated copy stream, ordered against the engine's stream by
    events, so neither thread syncs with the device on the engine's behalf.

    Write-back: the copy stream waits for the engine's stream (the page's KV is complete), copies
    the page to pinned memory and records an event; the copy thread waits on that event only.
    Load-back: verified reads into pinned staging on the copy thread, then staging -> device on the
    copy stream after the engine's earlier work on those pages (``load_ready``); ``land`` makes the
    engine's stream wait for that copy (a stream dependency, no host sync). Synchronous paths
    (``write_back_sync``, short ``load_now``s) copy on the engine's stream.
    """

    def __init__(self, kv_pool):
        super().__init__(kv_pool)
        self.stream = torch.cuda.Stream(device=kv_pool.data.device)
        """NOTE: bench/cuda_copy_bench.py sets it to None for its baseline: write-backs then copy on
        the engine's stream (asynchronous loads need it)."""

    def _engine_stream(self):
        return torch.cuda.current_stream(self.pool.data.device)

    def stage_out(self, page_id: int):
        if self.stream is None:
            return None
        page = self.pool.data[page_id]
        self.stream.wait_stream(self._engine_stream())
        with torch.cuda.stream(self.stream):
            host = torch.empty(page.shape, dtype=page.dtype, pin_memory=True)
            host.copy_(page, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return host, event

    def page_bytes(self, page_id: int, staged) -> np.ndarray:
        if staged is None:  # write_back_sync (the pool ran dry): copy now
            return as_bytes(self.pool.data[page_id].to("cpu", non_blocking=False))
        host, event = staged  # copied out on the copy stream: wait for that copy only
        event.synchronize()
        return as_bytes(host)

    def load_now(self, arena: Arena, slot: int, page_hash: int, tokens, page_id: int) -> bool:
        page = self.pool.data[page_id]
        staging = torch.empty(page.shape, dtype=page.dtype)
        ok = arena.read_into(slot, page_hash, tokens, as_bytes(staging))
        if ok:
            page.copy_(staging)
        return ok

    def load_ready(self):
        """The pages' earlier users (forwards on the engine's stream) come before the copy into them."""
        ready = torch.cuda.Event()
        ready.record(self._engine_stream())
        return ready

    def load(self, arena: Arena, slots, hashes, tokens, page_ids, ready) -> tuple[int, int | None, object]:
        first = self.pool.data[page_ids[0]]
        staging = torch.empty((len(slots), *first.shape), dtype=first.dtype, pin_memory=True)
        n, failed = read_verified(arena, slots, hashes, tokens, list(staging))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for i in range(n):
                self.pool.data[page_ids[i]].copy_(staging[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return n, failed, (event, staging)  # staging lives until the engine took the load

    def fence(self):
        """Whatever a failed load enqueued must finish before its pages are reused."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event, None

    def land(self, landed) -> None:
        self._engine_stream().wait_event(landed[0])


def make_copier(kv_pool) -> CpuCopier:
    """The copier for the pool's device."""
    return CudaCopier(kv_pool) if kv_pool.data.is_cuda else CpuCopier(kv_pool)
