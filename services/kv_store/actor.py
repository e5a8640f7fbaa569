"""The kv_store service (``kvbus serve kv_store``): HiCache's host (L2) and disk (L3) tiers.

One per host. It owns the shared-memory arena every engine on the host maps
and answers metadata only: attach, leases of empty slots, commits, lookups.
Page bytes never cross the bus on one host; engines on other hosts offer,
put and fetch pages by value through the transfer layer's nats backend
(``services/kv_store/remote.py`` is their side). It publishes ``stored``/``removed``
KV events for its tiers (``host``, ``disk``) and answers dumps for resync.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import numpy as np
import torch

from bus.errors import InvalidArgument, Unavailable
from bus.subjects import (
    KV_EVENTS_DUMP,
    KV_STORE_ATTACH,
    KV_STORE_COMMIT,
    KV_STORE_FETCH,
    KV_STORE_LEASE,
    KV_STORE_LOOKUP,
    KV_STORE_OFFER,
    KV_STORE_PUT,
    KV_STORE_TOUCH,
)
from schemas.kv_store import (
    KVDumpReply,
    KVDumpRequest,
    KVEvent,
    KVStoreAttachReply,
    KVStoreAttachRequest,
    KVStoreCommitEvent,
    KVStoreFetchReply,
    KVStoreFetchRequest,
    KVStoreLeaseReply,
    KVStoreLeaseRequest,
    KVStoreLookupReply,
    KVStoreLookupRequest,
    KVStoreOfferReply,
    KVStoreOfferRequest,
    KVStorePutReply,
    KVStorePutRequest,
    KVStoreTouchEvent,
)
from services.actor import Actor
from services.config import ConfigError
from services.kv_store.config import KVStoreConfig
from services.kv_store.events import KVEventPublisher
from services.kv_store.metrics import KVStoreMetrics
from services.kv_store.store import StoreCore
from services.metrics_http import start_metrics
from services.transfer import KVReceiver, KVSender
from services.workers.config import default_host_id

log = logging.getLogger(__name__)

MAX_REMOTE_PAGES = 1024
"""Most pages one offer or fetch of a remote engine may name."""
MAX_OFFERS = 256
"""Most offers awaiting their put at once (each holds its pages' metadata until put or expiry)."""


class KVStoreActor(Actor):
    """HiCache kv_store: the host's L2 arena and optional L3 directory, shared by its engines."""

    role = "kv_store"
    config_class = KVStoreConfig

    def __init__(self, config: KVStoreConfig, *, worker_id: str | None = None):
        super().__init__(config, worker_id=worker_id)
        self.host_id = config.host_id or default_host_id()
        self.events: KVEventPublisher | None = None
        self.core: StoreCore | None = None
        self.metrics = KVStoreMetrics(self)
        self.metrics_server = None  # GET /metrics when config.metrics_port
        self.receiver: KVReceiver | None = None  # pages written back by engines on other hosts
        self.sender: KVSender | None = None  # pages fetched by them
        self._offers: dict[str, tuple[str, list[int], list[int], list[list[int]], float]] = {}
        """transfer id -> (worker id, page hashes, parent hashes, token ids, offered at): puts awaited."""

    async def setup(self) -> None:
        self.events = KVEventPublisher(self.worker_id, self.host_id)
        self.core = StoreCore(self.config, on_event=self.events.record)  # checks --hicache-size now

    def routes(self):
        host = {"host_id": self.host_id}
        return [(KV_STORE_ATTACH, self.handle_attach, host), (KV_STORE_LEASE, self.handle_lease, host),
                (KV_STORE_LOOKUP, self.handle_lookup, host), (KV_STORE_OFFER, self.handle_offer, host),
                (KV_STORE_PUT, self.handle_put, host), (KV_STORE_FETCH, self.handle_fetch, host),
                (KV_EVENTS_DUMP, self.handle_dump, {"worker_id": self.worker_id})]

    async def start(self, bus) -> None:
        self.receiver = await KVReceiver.open(bus, self.worker_id, self.host_id, "nats")
        self.sender = KVSender(bus, self.worker_id, self.host_id, backends=("nats",))
        await super().start(bus)
        await bus.subscribe(KV_STORE_COMMIT, self.handle_commit, host_id=self.host_id)
        await bus.subscribe(KV_STORE_TOUCH, self.handle_touch, host_id=self.host_id)
        self.events.start(bus)
        self.metrics_server = await start_metrics(self.metrics.registry, self.config.metrics_host,
                                                  self.config.metrics_port, f"kv_store {self.worker_id}")

    async def stop(self) -> None:
        await super().stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self.events is not None:
            await self.events.close()
        if self.receiver is not None:
            await self.receiver.close()
            await self.sender.close(grace=0)
            self.receiver = self.sender = None
        self._offers.clear()
        if self.core is not None:
            self.core.close()

    async def handle_attach(self, req: KVStoreAttachRequest) -> KVStoreAttachReply:
        try:
            arena = self.core.attach(req.worker_id, req.layout_key, req.page_bytes, req.page_size, req.pool_bytes,
                                    req.reset_leases)
        except ConfigError as exc:
            log.error("%s", exc)
            raise Unavailable(str(exc)) from None
        layout = arena.layout
        return KVStoreAttachReply(arena_name=arena.name, num_slots=layout.num_slots, page_bytes=layout.page_bytes,
                                  page_size=layout.page_size)

    def _check_arena(self, name: str) -> bool:
        return self.core.arena is not None and self.core.arena.name == name

    async def handle_lease(self, req: KVStoreLeaseRequest) -> KVStoreLeaseReply:
        if not self._check_arena(req.arena_name):
            raise InvalidArgument(f"arena {req.arena_name!r} is not this store's: attach again")
        return KVStoreLeaseReply(slots=self.core.lease(req.worker_id, max(0, req.count)))

    async def handle_commit(self, event: KVStoreCommitEvent) -> None:
        if self._check_arena(event.arena_name):
            self.core.commit(event.worker_id, list(zip(event.slots, event.page_hashes, event.parent_hashes)))

    async def handle_touch(self, event: KVStoreTouchEvent) -> None:
        self.core.touch(event.page_hashes)

    async def handle_lookup(self, req: KVStoreLookupRequest) -> KVStoreLookupReply:
        if req.first_of:
            first = await asyncio.to_thread(self.core.find_first, req.page_hashes)  # L3 reads may touch disk
            found = [first] if first is not None else []
        else:
            found = await asyncio.to_thread(self.core.lookup, req.page_hashes)
        arena = self.core.arena
        return KVStoreLookupReply(arena_name=arena.name if arena else "", page_hashes=[h for h, _ in found],
                                  slots=[s for _, s in found])

    # ---- engines on other hosts: pages by value through the transfer layer ----------------

    def _check_layout(self, worker_id: str, layout_key: str) -> None:
        if self.core.arena is None:
            raise InvalidArgument("no engine attached yet: attach first")
        if layout_key != self.core.layout_key:
            raise InvalidArgument(f"kv_store holds pages of layout {self.core.layout_key!r}; "
                                  f"engine {worker_id} has {layout_key!r}")

    async def handle_offer(self, req: KVStoreOfferRequest) -> KVStoreOfferReply:
        self._check_layout(req.worker_id, req.layout_key)
        n = len(req.page_hashes)
        page_size = self.core.arena.layout.page_size
        if not (len(req.parent_hashes) == len(req.token_ids) == n) or n > MAX_REMOTE_PAGES:
            raise InvalidArgument(f"an offer names up to {MAX_REMOTE_PAGES} pages, each with a parent hash and "
                                  f"its token ids ({n} hashes, {len(req.parent_hashes)} parents, "
                                  f"{len(req.token_ids)} token lists)")
        if any(not 1 <= len(t) <= page_size for t in req.token_ids):  # fewer: a tail (a page's computed rows)
            raise InvalidArgument(f"every offered page holds 1 to {page_size} tokens")
        now = time.monotonic()
        for tid in [t for t, o in self._offers.items() if now - o[4] > self.config.transfer_timeout]:
            del self._offers[tid]  # never put: the engine gave up or died
            self.receiver.cancel(tid)
        with self.core.lock:
            wanted = [i for i, h in enumerate(req.page_hashes) if self.core.index.get(h) is None]
        if not wanted:
            return KVStoreOfferReply(wanted=[])
        if len(self._offers) >= MAX_OFFERS:  # a flood of offers never put: refuse, hold nothing more
            raise Unavailable(f"kv_store: {len(self._offers)} offers await their pages; offer again later")
        tid = uuid.uuid4().hex
        target = self.receiver.expect(tid, sender_host_id=req.sender_host_id, sender_backends=("nats",))
        self._offers[tid] = (req.worker_id, [req.page_hashes[i] for i in wanted],
                             [req.parent_hashes[i] for i in wanted], [list(req.token_ids[i]) for i in wanted], now)
        return KVStoreOfferReply(wanted=wanted, target=target)

    async def handle_put(self, req: KVStorePutRequest) -> KVStorePutReply:
        tid = req.transfer.transfer_id
        offer = self._offers.get(tid)
        if offer is None or offer[0] != req.worker_id:
            raise InvalidArgument(f"transfer {tid} was not offered by {req.worker_id} (or the offer expired)")
        del self._offers[tid]
        _, hashes, parents, tokens, _ = offer
        page_bytes = self.core.arena.layout.page_bytes if self.core.arena is not None else 0
        if list(req.transfer.shape) != [len(hashes), page_bytes] or req.transfer.dtype != "uint8":
            self.receiver.cancel(tid)
            raise InvalidArgument(f"transfer {tid} must be [{len(hashes)}, {page_bytes}] uint8, "
                                  f"got {list(req.transfer.shape)} {req.transfer.dtype}")
        pages = await self.receiver.receive(req.transfer, timeout=self.config.transfer_timeout)

        def store() -> int:
            rows = pages.numpy()
            return sum(self.core.put(h, p, t, rows[i]) is not None
                       for i, (h, p, t) in enumerate(zip(hashes, parents, tokens)))

        stored = await asyncio.to_thread(store)
        with self.core.lock:  # the counters are read under it (metrics)
            self.core.counters["remote_in"] += len(hashes)
        return KVStorePutReply(stored=stored)

    async def handle_fetch(self, req: KVStoreFetchRequest) -> KVStoreFetchReply:
        self._check_layout(req.worker_id, req.layout_key)
        limit = max(0, min(req.max_pages, MAX_REMOTE_PAGES))
        parents, tokens, data = await asyncio.to_thread(self.core.read_pages, req.page_hashes, limit)
        if not tokens:
            return KVStoreFetchReply(page_hashes=[], parent_hashes=[], token_ids=[])
        descriptor = await self.sender.send(req.target, torch.from_numpy(np.ascontiguousarray(data)))
        with self.core.lock:
            self.core.counters["remote_out"] += len(tokens)
        return KVStoreFetchReply(page_hashes=list(req.page_hashes[: len(tokens)]), parent_hashes=parents,
                                 token_ids=tokens, transfer=descriptor)

    async def handle_dump(self, req: KVDumpRequest) -> KVDumpReply:
        pages = self.core.stored_pages()
        events = [KVEvent(kind="stored", tier="host", page_hashes=[h for h, _ in pages],
                          parent_hashes=[p for _, p in pages])]
        disk = self.core.disk
        if disk is not None:
            events.append(KVEvent(kind="stored", tier="disk", page_hashes=list(disk.pages),
                                  parent_hashes=[0] * len(disk.pages)))
        return KVDumpReply(worker_id=self.worker_id, host_id=self.host_id, event_id=self.events.event_id,
                           events=events)

    def health_detail(self) -> dict[str, str]:
        core = self.core
        if core is None or core.index is None:
            return {"attached": "0"}
        idx = core.index
        detail = {"slots": str(idx.num_slots), "stored": str(idx.num_stored), "leased": str(idx.num_leased),
                  "free": str(len(idx.free)), "disk_pages": str(len(core.disk)) if core.disk else "0"}
        detail.update({k: str(v) for k, v in core.counters.items()})
        return detail
