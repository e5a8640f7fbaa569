"""Cost functions: how much a worker would cost a request. Lower is better.

A cost takes the request's :class:`RouteContext` and one :class:`WorkerState`
and returns a float; policies rank workers by a tuple of costs (the first
decides, the rest break ties, the worker id last). New costs (the kv policy's
"prefill tokens left after cache overlap credits") are plain functions here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from services.router.workers import WorkerState


@dataclasses.dataclass(frozen=True, slots=True)
class RouteContext:
    """What a policy may look at: the request, and for the prefill stage the chosen decoder."""

    request_id: str
    prompt_token_ids: Sequence[int]
    session_id: str | None = None
    decode_worker: WorkerState | None = None
    """Set when choosing the prefill worker: the decode worker that will receive the pages."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


Cost = Callable[[RouteContext, WorkerState], float]


def num_requests(ctx: RouteContext, worker: WorkerState) -> float:
    """Decode load: running + waiting requests (plus those routed since the last heartbeat)."""
    return worker.num_requests


def fewer_free_pages(ctx: RouteContext, worker: WorkerState) -> float:
    """Tie-break for decode: more free KV pages costs less."""
    return -worker.load.num_free_pages


def num_prefill_tokens(ctx: RouteContext, worker: WorkerState) -> float:
    """Prefill load: prompt tokens queued for prefill (plus those routed since the last heartbeat)."""
    return worker.num_prefill_tokens


def other_host(ctx: RouteContext, worker: WorkerState) -> float:
    """Tie-break for prefill: a worker on the decoder's host can hand pages over in shared memory."""
    if ctx.decode_worker is None:
        return 0.0
    return 0.0 if worker.host_id == ctx.decode_worker.host_id else 1.0


def lowest_cost(ctx: RouteContext, workers: Sequence[WorkerState], costs: Sequence[Cost]) -> WorkerState:
    """The worker with the smallest cost tuple; the worker id breaks the last tie."""
    if not workers:
        raise ValueError("lowest_cost needs at least one worker")
    return min(workers, key=lambda w: (*(cost(ctx, w) for cost in costs), w.worker_id))
