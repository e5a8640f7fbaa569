"""The routing decision, without a bus: registry + sessions + policy + config -> RouteReply.

Order of a decision:
1. decode candidates: alive workers of role ``decode`` or ``worker``
   (``decode`` only when disaggregation is ``always``), minus the request's
   ``exclude_worker_ids``; none -> Unavailable;
2. a session (``session_id``) pinned to one of them that is not busy stays there;
   otherwise the policy chooses among those not busy (all busy -> Overloaded),
   and the session is pinned (or moved, counted) to the choice;
3. a separate prefill worker is used when the decoder is a ``decode`` worker,
   the mode is ``always``, or the mode is ``auto``, a prefill worker is alive and
   the policy's ``num_tokens_to_prefill`` (the uncached part, for ``kv``) is at least
   ``min_disagg_tokens`` (else the decode worker prefills locally: conditional
   disaggregation); candidates must share the decoder's model and page size; all
   busy -> Overloaded.

The reply carries the policy's prediction of the prompt tokens the prefilling worker finds cached;
workers report what they really found in their heartbeats, and :meth:`Router.observe` compares.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence

from bus.errors import InvalidArgument, Overloaded, Unavailable
from schemas.kv_store import KVDumpReply, KVEventBatchEvent
from schemas.worker import PrefixReport, RouteReply, RouteRequest, WorkerHeartbeatEvent
from services.router.config import RouterConfig
from services.router.metrics import RouterMetrics
from services.router.policy import Policy, make_policy
from services.router.scoring import RouteContext
from services.router.sessions import SessionTable
from services.router.workers import Clock, WorkerRegistry, WorkerState

log = logging.getLogger(__name__)

MAX_PREDICTIONS = 10_000
"""Decisions remembered until their worker reports the request (the oldest are dropped)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int


