"""How a tier client reaches its kv_store: in process (tests, one-process setups) or over the bus.

(A kv_store on another host is reached by ``remote.RemoteLink``, which moves page bytes.)

Both offer the same calls. Calls from the engine thread or the copy thread
never wait on the bus: the bus link schedules them on the worker's event loop
and returns at once (a lease's slots arrive through a callback).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.kv_store.arena import ArenaLayout

log = logging.getLogger(__name__)


class LocalLink:
    """The store in this process (``store.StoreCore``)."""

    is_local = True
    moves_bytes = False

    def __init__(self, core):
        self.core = core

    def attach(self, *, owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases=True):
        arena = self.core.attach(owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases)
        return arena.name, arena.layout

    def lease(self, owner: str, arena_name: str, n: int, done: Callable) -> None:
        arena = self.core.arena
        done(self.core.lease(owner, n) if arena is not None and arena.name == arena_name else [])

    def commit(self, owner: str, arena_name: str, entries) -> None:
        arena = self.core.arena
        if arena is not None and arena.name == arena_name:
            self.core.commit(owner, entries)

    def touch(self, hashes) -> None:
        self.core.touch(hashes)

    def lookup(self, hashes):
        arena = self.core.arena
        found = self.core.lookup(hashes)
        return (arena.name if arena else ""), [h for h, _ in found], [s for _, s in found]

    async def lookup_async(self, hashes):
        return self.lookup(hashes)

    def find_first(self, hashes):
        arena = self.core.arena
        found = self.core.find_first(hashes)
        return (arena.name if arena else ""), found

    async def find_first_async(self, hashes):
        return self.find_first(hashes)

    async def aclose(self) -> None:
        pass


class BusLink:
    """The host's kv_store actor over the bus (``actor.py``); page bytes stay in its arena."""

    is_local = False
    moves_bytes = False

    def __init__(self, bus, host_id: str, loop: asyncio.AbstractEventLoop, *, timeout: float = 2.0):
        self.bus, self.host_id, self.loop, self.timeout = bus, host_id, loop, timeout
        self.healthy = False

    def _spawn(self, coro) -> None:
        try:
            asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: the worker is stopping
            coro.close()

    async def attach_async(self, *, owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases=True):
        from bus.subjects import KV_STORE_ATTACH
        from schemas.kv_store import KVStoreAttachRequest

        reply = await self.bus.request(
            KV_STORE_ATTACH, KVStoreAttachRequest(worker_id=owner, layout_key=layout_key, page_bytes=page_bytes,
                                                  page_size=page_size, pool_bytes=pool_bytes,
                                                  reset_leases=reset_leases),
            timeout=self.timeout, host_id=self.host_id)
        self.healthy = True
        return reply.arena_name, ArenaLayout(reply.num_slots, reply.page_bytes, reply.page_size)

    def lease(self, owner: str, arena_name: str, n: int, done: Callable) -> None:
        from bus.subjects import KV_STORE_LEASE
        from schemas.kv_store import KVStoreLeaseRequest

        async def run():
            slots = None
            try:
                reply = await self.bus.request(KV_STORE_LEASE, KVStoreLeaseRequest(
                    worker_id=owner, arena_name=arena_name, count=n), timeout=self.timeout, host_id=self.host_id)
                slots = list(reply.slots)
            except Exception as exc:
                self.healthy = False
                log.warning("kv_store lease failed: %s", exc)
            done(slots)

        self._spawn(run())

    def commit(self, owner: str, arena_name: str, entries) -> None:
        from bus.subjects import KV_STORE_COMMIT
        from schemas.kv_store import KVStoreCommitEvent

        event = KVStoreCommitEvent(worker_id=owner, arena_name=arena_name, slots=[e[0] for e in entries],
                                   page_hashes=[e[1] for e in entries], parent_hashes=[e[2] for e in entries])
        self._spawn(self._publish(KV_STORE_COMMIT, event))

    def touch(self, hashes) -> None:
        from bus.subjects import KV_STORE_TOUCH
        from schemas.kv_store import KVStoreTouchEvent

        self._spawn(self._publish(KV_STORE_TOUCH, KVStoreTouchEvent(page_hashes=list(hashes))))

    async def _publish(self, subject, event) -> None:
        try:
            await self.bus.publish(subject, event, host_id=self.host_id)
        except Exception as exc:
            log.warning("kv_store %s publish failed: %s", subject.template, exc)

    async def lookup_async(self, hashes):
        from bus.subjects import KV_STORE_LOOKUP
        from schemas.kv_store import KVStoreLookupRequest

        try:
            reply = await self.bus.request(KV_STORE_LOOKUP, KVStoreLookupRequest(page_hashes=list(hashes)),
                                           timeout=self.timeout, host_id=self.host_id)
        except Exception as exc:
            self.healthy = False
            log.warning("kv_store lookup failed: %s; recomputing", exc)
            return "", [], []
        return reply.arena_name, list(reply.page_hashes), list(reply.slots)

    async def find_first_async(self, hashes):
        """``(arena name, (hash, slot) or None)``: the first of ``hashes`` L2 holds (one page's tails)."""
        from bus.subjects import KV_STORE_LOOKUP
        from schemas.kv_store import KVStoreLookupRequest

        try:
            reply = await self.bus.request(KV_STORE_LOOKUP, KVStoreLookupRequest(page_hashes=list(hashes), first_of=True),
                                           timeout=self.timeout, host_id=self.host_id)
        except Exception as exc:
            self.healthy = False
            log.warning("kv_store lookup failed: %s; recomputing", exc)
            return "", None
        found = (reply.page_hashes[0], reply.slots[0]) if reply.page_hashes and reply.slots else None
        return reply.arena_name, found

    async def aclose(self) -> None:
        pass
