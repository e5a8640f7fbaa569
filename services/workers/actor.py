"""Engine workers on the bus: the aggregated worker and the decode worker.

Both serve ``kvbus.v1.worker.{id}.generate``: a WorkerGenerateRequest in, a
stream of TokenChunks out. The aggregated worker (role ``worker``) prefills
and decodes in its own engine; the decode worker (role ``decode``) receives the
prompt's KV pages from a prefill worker when the router names one, and prefills
locally otherwise (short prompts: conditional disaggregation).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from bus import tracing
from bus.errors import InvalidArgument, Unavailable
from bus.tracing import names as trace_names
from bus.subjects import KV_EVENTS_DUMP, WORKER_GENERATE, WORKER_HEARTBEAT
from schemas.kv_store import KVDumpReply, KVDumpRequest
from schemas.engine import RequestOutput
from schemas.worker import (
    MAX_PREFIX_REPORTS,
    PrefixReport,
    TokenChunk,
    WorkerGenerateRequest,
    WorkerHeartbeatEvent,
    WorkerLoad,
)
from services.actor import Actor
from services.engine.page_hash import SCHEME as PAGE_HASH_SCHEME
from services.metrics_http import start_metrics
from services.workers.admission import Admission
from services.workers.config import WorkerConfig, default_host_id
from services.workers import trace_spans
from services.workers.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class EngineWorker(Actor):
    """What every engine-holding role shares: the engine, admission, heartbeats."""

    config_class = WorkerConfig

    def __init__(self, config: WorkerConfig, *, worker_id: str | None = None, engine=None):
        super().__init__(config, worker_id=worker_id)
        if engine is not None:  # built by a test: an LLMEngine is driven through its own AsyncEngine
            from services.engine.async_api import AsyncEngine

            engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
        self.engine = engine
        """The AsyncEngine this worker streams from (its engine's state reads through it)."""
        self.host_id = config.host_id or default_host_id()
        self._heartbeat_task: asyncio.Task | None = None
        self.is_draining = False
        self.num_admitting = 0
        """Requests admitted but not yet in the engine (prefilling remotely, or receiving KV)."""
        self.admission = Admission(config.max_running_requests, config.max_queue, config.max_queue_wait)
        self.tier = None  # HiCache client (services/kv_store/client.py) when config.hicache
        self.kv_events = None
        self._tier_task: asyncio.Task | None = None
        self.metrics = WorkerMetrics(self)
        self.metrics_server = None  # GET /metrics when config.metrics_port
        self.prefix_reports: collections.deque[PrefixReport] = collections.deque(maxlen=MAX_PREFIX_REPORTS)
        """Finished requests' cached prompt tokens, for routers to check their predictions (next heartbeat)."""

    async def setup(self) -> None:
        from services.kv_store.events import DeviceEventHooks, KVEventPublisher

        self.kv_events = KVEventPublisher(self.worker_id, self.host_id)
        hooks = [DeviceEventHooks(self.kv_events)]
        if self.config.hicache:
            from services.kv_store.client import HostTierClient
            from services.kv_store.links import open_tier_link

            cfg = self.config
            # the host's own store maps its arena; another host's moves pages through the transfer layer
            link = open_tier_link(cfg, self.host_id, asyncio.get_running_loop())
            self.tier = HostTierClient(
                link, owner=self.worker_id,
                model=str(cfg.model or "default"), write_policy=cfg.hicache_write_policy,
                selective_hits=cfg.hicache_selective_hits, min_load_pages=cfg.hicache_min_load_pages,
                prefault=cfg.hicache_prefault)
            hooks.append(self.tier)
            self.metrics.attach_tier(self.tier)
        if self.engine is None:
            from services.engine.async_api import AsyncEngine

            self.engine = await AsyncEngine.create(self.config.engine_config, tier_hooks=hooks)
        else:  # an engine built by a test: plug the listeners in beside the ones it has
            from services.engine.tier_hooks import CacheTierHooks, TierHooksList

            bm, old = self.engine.block_manager, self.engine.block_manager.hooks
            before = old.hooks if isinstance(old, TierHooksList) else ([] if type(old) is CacheTierHooks else [old])
            for h in hooks:
                h.bind(self.engine.kv_pool)
            bm.hooks = TierHooksList([*before, *hooks])

    async def start(self, bus) -> None:
        await super().start(bus)
        c = self.config
        if c.speculative_method and c.draft_placement == "remote" and self.engine.drafter is None:
            from services.draft.base import drafter_class
            from services.draft.client import BusDrafter

            cost = drafter_class(c.speculative_method).cost_for(c, target_dir=str(self.engine.model_dir))
            self.engine.set_drafter(BusDrafter(bus, asyncio.get_running_loop(), self.worker_id,
                                               timeout=c.draft_timeout, cost_per_token=cost))
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        await bus.serve(KV_EVENTS_DUMP, self.handle_kv_dump, worker_id=self.worker_id)
        self.kv_events.start(bus)
        if self.tier is not None:
            self.tier.link.bus = bus
            self._tier_task = asyncio.create_task(self._tier_loop(), name="hicache-attach")
        self.metrics_server = await start_metrics(self.metrics.registry, c.metrics_host, c.metrics_port,
                                                  f"{self.role} {self.worker_id}")

    async def stop(self) -> None:
        await super().stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        for task in (self._heartbeat_task, self._tier_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._heartbeat_task = self._tier_task = None
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.bus is not None:  # a last word so the router drops us at once
            self.is_draining = True
            try:
                await self.bus.publish(WORKER_HEARTBEAT, self.heartbeat())
            except Exception:
                pass
        if self.engine is not None:
            await self.engine.aclose()
        if self.tier is not None:
            self.tier.close()  # ends the copy thread after the copies queued
            await self.tier.link.aclose()

    # --- HiCache and KV events ---------------------------------------------------------
    async def _tier_loop(self) -> None:
        """Attach to the host's kv_store, then check the attachment every interval (one small
        request): a restarted store has a new arena, which the tier switches to; while none
        answers the engine serves from pages still mapped (verified) and by recomputing."""
        tier, link = self.tier, self.tier.link
        while True:
            try:
                name, layout = await link.attach_async(**tier.attach_request())
                tier.use_arena(name, layout)
            except Exception as exc:
                link.healthy = False
                log.debug("kv_store not attached: %s", exc)
            await asyncio.sleep(self.config.hicache_reconnect_interval)

    async def prefetch_tiers(self, prompt_token_ids: list[int], hashes: list[int] | None = None) -> int:
        """Before queueing a request: learn which of its pages missing from L1 the host tier
        holds, so the engine's admission loads them without a bus round trip.

        Returns how many leading prompt pages this worker holds now: its prefix cache's run,
        then the host tier's (when at least ``hicache_min_load_pages``). A count, not a pin:
        pages may leave before the request is admitted (they are then recomputed). ``hashes``: the
        prompt's ``prompt_page_hashes``, where the caller has them.
        """
        from services.engine.page_hash import hash_tail

        bm = self.engine.block_manager
        if not bm.enable_prefix_caching:
            return 0
        if hashes is None:
            hashes = self.prompt_page_hashes(prompt_token_ids)
        start = 0
        while start < len(hashes) and hashes[start] in bm.hash_to_page_id:
            start += 1
        tier = self.tier
        if tier is None or not tier.is_attached or not tier.link.healthy:
            return start
        timeout = self.config.hicache_fetch_timeout if tier.link.moves_bytes else self.config.hicache_timeout
        held = start
        if start < len(hashes):
            try:
                async with asyncio.timeout(timeout):
                    in_l2 = await tier.prefetch(hashes[start:])
            except TimeoutError:
                return start
            held = start + (in_l2 if in_l2 >= self.config.hicache_min_load_pages else 0)
        if bm.reuse_tails and held:  # the computed rows of the page after them, if an earlier request
            # left them (a conversation's next turn; a cold prompt pays no second round trip)
            tails = [hash_tail(hashes[held - 1], t) for t in bm.tail_candidates(prompt_token_ids, held)]
            if tails and not any(h in bm.hash_to_page_id for h in tails):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await tier.prefetch_tail(tails)
        return held

    def prompt_page_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        """The chained hashes of the prompt's full pages before its last token (the pages a prefix
        cache can hold: the last token is always computed)."""
        from services.engine.page_hash import page_hashes

        size = self.engine.block_manager.page_size
        limit = (len(prompt_token_ids) - 1) // size
        return page_hashes(prompt_token_ids[: limit * size], size, self.config.cache_salt)

    async def handle_kv_dump(self, req: KVDumpRequest) -> KVDumpReply:
        hooks = self.engine.block_manager.hooks
        device = next((h for h in getattr(hooks, "hooks", [hooks]) if hasattr(h, "dump")), None)
        return KVDumpReply(worker_id=self.worker_id, host_id=self.host_id, event_id=self.kv_events.event_id,
                           events=device.dump() if device is not None else [])

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
        from services.transfer import available_backends  # what this process can send and receive by

        return WorkerHeartbeatEvent(
            worker_id=self.worker_id, role=self.role, host_id=self.host_id, load=self.load(),
            model=self.engine.model_dir.name, page_size=self.config.page_size,
            transfer_backends=list(available_backends()), interval_s=self.config.heartbeat_interval,
            is_draining=self.is_draining or not self.is_ready,
            hash_scheme=PAGE_HASH_SCHEME, hash_root=self.engine.block_manager.root_hash,
            prefix_reports=self.take_prefix_reports(),
        )

    def take_prefix_reports(self) -> list[PrefixReport]:
        """The cached prompt tokens of requests finished since the last heartbeat (each reported once):
        KV-aware routers check their predictions with them."""
        reports = list(self.prefix_reports)
        self.prefix_reports.clear()
        return reports

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
        bm = self.engine.block_manager  # the pool under pressure: recomputes and lost prefixes
        detail.update(preemptions=str(self.engine.scheduler.num_preemptions), pages_evicted=str(bm.num_evictions),
                      held_pages=str(bm.num_held_pages), held_pages_evicted=str(bm.holds.num_evicted))
        st = self.engine.stats
        if self.engine.drafter is not None:  # speculative decoding
            detail.update(spec_drafted=str(st.num_drafted_tokens), spec_accepted=str(st.num_accepted_tokens),
                          spec_acceptance=f"{st.acceptance_rate:.3f}",
                          spec_draft_share=f"{st.draft_seconds / st.step_seconds if st.step_seconds else 0.0:.3f}")
        if self.tier is not None:
            detail["hicache_attached"] = str(int(self.tier.is_attached))
            detail.update({f"hicache_{k}": f"{v:g}" for k, v in self.tier.stats.items()})
            detail.update({f"hicache_remote_{k}": f"{v:g}" for k, v in getattr(self.tier.link, "stats", {}).items()})
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

        trace = tracing.RequestTrace.current()
        trace.set({trace_names.WORKER_ID: self.worker_id, "kvbus.admission.running": self.engine.num_running,
                   "kvbus.admission.waiting": self.engine.num_waiting + self.num_admitting})
        self.admit(req.deadline_s, req.sampling.max_tokens)
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        timeline = trace_spans.track(self, req.request_id, trace)  # the engine's stages, if traced
        num_chunks = 0
        try:
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
                    num_chunks += 1
                    if chunk.finish_reason is not None and chunk.usage is not None:
                        self.admission.observe_finished(time.monotonic() - t0, chunk.usage.completion_tokens)
                        self.prefix_reports.append(PrefixReport(
                            request_id=req.request_id, num_prompt_tokens=chunk.usage.prompt_tokens,
                            num_cached_tokens=chunk.usage.cached_prompt_tokens))
        finally:
            trace.set({trace_names.NUM_CHUNKS: num_chunks})
            trace_spans.record_engine_stages(self, trace, timeline, ended_at=time.monotonic())

    async def start_outputs(self, req: WorkerGenerateRequest,
                            timings: dict[str, float]) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for ``req`` (here: prefill locally)."""
        if req.prefill_worker_id is not None:
            raise InvalidArgument(f"worker {self.worker_id} is aggregated: it takes no prefill worker")
        await self.prefetch_tiers(req.prompt_token_ids)
        return self.engine.generate(req.prompt_token_ids, req.sampling, request_id=req.request_id)
