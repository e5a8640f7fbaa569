"""The routing decision, without a bus: registry + policy + config -> RouteReply.

Order of a decision:
1. decode candidates: alive workers of role ``decode`` or ``worker``
   (``decode`` only when disaggregation is ``always``), minus the request's
   ``exclude_worker_ids``; none -> Unavailable; all busy -> Overloaded;
2. the policy chooses the decode worker;
3. a separate prefill worker is used when the decoder is a ``decode`` worker,
   the mode is ``always``, or the mode is ``auto``, a prefill worker is alive and
   the policy's ``num_tokens_to_prefill`` is at least ``min_disagg_tokens``
   (else the decode worker prefills locally: conditional disaggregation);
   candidates must share the decoder's model and page size; all busy -> Overloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence

from bus.errors import InvalidArgument, Overloaded, Unavailable
from schemas.worker import RouteReply, RouteRequest, WorkerHeartbeatEvent
from services.router.config import RouterConfig
from services.router.policy import Policy, make_policy
from services.router.scoring import RouteContext
from services.router.workers import Clock, WorkerRegistry, WorkerState

log = logging.getLogger(__name__)


class Router:
    def __init__(self, config: RouterConfig, *, clock: Clock = time.monotonic,
                 policy: Policy | None = None, rng: random.Random | None = None):
        self.config = config
        self.policy = policy or make_policy(config.policy, rng=rng or random.Random(config.seed))
        self.workers = WorkerRegistry(config.worker_ttl, clock=clock, on_leave=self._on_leave)

    def observe(self, event: WorkerHeartbeatEvent) -> None:
        if self.workers.observe(event):
            log.info("worker %s (%s on %s) joined", event.worker_id, event.role, event.host_id)

    def route(self, req: RouteRequest) -> RouteReply:
        if not req.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty")
        mode = self.config.disaggregation
        excluded = set(req.exclude_worker_ids)
        ctx = RouteContext(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                           session_id=req.session_id)

        decode_roles = ("decode",) if mode == "always" else ("decode", "worker")
        decode_pool = self._pool(decode_roles, excluded)
        prefill_pool = self._pool(("prefill",), excluded) if mode != "never" else []
        if mode == "always" and not prefill_pool:
            raise Unavailable(self._none_alive("prefill", ("prefill",), excluded) + " (disaggregation=always)")
        if not decode_pool:
            raise Unavailable(self._none_alive("decode", decode_roles, excluded))
        decode = self.policy.choose("decode", ctx, self._ready(decode_pool, "decode"))

        prefill = None
        if self._wants_prefill_worker(ctx, decode, prefill_pool):
            compatible = [w for w in prefill_pool if w.model == decode.model and w.page_size == decode.page_size]
            if compatible:
                ctx = dataclasses.replace(ctx, decode_worker=decode)
                prefill = self.policy.choose("prefill", ctx, self._ready(compatible, "prefill"))
            elif mode == "always":
                raise Unavailable(f"no prefill worker matches decode worker {decode.worker_id} "
                                  f"(model {decode.model!r}, page size {decode.page_size})")

        num_prefill = self.policy.num_tokens_to_prefill(ctx, prefill or decode)
        self.workers.note_routed(decode.worker_id, num_requests=1,
                                 num_prefill_tokens=0 if prefill else num_prefill)
        if prefill is not None:
            self.workers.note_routed(prefill.worker_id, num_prefill_tokens=num_prefill)
        return RouteReply(decode_worker_id=decode.worker_id,
                          prefill_worker_id=prefill.worker_id if prefill else None, policy=self.policy.name,
                          prefill_host_id=prefill.host_id if prefill else None)

    # --- steps ------------------------------------------------------------------------
    def _pool(self, roles: Sequence[str], excluded: set[str]) -> list[WorkerState]:
        return [w for w in self.workers.alive(roles) if w.worker_id not in excluded]

    def _wants_prefill_worker(self, ctx: RouteContext, decode: WorkerState,
                              prefill_pool: list[WorkerState]) -> bool:
        if decode.role != "decode" or not prefill_pool:
            return False  # aggregated workers prefill themselves; "never" passes no pool
        if self.config.disaggregation == "always":
            return True
        return self.policy.num_tokens_to_prefill(ctx, decode) >= self.config.min_disagg_tokens

    def is_busy(self, worker: WorkerState, stage: str) -> bool:
        cfg = self.config
        if cfg.min_free_page_fraction > 0 and worker.free_page_fraction < cfg.min_free_page_fraction:
            return True
        if stage == "prefill":
            return 0 < cfg.max_prefill_tokens_per_worker <= worker.num_prefill_tokens
        return 0 < cfg.max_requests_per_worker <= worker.num_requests

    def _ready(self, pool: list[WorkerState], stage: str) -> list[WorkerState]:
        ready = [w for w in pool if not self.is_busy(w, stage)]
        if not ready:
            cfg = self.config
            limit = (f"max_prefill_tokens_per_worker={cfg.max_prefill_tokens_per_worker}" if stage == "prefill"
                     else f"max_requests_per_worker={cfg.max_requests_per_worker}")
            raise Overloaded(f"all {len(pool)} {stage} workers are busy ({limit}, "
                             f"min_free_page_fraction={cfg.min_free_page_fraction:g}); retry later",
                             retry_after=1.0)
        return ready

    def _none_alive(self, stage: str, roles: Sequence[str], excluded: set[str]) -> str:
        alive = self.workers.alive(roles)
        what = f"no {stage} worker (role {' or '.join(roles)}) is available"
        if alive:
            return f"{what}: all {len(alive)} alive were excluded by the request"
        return f"{what}: none has sent a heartbeat in the last {self.config.worker_ttl:g}s"

    def _on_leave(self, state: WorkerState, reason: str) -> None:
        log.info("worker %s (%s) left: %s", state.worker_id, state.role, reason)
        self.policy.forget(state.worker_id)
