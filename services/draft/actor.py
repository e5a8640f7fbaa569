"""The draft service: ``kvbus serve draft``, a drafter shared by decode workers over the bus.

Every DRAFT_PROPOSE request carries, per sequence, the tokens its stream gained
since the previous call; the actor applies them (open on base 0, commit else; a
stream it does not hold at ``base`` answers ``resync``) and proposes. Requests
that arrive while a batch is being drafted wait and go together in the next
``propose_many`` call (one batched forward per draft token for the model
drafter). Drafting runs off the event loop, one batch at a time, so the
drafter's state is only ever touched by one thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from bus.errors import InvalidArgument, Unavailable
from bus.subjects import DRAFT_CLOSE, DRAFT_PROPOSE
from schemas.draft import DraftCloseEvent, DraftProposeReply, DraftProposeRequest, DraftResult
from services.actor import Actor
from services.draft.base import Drafter, drafter_class
from services.draft.config import DraftConfig
from services.draft.metrics import DraftMetrics
from services.metrics_http import start_metrics

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: DraftProposeRequest
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DraftActor(Actor):
    """Drafts tokens for speculative decoding (ngram or a small model) for any number of decode workers."""

    role = "draft"
    config_class = DraftConfig

    def __init__(self, config: DraftConfig, *, worker_id: str | None = None, drafter: Drafter | None = None):
        super().__init__(config, worker_id=worker_id)
        self.drafter = drafter
        self.lengths: OrderedDict[str, int] = OrderedDict()  # request -> stream length held (LRU)
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._closed: list[str] = []
        self._loop_task: asyncio.Task | None = None
        self.num_batches = 0
        self.metrics = DraftMetrics(num_waiting=self._queue.qsize, num_streams=lambda: len(self.lengths))
        self.metrics_server = None  # GET /metrics when config.metrics_port

    async def setup(self) -> None:
        if self.drafter is None:
            from services.models import resolve_model

            c = self.config
            target = await asyncio.to_thread(resolve_model, c.model)
            self.drafter = await asyncio.to_thread(
                drafter_class(c.speculative_method).from_config, c, target_dir=str(target))
        self._loop_task = asyncio.create_task(self._batch_loop(), name="draft-batch-loop")
        self.metrics_server = await start_metrics(self.metrics.registry, self.config.metrics_host,
                                                  self.config.metrics_port, f"draft {self.worker_id}")

    async def start(self, bus) -> None:
        await super().start(bus)
        await bus.subscribe(DRAFT_CLOSE, self.handle_close)

    async def stop(self) -> None:
        await super().stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(Unavailable("draft service is shutting down"))

    def routes(self):
        return [(DRAFT_PROPOSE, self.handle_propose, {})]

    def health_detail(self) -> dict[str, str]:
        return {"drafter": getattr(self.drafter, "name", ""), "streams": str(len(self.lengths)),
                "batches": str(self.num_batches)}

    async def handle_propose(self, req: DraftProposeRequest) -> DraftProposeReply:
        for item in req.items:
            if item.base < 0 or item.k < 0 or (item.base == 0 and not item.tokens):
                raise InvalidArgument(f"bad draft item for {item.request_id!r}: base={item.base}, k={item.k}")
        job = _Job(req)
        self._queue.put_nowait(job)
        return await job.future

    async def handle_close(self, event: DraftCloseEvent) -> None:
        self._closed.extend(event.request_ids)

    async def _batch_loop(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            closed, self._closed = self._closed, []
            try:
                replies = await asyncio.to_thread(self._draft, [j.request for j in jobs], closed)
            except Exception as exc:  # a drafter bug fails this batch, not the service
                log.exception("drafting a batch of %d requests failed", len(jobs))
                self.metrics.failed_batches.inc()
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(Unavailable(f"drafting failed: {exc}"))
                continue
            self.num_batches += 1
            for j, reply in zip(jobs, replies):
                if not j.future.done():
                    j.future.set_result(reply)

    def _draft(self, requests: list[DraftProposeRequest], closed: list[str]) -> list[DraftProposeReply]:
        """On the drafting thread: apply stream updates, propose for every item of every request."""
        started = time.perf_counter()
        d = self.drafter
        for rid in closed:
            self.lengths.pop(rid, None)
            d.close(rid)
        cap = self.config.num_speculative_tokens
        wants: dict[str, int] = {}
        resync: set[str] = set()
        for req in requests:
            for item in req.items:
                held = self.lengths.get(item.request_id)
                if item.base == 0:
                    d.open(item.request_id, item.tokens)
                elif held != item.base:
                    resync.add(item.request_id)
                    continue
                elif item.tokens:
                    d.commit(item.request_id, item.tokens)
                self.lengths[item.request_id] = item.base + len(item.tokens)
                self.lengths.move_to_end(item.request_id)
                if item.k > 0:
                    wants[item.request_id] = min(item.k, cap)
        while len(self.lengths) > self.config.max_streams:
            rid, _ = self.lengths.popitem(last=False)
            d.close(rid)
        proposals = d.propose_many(wants) if wants else {}
        made = [p for p in proposals.values() if p is not None]
        replies = []
        for req in requests:
            items = []
            for item in req.items:
                rid = item.request_id
                prop = proposals.get(rid)
                if rid in resync:
                    items.append(DraftResult(request_id=rid, resync=True))
                elif prop is None:
                    items.append(DraftResult(request_id=rid, position=self.lengths.get(rid, 0)))
                else:
                    items.append(DraftResult(request_id=rid, position=prop.position, tokens=list(prop.tokens)))
            replies.append(DraftProposeReply(items=items))
        self.metrics.observe_batch(len(requests), time.perf_counter() - started, len(made),
                                   sum(len(p.tokens) for p in made), len(resync))
        return replies
