"""A drafter that asks the draft service over the bus (``--draft-placement remote``).

It implements the drafter protocol for the engine, which calls it on its own
thread: ``propose_many`` sends one DRAFT_PROPOSE for all of a step's sequences
through the worker's event loop and waits at most ``timeout`` seconds. No answer
in time (a slow, dead or restarting service) means plain decoding for that step,
and for ``backoff`` seconds the engine does not wait on the service at all: a
dead drafter costs one timeout per backoff period, never a stall. The service's
streams are a cache: whatever it may have missed is resent whole (``resync``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

from bus.subjects import DRAFT_CLOSE, DRAFT_PROPOSE
from schemas.draft import DraftCloseEvent, DraftItem, DraftProposeRequest
from services.draft.base import Drafter, Proposal

log = logging.getLogger(__name__)


class BusDrafter(Drafter):
    name = "remote"

    def __init__(self, bus, loop: asyncio.AbstractEventLoop, worker_id: str, *, timeout: float = 0.05,
                 backoff: float = 2.0, cost_per_token: float = 0.0):
        self.bus, self.loop, self.worker_id = bus, loop, worker_id
        self.timeout, self.backoff = timeout, backoff
        self.cost_per_token = cost_per_token
        self.streams: dict[str, list[int]] = {}
        self.synced: dict[str, int] = {}  # stream length the service holds (0: send it whole)
        self.down_until = 0.0
        self.num_calls = 0
        self.num_failures = 0
        self.round_trip_seconds = 0.0

    def has(self, request_id: str) -> bool:
        return request_id in self.streams

    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.streams[request_id] = list(prompt_ids)
        self.synced[request_id] = 0

    def commit(self, request_id: str, tokens: Sequence[int]) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.extend(tokens)

    def close(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is None:
            return
        if self.synced.pop(request_id, 0) and not self._on_loop_thread():
            asyncio.run_coroutine_threadsafe(self._publish_close([request_id]), self.loop)

    async def _publish_close(self, ids: list[str]) -> None:
        try:
            await self.bus.publish(DRAFT_CLOSE, DraftCloseEvent(request_ids=ids))
        except Exception:  # the service forgets idle streams anyway (LRU)
            log.debug("draft close not sent", exc_info=True)

    def _on_loop_thread(self) -> bool:
        return getattr(self.loop, "_thread_id", None) == threading.get_ident()

    def propose(self, request_id: str, k: int) -> Proposal | None:
        return self.propose_many({request_id: k}).get(request_id)

    def propose_many(self, wants: dict[str, int]) -> dict[str, Proposal | None]:
        now = time.monotonic()
        if now < self.down_until or self._on_loop_thread() or self.loop.is_closed():
            return {}
        items, lengths = [], {}
        for rid, k in wants.items():
            stream = self.streams[rid]
            base = self.synced[rid]
            items.append(DraftItem(request_id=rid, base=base, tokens=stream[base:], k=k))
            lengths[rid] = len(stream)
        request = DraftProposeRequest(worker_id=self.worker_id, items=items)
        self.num_calls += 1
        future = asyncio.run_coroutine_threadsafe(
            self.bus.request(DRAFT_PROPOSE, request, timeout=self.timeout), self.loop
        )
        try:
            reply = future.result(timeout=self.timeout)
        except Exception as exc:
            future.cancel()
            self.num_failures += 1
            self.down_until = time.monotonic() + self.backoff
            for rid in wants:  # unknown whether the update arrived: resend whole next time
                self.synced[rid] = 0
            log.warning("draft service did not answer in %.0f ms (%s); plain decoding for %.1f s",
                        self.timeout * 1e3, type(exc).__name__, self.backoff)
            return {}
        finally:
            self.round_trip_seconds += time.monotonic() - now
        out: dict[str, Proposal | None] = {}
        for r in reply.items:
            if r.request_id not in lengths:
                continue
            if r.resync:
                self.synced[r.request_id] = 0
                continue
            self.synced[r.request_id] = lengths[r.request_id]
            if r.tokens:
                out[r.request_id] = Proposal(position=r.position, tokens=list(r.tokens))
        return out
