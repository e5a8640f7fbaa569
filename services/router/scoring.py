"""Cost functions: how much a worker would cost a request. Lower is better.

A cost takes the request's :class:`RouteContext` and one :class:`WorkerState`
and returns a float; policies rank workers by a tuple of costs (the first
decides, the rest break ties, the worker id last). The kv policy's cost is
built from plain functions here too: :func:`prefill_tokens_left` (after tiered
overlap credits), :func:`decode_load`, :func:`prefill_load`, and
:func:`softmax_choice` for sampling by cost.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from services.router.workers import WorkerState


@dataclasses.dataclass(frozen=True, slots=True)
class RouteContext:
    """What a policy may look at: the request, and for the prefill stage the chosen decoder."""

    request_id: str
    prompt_token_ids: Sequence[int]
    session_id: str | None = None
    decode_worker: WorkerState | None = None
    """Set when choosing the prefill worker: the decode worker that will receive the pages."""
    memo: dict = dataclasses.field(default_factory=dict)
    """Per-decision scratch for policies (the prompt's page hashes, each worker's overlap), shared by
    the decode and prefill stages of one decision."""

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


# --- the kv policy's cost ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class TierCredits:
    """How much of a page's prefill a cached copy saves, by where the copy is."""

    device: float = 1.0
    host: float = 0.75
    disk: float = 0.25


class Overlap(NamedTuple):
    """What of a prompt a worker can have without computing it: a leading run of full pages by tier,
    then the first rows of the next page (a tail) from one tier. (A tuple: one is made per candidate
    per decision.)"""

    page_size: int
    num_device_pages: int = 0
    num_host_pages: int = 0
    num_disk_pages: int = 0
    num_tail_tokens: int = 0
    tail_tier: str = "device"
    is_credited: bool = True
    """False for a worker whose pages cannot be matched (another hash scheme): no credit at all."""
    has_tail_checked: bool = False
    """Whether the tail was looked for (else ``num_tail_tokens`` is 0 unchecked)."""

    @property
    def num_pages(self) -> int:
        return self.num_device_pages + self.num_host_pages + self.num_disk_pages

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the worker should find cached, any tier (what it reports as cached_tokens)."""
        return self.num_pages * self.page_size + self.num_tail_tokens

    def credited_tokens(self, credits: TierCredits) -> float:
        if not self.is_credited:
            return 0.0
        tail = self.num_tail_tokens * getattr(credits, self.tail_tier)
        return tail + self.page_size * (self.num_device_pages * credits.device + self.num_host_pages * credits.host
                                        + self.num_disk_pages * credits.disk)


NO_OVERLAP = Overlap(page_size=1, is_credited=False)


def prefill_tokens_left(ctx: RouteContext, overlap: Overlap, credits: TierCredits) -> float:
    """Prompt tokens to compute on the worker, less the credits of its cached pages."""
    return max(ctx.num_prompt_tokens - overlap.credited_tokens(credits), 0.0)


def decode_load(ctx: RouteContext, worker: WorkerState) -> float:
    """A decode (or aggregated) worker's load in tokens: prompt tokens queued to prefill there
    (reported, plus routed since) and the tokens its running requests hold in KV."""
    return worker.num_prefill_tokens + worker.num_active_tokens


def prefill_load(ctx: RouteContext, worker: WorkerState) -> float:
    """A prefill worker's load in tokens: prompt tokens queued there (reported, plus routed since)."""
    return worker.num_prefill_tokens


def softmax_choice(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn with probability ~ exp(-normalised cost / temperature); costs are scaled to
    [0, 1] first so the temperature means the same whatever the prompt length."""
    lo, hi = min(costs), max(costs)
    span = hi - lo
    if span <= 0:
        return rng.randrange(len(costs))
    weights = [math.exp(-(c - lo) / span / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]
