"""The kv_store service (``kvbus serve kv_store``): HiCache's host (L2) and disk (L3) tiers.

One per host. It owns the shared-memory arena every engine on the host maps
and answers metadata only: attach, leases of empty slots, commits, lookups.
Page bytes never cross the bus on one host. It publishes ``stored``/``removed``
KV events for its tiers (``host``, ``disk``) and answers dumps for resync.
"""

from __future__ import annotations

import asyncio
import logging

from bus.errors import InvalidArgument, Unavailable
from bus.subjects import (
    KV_EVENTS_DUMP,
    KV_STORE_ATTACH,
    KV_STORE_COMMIT,
    KV_STORE_LEASE,
    KV_STORE_LOOKUP,
    KV_STORE_TOUCH,
)
from schemas.kv_store import (
    KVDumpReply,
    KVDumpRequest,
    KVEvent,
    KVStoreAttachReply,
    KVStoreAttachRequest,
    KVStoreCommitEvent,
    KVStoreLeaseReply,
    KVStoreLeaseRequest,
    KVStoreLookupReply,
    KVStoreLookupRequest,
    KVStoreTouchEvent,
)
from services.actor import Actor
from services.config import ConfigError
from services.kv_store.config import KVStoreConfig
from services.kv_store.events import KVEventPublisher
from services.kv_store.metrics import KVStoreMetrics
from services.kv_store.store import StoreCore
from services.metrics_http import start_metrics
from services.workers.config import default_host_id

log = logging.getLogger(__name__)


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

    async def setup(self) -> None:
        self.events = KVEventPublisher(self.worker_id, self.host_id)
        self.core = StoreCore(self.config, on_event=self.events.record)  # checks --hicache-size now

    def routes(self):
        host = {"host_id": self.host_id}
        return [(KV_STORE_ATTACH, self.handle_attach, host), (KV_STORE_LEASE, self.handle_lease, host),
                (KV_STORE_LOOKUP, self.handle_lookup, host),
                (KV_EVENTS_DUMP, self.handle_dump, {"worker_id": self.worker_id})]

    async def start(self, bus) -> None:
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
        found = await asyncio.to_thread(self.core.lookup, req.page_hashes)  # L3 reads may touch disk
        arena = self.core.arena
        return KVStoreLookupReply(arena_name=arena.name if arena else "", page_hashes=[h for h, _ in found],
                                  slots=[s for _, s in found])

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
