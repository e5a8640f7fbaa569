"""Engine workers on the bus: the aggregated worker and the decode worker.

Both serve ``kvbus.v1.worker.{id}.generate``: a WorkerGenerateRequest in, a
stream of TokenChunks out. The aggregated worker (role ``worker``) prefills
and decodes in its own engine; the decode worker (role ``decode``) receives the
prompt's KV pages from a prefill worker when the router names one, and prefills
locally otherwise (short prompts: conditional disaggregation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from bus.errors import InvalidArgument, Unavailable
from bus.subjects import WORKER_GENERATE, WORKER_HEARTBEAT
from schemas.engine import RequestOutput
from schemas.worker import TokenChunk, WorkerGenerateRequest, WorkerHeartbeatEvent, WorkerLoad
from services.actor import Actor
from services.workers.admission import Admission
from services.workers.config import WorkerConfig, default_host_id

log = logging.getLogger(__name__)


class EngineWorker(Actor):
    """What every engine-holding role shares: the engine, admission, heartbeats."""

    config_class = WorkerConfig

    def __init__(self, config: WorkerConfig, *, worker_id: str | None = None, engine=None):
        super().__init__(config, worker_id=worker_id)
        self.engine = engine
        self.host_id = config.host_id or default_host_id()
        self._heartbeat_task: asyncio.Task | None = None
        self.is_draining = False
        self.num_admitting = 0
        """Requests admitted but not yet in the engine (prefilling remotely, or receiving KV)."""
        self.admission = Admission(config.max_running_requests, config.max_queue, config.max_queue_wait)

    async def setup(self) -> None:
        if self.engine is None:
            from services.engine import LLMEngine

            self.engine = await LLMEngine.create(self.config.engine_config)

    async def start(self, bus) -> None:
        await super().start(bus)
        c = self.config
        if c.speculative_method and c.draft_placement == "remote" and self.engine.drafter is None:
            from services.draft.client import BusDrafter

            self.engine.set_drafter(BusDrafter(
                bus, asyncio.get_running_loop(), self.worker_id, timeout=c.draft_timeout,
                cost_per_token=0.0 if c.speculative_method == "ngram" else 0.4,
            ))
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop(self) -> None:
        await super().stop()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
            self._heartbeat_task = None
        if self.bus is not None:  # a last word so the router drops us at once
            self.is_draining = True
            try:
                await self.bus.publish(WORKER_HEARTBEAT, self.heartbeat())
            except Exception:
                pass
        if self.engine is not None:
            await self.engine.aclose()

    # --- load and admission -------------------------------------------------------------
    def load(self) -> WorkerLoad:
        engine = self.engine
        bm = engine.block_manager
        waiting = list(engine.scheduler.waiting)
        return WorkerLoad(
            num_running=engine.num_running, num_waiting=engine.num_waiting + self.num_admitting,
            num_free_pages=bm.num_free_pages, num_total_pages=bm.num_pages,
            num_queued_prefill_tokens=sum(s.num_uncomputed_tokens for s in waiting),
        )

    def heartbeat(self) -> WorkerHeartbeatEvent:
        return WorkerHeartbeatEvent(
            worker_id=self.worker_id, role=self.role, host_id=self.host_id, load=self.load(),
            model=self.engine.model_dir.name, page_size=self.config.page_size,
            transfer_backends=["shm", "nats"], interval_s=self.config.heartbeat_interval,
            is_draining=self.is_draining or not self.is_ready,
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.bus.publish(WORKER_HEARTBEAT, self.heartbeat())
            except Exception as exc:  # NATS away: it reconnects by itself; one line, no traceback
                log.warning("heartbeat not sent: %s", exc or type(exc).__name__)
            await asyncio.sleep(self.config.heartbeat_interval)

    async def drain(self, timeout: float) -> None:
        """Say we are draining at once, so routers stop sending work before our next beat."""
        self.is_draining = True
        try:
            await self.bus.publish(WORKER_HEARTBEAT, self.heartbeat())
        except Exception as exc:
            log.warning("draining heartbeat not sent: %s", exc or type(exc).__name__)

    def admit(self, deadline_s: float | None = None, max_tokens: int | None = None) -> None:
        """Refuse work past max_running_requests plus the bounded queue, or that would wait too long."""
        if self.is_draining:  # before the capacity check: unavailable sends the caller elsewhere
            raise Unavailable(f"worker {self.worker_id} is draining")
        engine = self.engine
        in_system = engine.num_running + engine.num_waiting + self.num_admitting
        self.admission.check(in_system, deadline_s, f"worker {self.worker_id}", max_tokens)

    def health_detail(self) -> dict[str, str]:
        if self.engine is None:
            return {}
        load = self.load()
        detail = {"running": str(load.num_running), "waiting": str(load.num_waiting),
                  "refused": str(self.admission.num_refused),
                  "free_pages": str(load.num_free_pages), "total_pages": str(load.num_total_pages)}
        st = self.engine.stats
        if self.engine.drafter is not None:  # speculative decoding
            detail.update(spec_drafted=str(st.num_drafted_tokens), spec_accepted=str(st.num_accepted_tokens),
                          spec_acceptance=f"{st.acceptance_rate:.3f}",
                          spec_draft_share=f"{st.draft_seconds / st.step_seconds if st.step_seconds else 0.0:.3f}")
        return detail


async def coalesce(first: RequestOutput, rest: AsyncIterator[RequestOutput], interval: int,
                   first_timings: dict[str, float] | None = None) -> AsyncIterator[TokenChunk]:
    """Group engine outputs into chunks of ``interval`` tokens (the last chunk may be shorter)."""
    ids: list[int] = []
    text: list[str] = []
    logprobs: list = []
    timings = first_timings

    async def outputs():
        from services.engine.outputs import RequestError

        async with contextlib.aclosing(rest):  # leaving early aborts the engine request now, not at GC
            yield first
            try:
                async for out in rest:
                    yield out
            except RequestError as exc:  # the engine failed this request alone
                raise InvalidArgument(str(exc)) from None

    async with contextlib.aclosing(outputs()) as stream:
        async for out in stream:
            ids += out.new_token_ids
            text.append(out.new_text)
            if out.logprobs:
                logprobs += out.logprobs
            if out.finished or len(ids) >= interval:
                yield TokenChunk(token_ids=ids, text="".join(text), finish_reason=out.finish_reason,
                                 usage=out.usage, logprobs=logprobs or None, timings=timings)
                ids, text, logprobs, timings = [], [], [], None
                if out.finished:
                    return


class WorkerActor(EngineWorker):
    """Aggregated worker: prefill and decode in one engine."""

    role = "worker"

    def routes(self):
        return [(WORKER_GENERATE, self.handle_generate, {"worker_id": self.worker_id})]

    async def handle_generate(self, req: WorkerGenerateRequest) -> AsyncIterator[TokenChunk]:
        from services.engine import RequestError

        self.admit(req.deadline_s, req.sampling.max_tokens)
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        self.num_admitting += 1
        try:
            outputs = await self.start_outputs(req, timings)
            first = await anext(outputs)
        except RequestError as exc:
            raise InvalidArgument(str(exc)) from None
        except StopAsyncIteration:
            return
        finally:
            self.num_admitting -= 1
        timings["first_token_s"] = time.monotonic() - t0
        interval = max(req.stream_interval, self.config.stream_interval)
        async with contextlib.aclosing(coalesce(first, outputs, interval, timings)) as chunks:
            async for chunk in chunks:
                yield chunk
                if chunk.finish_reason is not None and chunk.usage is not None:
                    self.admission.observe_finished(time.monotonic() - t0, chunk.usage.completion_tokens)

    async def start_outputs(self, req: WorkerGenerateRequest,
                            timings: dict[str, float]) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for ``req`` (here: prefill locally)."""
        if req.prefill_worker_id is not None:
            raise InvalidArgument(f"worker {self.worker_id} is aggregated: it takes no prefill worker")
        return self.engine.generate(req.prompt_token_ids, req.sampling, request_id=req.request_id)
