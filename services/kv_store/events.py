"""KV events: a publisher's ``stored``/``removed`` pages per tier, batched, with monotonic ids.

Engines and the kv_store each own one publisher. ``record`` may be called from
any thread (the engine thread, the store's lock holder); a task on the event
loop publishes what accumulated as one batch per ``interval`` (event id + 1 per
batch), so a consumer that sees ``event_id`` jump knows it missed something and
asks for a dump (``KV_EVENTS_DUMP``).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from bus.subjects import KV_EVENTS
from schemas.kv_store import KVEvent, KVEventBatchEvent
from services.engine.tier_hooks import CacheTierHooks

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, worker_id: str, host_id: str, *, interval: float = 0.05, max_pending: int = 100_000):
        self.worker_id, self.host_id, self.interval, self.max_pending = worker_id, host_id, interval, max_pending
        self.event_id = 0
        self._pending: list[tuple[str, str, list[int], list[int]]] = []  # runs of one kind and tier
        self._num_pending_pages = 0
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_dropped = 0

    def record(self, kind: str, tier: str, page_hashes: list[int], parent_hashes: list[int]) -> None:
        with self._lock:
            if self._num_pending_pages >= self.max_pending:  # nobody publishing: drop (ids will gap)
                self.num_dropped += len(page_hashes)
                return
            last = self._pending[-1] if self._pending else None
            if last is not None and last[0] == kind and last[1] == tier:
                last[2].extend(page_hashes)
                last[3].extend(parent_hashes)
            else:
                self._pending.append((kind, tier, list(page_hashes), list(parent_hashes)))
            self._num_pending_pages += len(page_hashes)

    def start(self, bus) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(bus), name="kv-events")

    def take(self) -> KVEventBatchEvent | None:
        with self._lock:
            if not self._pending:
                return None
            runs, self._pending, self._num_pending_pages = self._pending, [], 0
            self.event_id += 1
            events = [KVEvent(kind=k, tier=t, page_hashes=h, parent_hashes=p) for k, t, h, p in runs]
            return KVEventBatchEvent(worker_id=self.worker_id, host_id=self.host_id, event_id=self.event_id,
                                     events=events)

    async def _run(self, bus) -> None:
        while True:
            await asyncio.sleep(self.interval)
            batch = self.take()
            if batch is None:
                continue
            try:
                await bus.publish(KV_EVENTS, batch, worker_id=self.worker_id)
            except Exception as exc:  # the id still advanced: consumers see the gap
                log.warning("publishing KV events failed: %s", exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class DeviceEventHooks(CacheTierHooks):
    """An engine's listener (``tier_hooks``): its device pages stored and removed, as KV events."""

    def __init__(self, publisher: KVEventPublisher):
        self.publisher = publisher
        self.parents: dict[int, int] = {}  # page hash -> parent hash, for every page in L1

    def on_stored(self, page_hash, parent_hash, page_id) -> bool:
        self.parents[page_hash] = parent_hash
        self.publisher.record("stored", "device", [page_hash], [parent_hash])
        return False

    def on_removed(self, page_hash, page_id, *, clean) -> None:
        parent = self.parents.pop(page_hash, 0)
        self.publisher.record("removed", "device", [page_hash], [parent])

    def dump(self) -> list[KVEvent]:
        items = list(self.parents.items())
        return [KVEvent(kind="stored", tier="device", page_hashes=[h for h, _ in items],
                        parent_hashes=[p for _, p in items])]
