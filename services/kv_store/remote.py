"""How an engine uses a kv_store on another host: pages by value through the transfer layer.

An engine that cannot map the store's arena (``WorkerConfig.hicache_store_host``
names another host) keeps a private **staging** arena of its own (a
``StoreCore`` in this process, sized ``hicache_staging_ratio`` x its KV pool).
The tier client (``client.py``) sees the staging arena exactly as it sees a
host's shared arena: it leases its slots, copies pages in and out under the
same seqlock and verification, and never waits on the bus. This link moves
pages between the staging arena and the remote store:

- write-back: a page committed into staging is queued; a task on the worker's
  event loop offers batches to the store (``KV_STORE_OFFER``: hashes, parents,
  tokens), sends only the pages it lacks through the transfer layer's nats
  backend, and tells it they are there (``KV_STORE_PUT``, with the descriptor);
- load-back: :meth:`lookup_async` (the worker's prefetch, before a request is
  queued) finds the leading pages staging holds, then asks the store for the
  next ones (``KV_STORE_FETCH``); they arrive through this link's receiver and
  are stored into staging, where the engine's admission loads them like local
  L2 hits.

Staging also serves as this engine's own host cache: a page it wrote back or
fetched before is found there without asking the store. Staging pages publish
no KV events (the store publishes ``host``-tier events for the pages it takes).
When the store is away the engine keeps serving: fetches are misses, puts are
dropped (a cache loses nothing), and the worker's attach loop notices its return.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

import torch

from services.kv_store.config import KVStoreConfig
from services.kv_store.links import BusLink, TierLink
from services.kv_store.store import GB, StoreCore
from services.transfer.payload import run_blocking

log = logging.getLogger(__name__)

MIN_STAGING_PAGES = 64
"""Staging never has fewer slots (write-back leases up to half of them ahead of need)."""


class RemoteLink(TierLink):
    """A kv_store on ``store_host_id``, reached over the bus; pages by value through staging."""

    moves_bytes = True

    def __init__(self, bus, store_host_id: str, host_id: str, loop: asyncio.AbstractEventLoop, *,
                 staging_ratio: float = 0.5, timeout: float = 2.0, transfer_timeout: float = 30.0,
                 batch_pages: int = 32, max_queued: int = 4096, memory_reserve: float = 1.0):
        # Metadata (attach, touches) goes to the store as from a same-host engine; pages go by value here.
        self.store = BusLink(bus, store_host_id, loop, timeout=timeout)
        self.store_host, self.host_id, self.loop = store_host_id, host_id, loop
        self.staging_ratio, self.timeout, self.transfer_timeout = staging_ratio, timeout, transfer_timeout
        self.batch_pages, self.max_queued, self.memory_reserve = batch_pages, max_queued, memory_reserve
        self.staging: StoreCore | None = None
        self.owner = ""
        self.layout_key = ""
        self.receiver = None  # KVReceiver (nats) for fetched pages, opened at the first attach
        self.sender = None  # KVSender (nats) for written-back pages
        self._queue: deque[int] = deque()  # hashes committed into staging, to offer to the store
        self._pushing: asyncio.Task | None = None
        self.stats = {k: 0 for k in ("pages_sent", "pages_offered", "pages_received", "bytes_sent", "bytes_received",
                                     "put_failed", "fetch_failed", "queue_dropped", "fetch_seconds")}

    @classmethod
    def for_worker(cls, config, host_id, loop):
        return cls(None, config.hicache_store_host, host_id, loop, staging_ratio=config.hicache_staging_ratio,
                   transfer_timeout=config.transfer_timeout)

    @property
    def bus(self):
        return self.store.bus

    @bus.setter
    def bus(self, bus) -> None:  # the worker hands the bus over once it has one
        self.store.bus = bus

    @property
    def healthy(self) -> bool:
        return self.store.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.store.healthy = value

    # ---- attach ------------------------------------------------------------------------

    async def attach_async(self, *, owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases=True):
        from services.transfer import KVReceiver, KVSender

        if self.receiver is None:
            self.receiver = await KVReceiver.open(self.bus, f"{owner}-l2", self.host_id, "nats")
            self.sender = KVSender(self.bus, owner, self.host_id, backends=("nats",))
        try:
            _, remote = await self.store.attach_async(owner=owner, layout_key=layout_key, page_bytes=page_bytes,
                                                      page_size=page_size, pool_bytes=pool_bytes,
                                                      reset_leases=reset_leases)
        except Exception:
            self.healthy = False
            raise
        if remote.page_bytes != page_bytes or remote.page_size != page_size:
            self.healthy = False
            raise ValueError(f"kv_store on {self.store_host} holds pages of {remote.page_bytes} B x "
                             f"{remote.page_size} tokens; this engine's are {page_bytes} B x {page_size}")
        if self.staging is None:
            size = max(self.staging_ratio * pool_bytes, MIN_STAGING_PAGES * page_bytes)
            # One engine uses it: half of it may be leased ahead for write-back (a host's store allows 1/16).
            self.staging = StoreCore(KVStoreConfig(host_id=self.host_id, hicache_size=size / GB,
                                                   memory_reserve=self.memory_reserve, lease_share=0.5))
            self.owner, self.layout_key = owner, layout_key
        arena = self.staging.attach(owner, layout_key, page_bytes, page_size, pool_bytes, reset_leases)
        return arena.name, arena.layout

    async def aclose(self) -> None:
        if self._pushing is not None:
            self._pushing.cancel()
            await asyncio.gather(self._pushing, return_exceptions=True)
        if self.receiver is not None:
            await self.receiver.close()
            await self.sender.close(grace=0)
        if self.staging is not None:
            self.staging.close()

    def _mine(self, arena_name: str) -> bool:
        return self.staging is not None and self.staging.arena is not None and self.staging.arena.name == arena_name

    # ---- the client's calls (engine and copy threads: never wait on the bus) -------------

    def lease(self, owner: str, arena_name: str, n: int, done: Callable) -> None:
        done(self.staging.lease(owner, n) if self._mine(arena_name) else [])

    def commit(self, owner: str, arena_name: str, entries) -> None:
        if not self._mine(arena_name):
            return
        stored = self.staging.commit(owner, entries)
        if stored:
            self._call(self._enqueue, stored)

    def touch(self, hashes) -> None:
        if self.staging is not None:
            self.staging.touch(hashes)
        self.store.touch(hashes)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the worker is stopping
            pass

    # ---- write-back: staging -> store ----------------------------------------------------

    def _enqueue(self, hashes: Sequence[int]) -> None:
        self._queue.extend(hashes)
        while len(self._queue) > self.max_queued:  # the store is slow or away: the oldest go unsent
            self._queue.popleft()
            self.stats["queue_dropped"] += 1
        if self._pushing is None or self._pushing.done():
            self._pushing = asyncio.ensure_future(self._push_loop())

    async def _push_loop(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(self.batch_pages, len(self._queue)))]
            if not self.healthy:
                self.stats["put_failed"] += len(batch)
                continue
            try:
                await self._put(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["put_failed"] += len(batch)
                log.warning("write-back of %d pages to the kv_store on %s failed: %s", len(batch), self.store_host,
                            exc or type(exc).__name__)

    async def _put(self, hashes: Sequence[int]) -> None:
        from bus.subjects import KV_STORE_OFFER, KV_STORE_PUT
        from schemas.kv_store import KVStoreOfferRequest, KVStorePutRequest

        page_bytes = self.staging.arena.layout.page_bytes
        kept, parents, tokens, rows = await run_blocking(len(hashes) * page_bytes, self.staging.read_stored, hashes)
        if not kept:
            return
        offer = await self.bus.request(KV_STORE_OFFER, KVStoreOfferRequest(
            worker_id=self.owner, layout_key=self.layout_key, page_hashes=kept, parent_hashes=parents,
            token_ids=tokens, sender_host_id=self.host_id), timeout=self.timeout, host_id=self.store_host)
        self.stats["pages_offered"] += len(kept)
        if not offer.wanted:
            return
        payload = torch.from_numpy(rows if len(offer.wanted) == len(kept) else rows[offer.wanted])
        descriptor = await self.sender.send(offer.target, payload)
        await self.bus.request(KV_STORE_PUT, KVStorePutRequest(worker_id=self.owner, transfer=descriptor),
                               timeout=self.transfer_timeout, host_id=self.store_host)
        self.stats["pages_sent"] += len(offer.wanted)
        self.stats["bytes_sent"] += payload.numel()

    # ---- load-back: store -> staging -----------------------------------------------------

    async def lookup_async(self, hashes):
        """``(staging arena name, hashes, slots)`` of the leading pages of ``hashes`` now in staging,
        fetching from the store those after the ones staging held."""
        staging = self.staging
        if staging is None or staging.arena is None:
            return "", [], []
        found = staging.lookup(hashes, promote=False)
        rest = list(hashes[len(found):])
        if rest and self.healthy:
            try:
                found += await self._fetch(rest, protect={h for h, _ in found})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats["fetch_failed"] += 1
                log.warning("fetch from the kv_store on %s failed: %s; recomputing", self.store_host,
                            exc or type(exc).__name__)
        return staging.arena.name, [h for h, _ in found], [s for _, s in found]

    async def find_first_async(self, hashes):
        """``(staging arena name, (hash, slot) or None)``: the first of ``hashes`` (one page's tails,
        longest first) in staging; else the first the store holds, fetched into staging (one
        lookup, then one page by value)."""
        staging = self.staging
        if staging is None or staging.arena is None:
            return "", None
        found = staging.find_first(hashes)
        if found is not None or not hashes or not self.healthy:
            return staging.arena.name, found
        _, there = await self.store.find_first_async(hashes)  # on failure: None, and the link unhealthy
        if there is not None:
            try:
                got = await self._fetch([there[0]], protect=set())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                got = []
                self.stats["fetch_failed"] += 1
                log.warning("fetching a tail from the kv_store on %s failed: %s; recomputing", self.store_host,
                            exc or type(exc).__name__)
            found = got[0] if got else None
        return staging.arena.name, found

    async def _fetch(self, hashes: list[int], protect: set[int]) -> list[tuple[int, int]]:
        from bus.subjects import KV_STORE_FETCH
        from schemas.kv_store import KVStoreFetchRequest

        t0 = time.perf_counter()
        staging = self.staging
        max_pages = max(1, staging.index.num_slots - len(protect))  # what staging can take without churning
        tid = uuid.uuid4().hex
        target = self.receiver.expect(tid, sender_host_id=self.store_host, sender_backends=("nats",))
        try:
            reply = await self.bus.request(KV_STORE_FETCH, KVStoreFetchRequest(
                worker_id=self.owner, layout_key=self.layout_key, page_hashes=hashes[:max_pages], target=target,
                max_pages=max_pages), timeout=self.transfer_timeout, host_id=self.store_host)
            if reply.transfer is None:
                return []
            n, page_bytes = len(reply.page_hashes), staging.arena.layout.page_bytes
            if list(reply.transfer.shape) != [n, page_bytes] or reply.page_hashes != hashes[:n] \
                    or not len(reply.parent_hashes) == len(reply.token_ids) == n:
                raise ValueError(f"fetch reply does not match the request ({n} pages, shape {reply.transfer.shape})")
            pages = await self.receiver.receive(reply.transfer, timeout=self.transfer_timeout)
        finally:
            self.receiver.cancel(tid)  # idempotent: drops what arrived of a failed or cancelled fetch
        self.stats["pages_received"] += n
        self.stats["bytes_received"] += pages.numel()
        rows, protect = pages.numpy(), set(protect)

        def stage() -> list[tuple[int, int]]:
            out = []
            for i, (h, parent, toks) in enumerate(zip(reply.page_hashes, reply.parent_hashes, reply.token_ids)):
                page = staging.put(h, parent, toks, rows[i], hits=1, protect=protect)
                if page is None:  # staging cannot take more without evicting this chain
                    break
                protect.add(h)
                out.append((h, page.slot))
            return out

        out = await run_blocking(pages.numel(), stage)
        self.stats["fetch_seconds"] += time.perf_counter() - t0
        return out