class Router:
    def __init__(self, config: RouterConfig, *, clock: Clock = time.monotonic,
                 policy: Policy | None = None, rng: random.Random | None = None):
        self.config = config
        self.clock = clock
        self.policy = policy or make_policy(config.policy, rng=rng or random.Random(config.seed), config=config,
                                            clock=clock)
        self.workers = WorkerRegistry(config.worker_ttl, clock=clock, on_leave=self._on_leave)
        self.sessions = SessionTable(config.session_ttl, config.max_sessions, clock=clock)
        self.metrics = RouterMetrics(self)
        self._predictions: OrderedDict[str, Prediction] = OrderedDict()
        self.num_reports_matched = 0

    # --- what the router hears ----------------------------------------------------------
    def observe(self, event: WorkerHeartbeatEvent) -> None:
        if self.workers.observe(event):
            log.info("worker %s (%s on %s) joined", event.worker_id, event.role, event.host_id)
            state = self.workers.get(event.worker_id)
            if state is not None:
                self.policy.on_worker_joined(state)
        for report in event.prefix_reports:
            self._check_prediction(event.worker_id, report)

    def observe_kv(self, batch: KVEventBatchEvent) -> None:
        self.policy.on_kv_events(batch)

    def observe_dump(self, reply: KVDumpReply) -> None:
        self.policy.on_kv_dump(reply)

    def dump_failed(self, publisher_id: str, *, no_responders: bool) -> None:
        self.policy.on_kv_dump_failed(publisher_id, no_responders=no_responders)

    def tick(self) -> None:
        """Periodic upkeep: silent workers, idle sessions, the policy's own expiries."""
        self.workers.expire()
        self.sessions.expire()
        self.policy.tick()

    # --- the decision -------------------------------------------------------------------
    def route(self, req: RouteRequest) -> RouteReply:
        started = time.perf_counter()
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
        decode, reason = self._choose_decode(ctx, decode_pool, excluded)

        prefill = None
        if self._wants_prefill_worker(ctx, decode, prefill_pool):
            compatible = [w for w in prefill_pool if w.model == decode.model and w.page_size == decode.page_size]
            if compatible:
                ctx = dataclasses.replace(ctx, decode_worker=decode)
                prefill = self.policy.choose("prefill", ctx, self._ready(compatible, "prefill"))
            elif mode == "always":
                raise Unavailable(f"no prefill worker matches decode worker {decode.worker_id} "
                                  f"(model {decode.model!r}, page size {decode.page_size})")

        prefilling = prefill or decode
        num_cached = self.policy.num_cached_tokens(ctx, prefilling)
        num_prefill = self.policy.num_tokens_to_prefill(ctx, prefilling)
        # the decoder's new KV: the prompt's pages it does not hold (those it holds are shared, and show
        # in its next heartbeat once as pages in use, however many requests share them)
        num_new = num_prefill if prefill is None else self.policy.num_tokens_to_prefill(ctx, decode)
        self.workers.note_routed(decode.worker_id, num_requests=1, num_tokens=num_new,
                                 num_prefill_tokens=0 if prefill else num_prefill)
        if prefill is not None:
            self.workers.note_routed(prefill.worker_id, num_prefill_tokens=num_prefill)
        self.policy.on_routed(ctx, decode, prefill)
        self._remember(req.request_id, Prediction(decode.worker_id, ctx.num_prompt_tokens, num_cached))
        name = self.policy.name
        self.metrics.observe_decision(name, "decode", reason)
        if prefill is not None:
            self.metrics.observe_decision(name, "prefill", self.policy.reason("prefill", ctx, prefill))
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        return RouteReply(decode_worker_id=decode.worker_id,
                          prefill_worker_id=prefill.worker_id if prefill else None, policy=name,
                          prefill_host_id=prefill.host_id if prefill else None,
                          num_cached_tokens=num_cached, reason=reason)

    # --- steps ------------------------------------------------------------------------
    def _pool(self, roles: Sequence[str], excluded: set[str]) -> list[WorkerState]:
        return [w for w in self.workers.alive(roles) if w.worker_id not in excluded]

    def _choose_decode(self, ctx: RouteContext, pool: list[WorkerState],
                       excluded: set[str]) -> tuple[WorkerState, str]:
        """The session's worker if it can take the request, else the policy's choice; and why."""
        session_id = ctx.session_id if self.sessions.is_enabled else None
        pin = self.sessions.get(session_id) if session_id else None
        moved = None
        if pin is not None:
            pinned = next((w for w in pool if w.worker_id == pin.worker_id), None)
            if pinned is not None and not pin.has_left and not self.is_busy(pinned, "decode"):
                self.sessions.pin(session_id, pinned.worker_id)
                return pinned, "session"
            moved = ("left" if pin.has_left or (pinned is None and pin.worker_id not in excluded)
                     else "excluded" if pinned is None else "busy")
        decode = self.policy.choose("decode", ctx, self._ready(pool, "decode"))
        if session_id:
            self.sessions.pin(session_id, decode.worker_id, moved=moved)
        return decode, self.policy.reason("decode", ctx, decode)

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
        self.sessions.worker_left(state.worker_id)
        self.policy.forget(state.worker_id)

    # --- accuracy -----------------------------------------------------------------------
    def _remember(self, request_id: str, prediction: Prediction) -> None:
        self._predictions[request_id] = prediction
        self._predictions.move_to_end(request_id)
        while len(self._predictions) > MAX_PREDICTIONS:
            self._predictions.popitem(last=False)

    def _check_prediction(self, worker_id: str, report: PrefixReport) -> None:
        """Compare a worker's report with this router's prediction for the request. The gateway names
        a worker request ``{request id}-{attempt}``; a NATS client may reuse the routed id as is."""
        request_id = report.request_id
        prediction = self._predictions.get(request_id)
        if prediction is None:
            request_id = request_id.rpartition("-")[0]
            prediction = self._predictions.get(request_id)
        if prediction is None or prediction.worker_id != worker_id \
                or prediction.num_prompt_tokens != report.num_prompt_tokens:
            return  # another replica's decision, or a request this router did not route
        del self._predictions[request_id]
        self.num_reports_matched += 1
        self.metrics.observe_report(prediction.num_cached_tokens, report.num_cached_tokens)

    def detail(self) -> dict[str, str]:
        """Health output: sessions, accuracy and the policy's numbers."""
        m = self.metrics
        return {"sessions": str(len(self.sessions)), "session_pins": str(self.sessions.num_pins),
                **{f"session_moves_{k}": str(v) for k, v in sorted(self.sessions.num_moves.items())},
                "reports_matched": str(self.num_reports_matched),
                "cached_tokens_predicted": str(m.num_cached_predicted),
                "cached_tokens_reported": str(m.num_cached_reported), "cached_tokens_exact": str(m.num_exact),
                **{f"kv_{k}": str(v) for k, v in self.policy.detail().items()},
                # each worker as this router sees it: the last heartbeat plus what it sent since
                **{f"load_{w.worker_id}": f"{w.num_requests} requests, {w.num_active_tokens} KV tokens, "
                                          f"{w.num_prefill_tokens} to prefill" for w in self.workers.alive()}}
