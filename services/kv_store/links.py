"""How a tier client reaches its kv_store: one protocol, :class:`TierLink`, three kinds.

==========  =====================================================================================
``local``   :class:`LocalLink`: the store in this process (tests, benches, one-process setups)
``bus``     :class:`BusLink`: the host's kv_store actor over the bus; the arena is mapped here
``remote``  ``remote.RemoteLink``: a kv_store on another host; page bytes move by value
==========  =====================================================================================

:data:`TIER_LINKS` names them; :func:`open_tier_link` picks a worker's from its configuration.
The tier client (``client.py``) never asks which kind it has: every link answers every call,
and a link that cannot answer without a round trip says so by answering nothing
(:meth:`TierLink.attach_now` gives None, :meth:`TierLink.lookup_now` no pages). Calls from the
engine thread or the copy thread never wait on the bus: bus links schedule them on the worker's
event loop and return at once (a lease's slots arrive through a callback).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar

from services.kv_store.arena import ArenaLayout
from services.plugins import Registry

log = logging.getLogger(__name__)

TIER_LINKS = Registry("cache-tier link", {
    "local": "services.kv_store.links:LocalLink",
    "bus": "services.kv_store.links:BusLink",
    "remote": "services.kv_store.remote:RemoteLink",
}, docs={
    "local": "the kv_store core in this process",
    "bus": "the host's kv_store over the bus; pages stay in its shared arena",
    "remote": "a kv_store on another host; pages by value through the transfer layer",
})


def open_tier_link(config, host_id: str, loop: asyncio.AbstractEventLoop) -> TierLink:
    """An engine worker's link (``WorkerConfig``): ``bus`` to its own host's kv_store, ``remote`` when
    ``hicache_store_host`` names another host. The worker sets ``link.bus`` once it has one."""
    kind = "bus" if (config.hicache_store_host or host_id) == host_id else "remote"
    return TIER_LINKS.get(kind).for_worker(config, host_id, loop)


Found = tuple[str, list[int], list[int]]
"""``(arena name, page hashes, slots)``: the leading pages of a lookup the store holds, in that arena."""


class TierLink(abc.ABC):
    """What the tier client needs of its kv_store, however it is reached."""

    moves_bytes: ClassVar[bool] = False
    """Lookups may move page bytes (a store on another host): the worker allows a prefetch
    ``hicache_fetch_timeout`` instead of ``hicache_timeout``."""
    healthy: bool = True
    """False after a failed call; the worker's attach loop sets it again."""
    bus = None
    """The worker's bus, handed over once it has one (links that use it)."""

    @classmethod
    def for_worker(cls, config, host_id: str, loop: asyncio.AbstractEventLoop) -> TierLink:
        """This kind built from an engine worker's configuration (see :func:`open_tier_link`)."""
        raise ValueError(f"{cls.__name__} is not an engine worker's link")

    def attach_now(self, *, owner, layout_key, page_bytes, page_size, pool_bytes,
                   reset_leases=True) -> tuple[str, ArenaLayout] | None:
        """Attach on the caller's thread if that needs no round trip: ``(arena name, layout)``;
        None: the worker attaches from its event loop (:meth:`attach_async`)."""
        return None

    @abc.abstractmethod
    async def attach_async(self, *, owner, layout_key, page_bytes, page_size, pool_bytes,
                           reset_leases=True) -> tuple[str, ArenaLayout]:
        """Attach (again): the arena to map, made by the store for this layout if it has none."""

    @abc.abstractmethod
    def lease(self, owner: str, arena_name: str, n: int, done: Callable) -> None:
        """Up to ``n`` empty slots of ``arena_name`` for write-back, given to ``done`` (None or [] if none)."""

    @abc.abstractmethod
    def commit(self, owner: str, arena_name: str, entries) -> None:
        """``(slot, page hash, parent hash)`` entries now hold their pages."""

    @abc.abstractmethod
    def touch(self, hashes) -> None:
        """Pages hit (loaded back): fresh in the store's LRU."""

    def lookup_now(self, hashes: Sequence[int]) -> Found:
        """:meth:`lookup_async`'s answer if it needs no round trip, else no pages."""
        return "", [], []

    def find_first_now(self, hashes: Sequence[int]) -> tuple[str, tuple[int, int] | None]:
        """:meth:`find_first_async`'s answer if it needs no round trip, else None."""
        return "", None

    @abc.abstractmethod
    async def lookup_async(self, hashes: Sequence[int]) -> Found:
        """The leading pages of ``hashes`` the store holds (L3 hits promoted into L2 first)."""

    @abc.abstractmethod
    async def find_first_async(self, hashes: Sequence[int]) -> tuple[str, tuple[int, int] | None]:
        """``(arena name, (hash, slot) or None)``: the first of ``hashes`` L2 holds (one page's tails)."""

    async def aclose(self) -> None:
        """Release what the link holds (the worker is stopping)."""


class LocalLink(TierLink):
    """The store in this process (``store.StoreCore``): every call answers at once."""

    def __init__(self, core):
        self.core = core

    def attach_now(self, *, owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases=True):
        arena = self.core.attach(owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases)
        return arena.name, arena.layout

    async def attach_async(self, **request):
        return self.attach_now(**request)

    def lease(self, owner: str, arena_name: str, n: int, done: Callable) -> None:
        arena = self.core.arena
        done(self.core.lease(owner, n) if arena is not None and arena.name == arena_name else [])

    def commit(self, owner: str, arena_name: str, entries) -> None:
        arena = self.core.arena
        if arena is not None and arena.name == arena_name:
            self.core.commit(owner, entries)

    def touch(self, hashes) -> None:
        self.core.touch(hashes)

    def lookup_now(self, hashes):
        arena = self.core.arena
        found = self.core.lookup(hashes)
        return (arena.name if arena else ""), [h for h, _ in found], [s for _, s in found]

    async def lookup_async(self, hashes):
        return self.lookup_now(hashes)

    def find_first_now(self, hashes):
        arena = self.core.arena
        found = self.core.find_first(hashes)
        return (arena.name if arena else ""), found

    async def find_first_async(self, hashes):
        return self.find_first_now(hashes)


class BusLink(TierLink):
    """The host's kv_store actor over the bus (``actor.py``); page bytes stay in its arena."""

    def __init__(self, bus, host_id: str, loop: asyncio.AbstractEventLoop, *, timeout: float = 2.0):
        self.bus, self.host_id, self.loop, self.timeout = bus, host_id, loop, timeout
        self.healthy = False

    @classmethod
    def for_worker(cls, config, host_id, loop):
        return cls(None, host_id, loop)

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
