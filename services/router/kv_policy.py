"""The ``kv`` policy: send a request where its prompt's KV pages are cached, weighed against load.

For each candidate, the cost of a stage is::

    kv_overlap_weight * (prompt tokens - credited cached tokens) + load

where a cached page is credited by tier (``kv_credit_device`` 1.0 in the worker's own pool,
``kv_credit_host`` 0.75 in its host's kv_store memory, ``kv_credit_disk`` 0.25 on its disk) and
the load is, in tokens, what the worker has queued to prefill plus what its running requests hold
(decode stage) or what it has queued to prefill (prefill stage). The lowest cost wins (ties: fewer
requests, or the decoder's host for a prefill worker, then the worker id); with
``router_temperature`` > 0 a worker is drawn by softmax of the normalised costs instead.

In disaggregated serving the decode worker is chosen by its own overlap (it holds the earlier turns
it decoded) and load, the prefill worker by its overlap and queued prefill tokens, and the router's
choice between prefilling on the decode worker and on a prefill worker compares the uncached length
this policy predicts with ``min_disagg_tokens``.

The cache is known from the KV index (``index.py``), fed by the hooks every policy has. A worker
whose page-hash scheme differs from the router's gets no overlap credit (warned once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from schemas.kv_store import KVDumpReply, KVEventBatchEvent
from services.router import scoring
from services.router.index import DEVICE, HOST, KVIndex
from services.router.policy import Policy, Stage
from services.router.prompt import SCHEME, PromptPages, unsalted_root
from services.router.scoring import NO_OVERLAP, Overlap, RouteContext, TierCredits
from services.router.workers import WorkerState

log = logging.getLogger(__name__)


class KVPolicy(Policy):
    name = "kv"
    wants_kv_events = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.config is None:
            from services.router.config import RouterConfig

            self.config = RouterConfig(policy="kv")
        cfg = self.config
        self.credits = TierCredits(cfg.kv_credit_device, cfg.kv_credit_host, cfg.kv_credit_disk)
        self.index = KVIndex(clock=self.clock, approx_ttl=cfg.kv_approx_ttl, publisher_ttl=cfg.kv_publisher_ttl)
        self._warned: set[str] = set()

    # --- the choice -----------------------------------------------------------------------
    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        costs = [self.cost(stage, ctx, w) for w in self._with_runs(ctx, candidates)]
        temperature = self.config.router_temperature
        if temperature > 0 and len(candidates) > 1:
            return candidates[scoring.softmax_choice(costs, temperature, self.rng)]
        tie = scoring.other_host if stage == "prefill" else scoring.num_requests
        return min(zip(costs, candidates), key=lambda cw: (cw[0], tie(ctx, cw[1]), cw[1].worker_id))[1]

    def cost(self, stage: Stage, ctx: RouteContext, worker: WorkerState) -> float:
        left = scoring.prefill_tokens_left(ctx, self.overlap(ctx, worker), self.credits)
        load = scoring.decode_load if stage == "decode" else scoring.prefill_load
        return self.config.kv_overlap_weight * left + load(ctx, worker)

    def num_cached_tokens(self, ctx: RouteContext, worker: WorkerState) -> int:
        return self.overlap(ctx, worker, with_tail=True).num_cached_tokens

    def reason(self, stage: Stage, ctx: RouteContext, worker: WorkerState) -> str:
        return "overlap" if self.overlap(ctx, worker, with_tail=True).num_cached_tokens else "load"

    # --- what a worker holds of the prompt ---------------------------------------------------
    def overlap(self, ctx: RouteContext, worker: WorkerState, *, with_tail: bool = False) -> Overlap:
        """The worker's cached run of the prompt's full pages (computed once per decision); ``with_tail``:
        and the rows of the page after them it holds (up to page_size - 1 tokens: what the worker will
        report, but too little to sway a choice, so only asked of the chosen worker)."""
        memo = ctx.memo.setdefault("kv_overlap", {})
        found = memo.get(worker.worker_id)
        if found is None:
            self._with_runs(ctx, [worker])
            found = memo[worker.worker_id]
        if with_tail and found.is_credited and not found.has_tail_checked:
            found = memo[worker.worker_id] = self._with_tail(ctx, worker, found)
        return found

    def _with_runs(self, ctx: RouteContext, workers: Sequence[WorkerState]) -> Sequence[WorkerState]:
        """Look up the overlap of every worker not looked up yet in this decision, in one walk over
        the prompt per page layout (they nearly always share one); returns ``workers``."""
        memo = ctx.memo.setdefault("kv_overlap", {})
        by_layout: dict[tuple[int, int], list[WorkerState]] = {}
        for w in workers:
            if w.worker_id in memo:
                continue
            if not self.can_match(w):
                memo[w.worker_id] = NO_OVERLAP
                continue
            by_layout.setdefault((w.page_size, w.hash_root or unsalted_root()), []).append(w)
        for group in by_layout.values():
            pages = self.prompt_pages(ctx, group[0])
            runs = self.index.match_all([(w.worker_id, w.host_id) for w in group], pages)
            for w, run in zip(group, runs):
                memo[w.worker_id] = Overlap(w.page_size, *run)
        return workers

    def _with_tail(self, ctx: RouteContext, worker: WorkerState, run: Overlap) -> Overlap:
        """``run`` and the tail after it. NOTE: not after zero pages: the 15 hashes that would cost
        every cold prompt find only tails of conversations shorter than one page."""
        tails = self.prompt_pages(ctx, worker).tails(run.num_pages) if run.num_pages else []
        found = self.index.find_tail(worker.worker_id, worker.host_id, [h for _, h in tails]) if tails else None
        if found is None:
            return run._replace(has_tail_checked=True)
        tier = "device" if found[1] == DEVICE else "host" if found[1] == HOST else "disk"
        return run._replace(num_tail_tokens=tails[found[0]][0], tail_tier=tier, has_tail_checked=True)

    def prompt_pages(self, ctx: RouteContext, worker: WorkerState) -> PromptPages:
        """The prompt hashed as this worker names pages (once per page size and root per decision)."""
        key = ("kv_pages", worker.page_size, worker.hash_root or unsalted_root())
        pages = ctx.memo.get(key)
        if pages is None:
            pages = ctx.memo[key] = PromptPages(ctx.prompt_token_ids, key[1], key[2])
        return pages

    def can_match(self, worker: WorkerState) -> bool:
        """Whether the router hashes as this worker does (an empty scheme: an older worker, ours)."""
        return worker.hash_scheme in ("", SCHEME)

    # --- hooks ----------------------------------------------------------------------------
    def on_worker_joined(self, worker: WorkerState) -> None:
        if not self.can_match(worker) and worker.worker_id not in self._warned:
            self._warned.add(worker.worker_id)
            log.warning("worker %s names KV pages by scheme %r, not %r: routed without overlap credit",
                        worker.worker_id, worker.hash_scheme, SCHEME)
        self.index.worker_joined(worker.worker_id, worker.host_id)

    def forget(self, worker_id: str) -> None:
        self._warned.discard(worker_id)
        self.index.worker_left(worker_id)

    def on_routed(self, ctx: RouteContext, decode: WorkerState, prefill: WorkerState | None) -> None:
        for worker in (decode, prefill):  # both hold the pages afterwards (the decoder receives them)
            if worker is not None and self.index.is_approximate(worker.worker_id) and self.can_match(worker):
                self.index.predict(worker.worker_id, self.prompt_pages(ctx, worker).hashes)

    def on_kv_events(self, batch: KVEventBatchEvent) -> None:
        self.index.apply_batch(batch)

    def on_kv_dump(self, reply: KVDumpReply) -> None:
        self.index.apply_dump(reply)

    def on_kv_dump_failed(self, publisher_id: str, *, no_responders: bool) -> None:
        self.index.dump_failed(publisher_id, no_responders=no_responders)

    def take_kv_dump_requests(self) -> list[str]:
        return self.index.take_dump_requests()

    def tick(self) -> None:
        self.index.expire()

    def detail(self) -> dict[str, int]:
        return self.index.stats()
