"""Decode worker: takes prefilled requests (KV pages from a prefill worker) into its batch.

When the router names no prefill worker (short prompts, no prefill worker
alive) the decode worker prefills locally. A prefill or transfer that fails is
retried once locally, so a dead prefill worker costs time, never the request;
the prefill worker's heartbeats are watched meanwhile, so its death is known
within ``peer_ttl`` seconds, not the transfer timeout.
"""

from __future__ import annotations

import logging
import time
import uuid

from bus.errors import BusError, InvalidArgument, Unavailable
from bus.subjects import PREFILL
from schemas.worker import PrefillRequest, WorkerGenerateRequest
from services.liveness import WorkerLiveness
from services.workers.actor import WorkerActor

log = logging.getLogger(__name__)


class DecodeActor(WorkerActor):
    role = "decode"

    def __init__(self, config, *, worker_id=None, engine=None):
        super().__init__(config, worker_id=worker_id, engine=engine)
        self.receiver = None
        self.liveness = None
        self.num_remote_prefills = 0
        self.num_local_prefills = 0
        self.num_prefill_failures = 0
        self.num_transfers = {"shm": 0, "nats": 0}
        self.transfer_bytes = 0  # KV payload received from prefill workers
        self.transfer_pages = 0
        self.transfer_pages_skipped = 0  # prompt pages not sent: this worker held them

    async def start(self, bus) -> None:
        from services.transfer import KVReceiver

        self.receiver = await KVReceiver.open(bus, self.worker_id, self.host_id, self.config.kv_transfer)
        self.liveness = WorkerLiveness(self.config.peer_ttl)
        await self.liveness.start(bus)
        await super().start(bus)

    async def stop(self) -> None:
        await super().stop()
        if self.liveness is not None:
            await self.liveness.stop()
        if self.receiver is not None:
            await self.receiver.close()

    async def start_outputs(self, req: WorkerGenerateRequest, timings: dict[str, float]):
        if req.prefill_worker_id is not None:
            try:
                return await self._remote_prefill(req, timings)
            except BusError as exc:
                if isinstance(exc, InvalidArgument):
                    raise
                self.num_prefill_failures += 1
                log.warning("prefill on %s failed for %s (%s: %s); prefilling locally",
                            req.prefill_worker_id, req.request_id, exc.code.value, exc.message)
        self.num_local_prefills += 1
        await self.prefetch_tiers(req.prompt_token_ids)
        return self.engine.generate(req.prompt_token_ids, req.sampling, request_id=req.request_id)

    async def _remote_prefill(self, req: WorkerGenerateRequest, timings: dict[str, float]):
        """Prefill on the named worker, receive the pages, and start decoding from them."""
        transfer_id = uuid.uuid4().hex
        target = self.receiver.expect(transfer_id, sender_host_id=req.prefill_host_id)
        t0 = time.monotonic()
        timeout = self.config.transfer_timeout
        if req.deadline_s is not None:
            timeout = max(min(timeout, req.deadline_s), 0.001)
        peer = req.prefill_worker_id
        try:
            # Pages this worker holds need not cross; the L2 ones are loaded at admission.
            skip = await self.prefetch_tiers(req.prompt_token_ids) if self.config.transfer_missing_only else 0
            reply = await self.liveness.guard(self.bus.request(
                PREFILL, PrefillRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                        sampling=req.sampling, transfer=target, deadline_s=timeout,
                                        skip_pages=skip),
                timeout=timeout, worker_id=peer), peer, f"prefill of {req.request_id}")
            t1 = time.monotonic()
            try:
                kv = await self.liveness.guard(self.receiver.receive(reply.kv, timeout=self.config.transfer_timeout),
                                               peer, f"KV transfer {transfer_id}")
            except InvalidArgument as exc:  # a fault between the workers, not in the caller's request
                raise Unavailable(f"KV transfer {transfer_id} from {req.prefill_worker_id} failed: "
                                  f"{exc.message}") from None
        except BaseException:
            self.receiver.cancel(transfer_id)
            raise
        t2 = time.monotonic()
        timings.update({**reply.timings, "prefill_call_s": t1 - t0, "transfer_receive_s": t2 - t1})
        self.num_remote_prefills += 1
        self.num_transfers[reply.kv.backend] = self.num_transfers.get(reply.kv.backend, 0) + 1
        num_pages = kv.shape[0] if kv.dim() else 0
        if skip and num_pages == -(-len(req.prompt_token_ids) // self.engine.block_manager.page_size):
            skip = 0  # a prefill worker that predates skip_pages sent every page: take them all
        self.transfer_bytes += reply.kv.num_bytes
        self.transfer_pages += num_pages
        self.transfer_pages_skipped += skip
        return self.engine.generate_prefilled(
            req.prompt_token_ids, reply.first_token_id, kv, req.sampling, request_id=req.request_id,
            num_cached_tokens=reply.num_cached_tokens, first_logprob=reply.first_logprob,
            kv_scales=reply.kv.scales, kv_first_page=skip)

    def health_detail(self) -> dict[str, str]:
        return {**super().health_detail(), "remote_prefills": str(self.num_remote_prefills),
                "local_prefills": str(self.num_local_prefills),
                "prefill_failures": str(self.num_prefill_failures),
                "transfer_bytes": str(self.transfer_bytes), "transfer_pages": str(self.transfer_pages),
                "transfer_pages_skipped": str(self.transfer_pages_skipped),
                "import_gaps": str(self.engine.scheduler.num_import_gaps),
                **{f"transfers_{name}": str(n) for name, n in self.num_transfers.items()}}
