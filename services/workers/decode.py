"""Decode worker: takes prefilled requests (KV pages from a prefill worker) into its batch.

When the router names no prefill worker (short prompts, no prefill worker
alive) the decode worker prefills locally. The prefill worker's first token is
streamed to the caller as soon as it arrives; the request joins the batch when
its pages follow. A prefill that fails before its first token is retried once
locally; pages that do not arrive after it are computed here (from the prompt
and that token), so a dead prefill worker costs time, never the request;
the prefill worker's heartbeats are watched meanwhile, so its death is known
within ``peer_ttl`` seconds, not the transfer timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from bus import tracing
from bus.errors import BusError, InvalidArgument, Unavailable
from bus.tracing import names as trace_names
from bus.subjects import PREFILL
from schemas.worker import PrefillRequest, WorkerGenerateRequest
from services.liveness import WorkerLiveness
from services.workers import trace_spans
from services.workers.actor import WorkerActor

log = logging.getLogger(__name__)


class DecodeActor(WorkerActor):
    role = "decode"

    def __init__(self, config, *, worker_id=None, engine=None):
        from services.transfer import backend_names

        super().__init__(config, worker_id=worker_id, engine=engine)
        self.receiver = None
        self.liveness = None
        self.num_remote_prefills = 0
        self.num_local_prefills = 0
        self.num_kept_local = 0  # of those: a prefill worker was named, but the remainder was short
        self.num_kept_behind = 0  # of those: short only after the pages a local prefill here is computing
        # local prefills (with local_prefill_tokens) until their first token: request id -> prompt page hashes
        self._computing: dict[str, set[int]] = {}
        self.num_prefill_failures = 0
        self.num_transfers = dict.fromkeys(backend_names(), 0)  # KV imports by transfer backend
        self.transfer_bytes = 0  # KV payload received from prefill workers
        self.transfer_pages = 0
        self.transfer_pages_skipped = 0  # prompt pages not sent: this worker held them
        self.last_transfer_s = 0.0  # first token .. pages handed to the engine, of the last import
        self._page_tasks: set[asyncio.Task] = set()  # imports whose pages are in transit

    async def start(self, bus) -> None:
        from services.transfer import KVReceiver

        self.receiver = await KVReceiver.open(bus, self.worker_id, self.host_id, self.config.kv_transfer)
        self.liveness = WorkerLiveness(self.config.peer_ttl)
        await self.liveness.start(bus)
        await super().start(bus)

    async def stop(self) -> None:
        for task in list(self._page_tasks):
            task.cancel()
        await asyncio.gather(*self._page_tasks, return_exceptions=True)
        await super().stop()
        if self.liveness is not None:
            await self.liveness.stop()
        if self.receiver is not None:
            await self.receiver.close()

    async def start_outputs(self, req: WorkerGenerateRequest, timings: dict[str, float]):
        cfg = self.config
        bm = self.engine.block_manager
        # the prompt's page hashes, once: for the tiers, and for the pages local prefills compute
        hashes = self.prompt_page_hashes(req.prompt_token_ids) if bm.enable_prefix_caching else None
        if req.prefill_worker_id is not None:
            # Pages this worker holds (L1, or L2 loaded at admission) need not cross, nor be computed.
            held = await self.prefetch_tiers(req.prompt_token_ids, hashes) \
                if cfg.transfer_missing_only or cfg.local_prefill_tokens else 0
            left = len(req.prompt_token_ids) - held * bm.page_size
            behind = self._computing_here(hashes, held) if left > cfg.local_prefill_tokens else 0
            if left - behind * bm.page_size <= cfg.local_prefill_tokens:
                self.num_kept_local += 1  # a short remainder: computing it here beats a transfer
                self.num_kept_behind += behind > 0
            else:
                try:
                    return await self._remote_prefill(req, timings, held if cfg.transfer_missing_only else 0)
                except BusError as exc:
                    if isinstance(exc, InvalidArgument):
                        raise
                    self.num_prefill_failures += 1
                    log.warning("prefill on %s failed for %s (%s: %s); prefilling locally",
                                req.prefill_worker_id, req.request_id, exc.code.value, exc.message)
        self.num_local_prefills += 1
        await self.prefetch_tiers(req.prompt_token_ids, hashes)
        outputs = self.engine.generate(req.prompt_token_ids, req.sampling, request_id=req.request_id)
        if not cfg.local_prefill_tokens or hashes is None:
            return outputs
        self._computing[req.request_id] = set(hashes)
        return self._computing_until_first(req.request_id, outputs)

    # ---- prompts that share a prefix a local prefill is computing --------------------------------
    # Four conversations that open with the same system prompt arrive at once. The first is short
    # enough to prefill here; the next is not, by the system prompt's length, and would go to the
    # prefill worker, which computes the system prompt again. Counted as held, the pages a local
    # prefill here is computing leave it a short remainder too: it stays, and the engine's
    # scheduler holds it until those pages are cached (docs/engine.md, "Scheduler policy").

    def _computing_here(self, hashes: list[int] | None, held: int) -> int:
        """How many of the prompt's pages (``hashes``; None: no prefix cache) after the ``held``
        leading ones a local prefill here is computing."""
        if not self._computing or hashes is None:
            return 0
        run = held
        while run < len(hashes) and any(hashes[run] in pages for pages in self._computing.values()):
            run += 1
        return run - held

    async def _computing_until_first(self, request_id: str, outputs):
        """``outputs``, with ``request_id``'s prompt pages counted as computing here until its
        first token (they are cached then) or its end."""
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    self._computing.pop(request_id, None)
                    yield out
        finally:
            self._computing.pop(request_id, None)

    async def _remote_prefill(self, req: WorkerGenerateRequest, timings: dict[str, float], skip: int):
        """Prefill on the named worker, ``skip`` leading pages held here; its first token streams
        to the caller at once, and the request joins this engine's batch when its pages have
        arrived (``_take_pages``)."""
        transfer_id = uuid.uuid4().hex
        target = self.receiver.expect(transfer_id, sender_host_id=req.prefill_host_id,
                                      sender_backends=self.liveness.transfer_backends(req.prefill_worker_id))
        t0 = time.monotonic()
        timeout = self.config.transfer_timeout
        if req.deadline_s is not None:
            timeout = max(min(timeout, req.deadline_s), 0.001)
        peer = req.prefill_worker_id
        stream = None
        call = tracing.RequestTrace.current().open(trace_names.REMOTE_PREFILL, {
            trace_names.PREFILL_WORKER: peer, trace_names.BACKEND: target.backend, trace_names.PAGES_SKIPPED: skip})
        try:
            with call.activated():  # the prefill worker's spans hang under this one
                stream = self.bus.stream(
                    PREFILL, PrefillRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                            sampling=req.sampling, transfer=target, deadline_s=timeout,
                                            skip_pages=skip),
                    timeout=timeout, worker_id=peer)
            try:
                first = await self.liveness.guard(anext(stream), peer, f"prefill of {req.request_id}")
            except StopAsyncIteration:
                raise Unavailable(f"prefill worker {peer} ended the prefill of {req.request_id} "
                                  f"without a token") from None
        except BaseException as exc:
            call.fail(exc)
            call.end()
            self.receiver.cancel(transfer_id)
            if stream is not None:
                await stream.aclose()
            raise
        call.set({trace_names.CACHED_TOKENS: first.num_cached_tokens})
        call.end()
        timings.update({**first.timings, "prefill_call_s": time.monotonic() - t0})
        self.num_remote_prefills += 1
        outputs = self.engine.generate_prefilled(
            req.prompt_token_ids, first.first_token_id, None, req.sampling, request_id=req.request_id,
            num_cached_tokens=first.num_cached_tokens, first_logprob=first.first_logprob, kv_first_page=skip)
        return self._with_pages(outputs, req, stream, transfer_id, skip)

    async def _with_pages(self, outputs, req: WorkerGenerateRequest, stream, transfer_id: str, skip: int):
        """The engine's outputs of a request whose pages are in transit. Its first output (the
        prefill worker's token) submits it; then a task takes the pages in. The task is not
        cancelled when the caller leaves: it claims what was sent (a shared-memory segment would
        otherwise wait for its sender's reaper) and the engine drops pages of a request gone."""
        task = None
        try:
            first = await anext(outputs)
            task = asyncio.create_task(self._take_pages(req, stream, transfer_id, skip), name=f"kv-{transfer_id}")
            self._page_tasks.add(task)
            task.add_done_callback(self._page_tasks.discard)
            yield first
            async for out in outputs:
                yield out
        finally:
            if task is None:
                self.receiver.cancel(transfer_id)
                await stream.aclose()
            await outputs.aclose()

    async def _take_pages(self, req: WorkerGenerateRequest, stream, transfer_id: str, skip: int) -> None:
        """Receive the pages of a request streaming from a remote prefill and hand them to the
        engine; if they do not come (prefill worker died, transfer failed), the engine computes
        the prompt here instead (the caller already has the first token, so no retry elsewhere)."""
        peer = req.prefill_worker_id
        t0 = time.monotonic()
        trace = tracing.RequestTrace.current()  # (this task's context is its request's)
        try:
            try:
                reply = await self.liveness.guard(anext(stream), peer, f"pages of {req.request_id}")
                if reply.kv is None:
                    raise Unavailable(f"prefill worker {peer} sent a second token, not pages")
                kv = await self.liveness.guard(self.receiver.receive(reply.kv, timeout=self.config.transfer_timeout),
                                               peer, f"KV transfer {transfer_id}")
            finally:
                self.receiver.cancel(transfer_id)
                await stream.aclose()
        except asyncio.CancelledError:
            self.engine.provide_kv(req.request_id, None)
            raise
        except Exception as exc:  # noqa: BLE001 (whatever failed, the request must go on here)
            trace.record(trace_names.KV_RECEIVE, t0, time.monotonic(), {trace_names.PREFILL_WORKER: peer},
                         error=(exc.code.value, exc.message) if isinstance(exc, BusError) else ("internal", str(exc)))
            self.num_prefill_failures += 1
            log.warning("pages of %s from %s did not arrive (%s); computing its prompt here", req.request_id,
                        peer, exc.message if isinstance(exc, BusError) else (str(exc) or type(exc).__name__))
            self.engine.provide_kv(req.request_id, None)
            return
        self.num_transfers[reply.kv.backend] = self.num_transfers.get(reply.kv.backend, 0) + 1
        num_pages = kv.shape[0] if kv.dim() else 0
        if skip and num_pages == -(-len(req.prompt_token_ids) // self.engine.block_manager.page_size):
            skip = 0  # a prefill worker that predates skip_pages sent every page: take them all
        self.transfer_bytes += reply.kv.num_bytes
        self.transfer_pages += num_pages
        self.transfer_pages_skipped += skip
        self.last_transfer_s = time.monotonic() - t0
        self.engine.provide_kv(req.request_id, kv, reply.kv.scales, kv_first_page=skip)
        if trace.is_recording:
            now = time.monotonic()
            trace_spans.kv_arrived(self, req.request_id, now)
            trace.record(trace_names.KV_RECEIVE, t0, now, {
                trace_names.PREFILL_WORKER: peer, trace_names.BACKEND: reply.kv.backend,
                trace_names.BYTES: reply.kv.num_bytes, trace_names.PAGES: num_pages,
                trace_names.CHUNKS: reply.kv.num_chunks, trace_names.PAGES_SKIPPED: skip})

    def health_detail(self) -> dict[str, str]:
        return {**super().health_detail(), "remote_prefills": str(self.num_remote_prefills),
                "local_prefills": str(self.num_local_prefills), "kept_local": str(self.num_kept_local),
                "kept_behind": str(self.num_kept_behind),
                "prefill_failures": str(self.num_prefill_failures),
                "transfer_bytes": str(self.transfer_bytes), "transfer_pages": str(self.transfer_pages),
                "transfer_pages_skipped": str(self.transfer_pages_skipped),
                "last_transfer_s": f"{self.last_transfer_s:.4f}",
                "import_gaps": str(self.engine.scheduler.num_import_gaps),
                **{f"transfers_{name}": str(n) for name, n in self.num_transfers.items()}}
