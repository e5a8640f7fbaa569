"""Prefill worker: computes prompts' KV pages and first tokens, pushes the pages to decoders.

Prompts from many decoders batch together in the engine (chunked prefill with
its token budget, prefix cache reuse); each finished prompt's first token is
streamed back at once, then its pages are copied out, pushed with the KV
transfer layer (the descriptor follows the token) and released to the prefix
cache.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from bus import tracing
from bus.errors import InvalidArgument
from bus.subjects import PREFILL
from bus.tracing import names as trace_names
from schemas.worker import PrefillChunk, PrefillRequest
from services.workers import trace_spans
from services.workers.actor import EngineWorker


class PrefillActor(EngineWorker):
    role = "prefill"

    def __init__(self, config, *, worker_id=None, engine=None):
        super().__init__(config, worker_id=worker_id, engine=engine)
        self.sender = None
        self.num_prefilled = 0

    def routes(self):
        return [(PREFILL, self.handle_prefill, {"worker_id": self.worker_id})]

    async def start(self, bus) -> None:
        from services.transfer import KVSender

        self.sender = KVSender(bus, self.worker_id, self.host_id)
        await super().start(bus)

    async def stop(self) -> None:
        if self.sender is not None:
            await self.sender.close()
        await super().stop()

    async def handle_prefill(self, req: PrefillRequest) -> AsyncIterator[PrefillChunk]:
        """Streams the first token the moment it is sampled (the decode worker passes it on to the
        caller while the pages travel), then the pages' transfer descriptor."""
        from services.engine import RequestError

        trace = tracing.RequestTrace.current()
        trace.set({trace_names.WORKER_ID: self.worker_id})
        self.admit(req.deadline_s)
        t0 = time.monotonic()
        timeline = trace_spans.track(self, req.request_id, trace)  # the engine's stages, if traced
        try:
            await self.prefetch_tiers(req.prompt_token_ids)  # host-tier hits load instead of recomputing
            try:
                result = await self.engine.prefill(req.prompt_token_ids, req.sampling, request_id=req.request_id,
                                                   skip_pages=req.skip_pages)
            except RequestError as exc:
                raise InvalidArgument(str(exc)) from None
            t1 = time.monotonic()
            trace_spans.record_engine_stages(self, trace, timeline, ended_at=t1)
            timeline = None
            yield PrefillChunk(first_token_id=result.first_token_id, num_cached_tokens=result.num_cached_tokens,
                               first_logprob=result.first_logprob, timings={"prefill_s": t1 - t0})
            with trace.stage(trace_names.KV_SEND, {trace_names.BACKEND: req.transfer.backend,
                                                   trace_names.PAGES: result.kv.shape[0] if result.kv.dim() else 0,
                                                   trace_names.PAGES_SKIPPED: req.skip_pages}) as send:
                descriptor = await self.sender.send(req.transfer, result.kv, scales=result.kv_scales)
                send.set({trace_names.BYTES: descriptor.num_bytes, trace_names.CHUNKS: descriptor.num_chunks})
            self.num_prefilled += 1
            self.admission.observe_finished(time.monotonic() - t0, 1)
            yield PrefillChunk(first_token_id=result.first_token_id, kv=descriptor,
                               num_cached_tokens=result.num_cached_tokens,
                               timings={"transfer_send_s": time.monotonic() - t1})
        finally:  # (a prefill that failed or was cancelled: its stages so far)
            trace_spans.record_engine_stages(self, trace, timeline, ended_at=time.monotonic())

    def health_detail(self) -> dict[str, str]:
        return {**super().health_detail(), "prefilled": str(self.num_prefilled)}
