"""The KV feed: every publisher's KV events in, dumps asked for when the policy wants them.

Subscribes to ``kvbus.v1.kv_events.*`` without a queue group (every router replica hears every
publisher and keeps the whole index). After each batch, heartbeat and upkeep tick it asks the
policy which publishers need a dump (a worker that joined, a gap, a publisher heard of mid-stream,
a silent kv_store) and requests them on ``kvbus.v1.kv_events.{worker_id}.dump``, one in flight per
publisher; the answer, or the failure (no responders: nobody serves it; timeout or error: asked
again later), goes back to the policy. Handlers do no I/O themselves: dumps run as tasks.
"""

from __future__ import annotations

import asyncio
import logging

from bus.errors import BusError, NoResponders
from bus.subjects import KV_EVENTS, KV_EVENTS_DUMP
from schemas.kv_store import KVDumpRequest, KVEventBatchEvent
from services.router.core import Router

log = logging.getLogger(__name__)


class KVFeed:
    def __init__(self, router: Router, *, dump_timeout: float):
        self.router = router
        self.dump_timeout = dump_timeout
        self.bus = None
        self._subscription = None
        self._dumps: dict[str, asyncio.Task] = {}

    @property
    def is_needed(self) -> bool:
        return self.router.policy.wants_kv_events

    async def start(self, bus) -> None:
        self.bus = bus
        if self.is_needed:
            self._subscription = await bus.subscribe(KV_EVENTS, self.handle_batch)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None
        tasks = list(self._dumps.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._dumps.clear()

    async def handle_batch(self, batch: KVEventBatchEvent) -> None:
        self.router.observe_kv(batch)
        self.request_dumps()

    def request_dumps(self) -> None:
        """Start a dump for every publisher the policy wants one of now."""
        if self.bus is None or not self.is_needed:
            return
        for publisher_id in self.router.policy.take_kv_dump_requests():
            if publisher_id not in self._dumps:
                self._dumps[publisher_id] = asyncio.create_task(self._dump(publisher_id), name=f"kv-dump-{publisher_id}")

    async def _dump(self, publisher_id: str) -> None:
        try:
            reply = await self.bus.request(KV_EVENTS_DUMP, KVDumpRequest(), timeout=self.dump_timeout,
                                           worker_id=publisher_id)
        except asyncio.CancelledError:
            raise
        except NoResponders:
            log.info("KV publisher %s serves no dump: following it without one", publisher_id)
            self.router.dump_failed(publisher_id, no_responders=True)
        except (BusError, ValueError) as exc:
            log.warning("KV dump of %s failed (%s); asking again later", publisher_id, exc)
            self.router.dump_failed(publisher_id, no_responders=False)
        else:
            self.router.observe_dump(reply)
            log.debug("KV dump of %s: %d events as of id %d", publisher_id, len(reply.events), reply.event_id)
        finally:
            self._dumps.pop(publisher_id, None)
        self.request_dumps()  # held batches replayed after the dump may have found another gap
