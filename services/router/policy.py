"""Routing policies, by name through a small registry.

A policy chooses one worker among candidates that are already alive, not
excluded and not busy (the router filters first), once per stage: ``decode``
(the worker that streams the tokens) and ``prefill``. To add one:

1. subclass :class:`Policy` (in this file, or its own module when it brings
   state such as a KV index: ``kv_policy.py``), set ``name`` and implement
   ``choose``; override ``num_cached_tokens`` when the policy knows a worker's
   cached prefix;
2. add ``"name": "module:Class"`` to :data:`POLICIES` (imported lazily), or call
   ``POLICIES.register("name", "module:Class")`` from your own package.

The router tells every policy what happens through the ``on_*`` hooks below
(workers joining and leaving, KV events and dumps when ``wants_kv_events``,
each decision), so a policy that keeps its own state needs no router edit.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

from schemas.kv_store import KVDumpReply, KVEventBatchEvent
from services.plugins import Registry
from services.router import scoring
from services.router.scoring import Cost, RouteContext
from services.router.workers import WorkerState

if TYPE_CHECKING:
    from services.router.config import RouterConfig

Stage = Literal["decode", "prefill"]

POLICIES = Registry("router policy", {
    "kv": "services.router.kv_policy:KVPolicy",
    "round_robin": "services.router.policy:RoundRobinPolicy",
    "random": "services.router.policy:RandomPolicy",
    "least_loaded": "services.router.policy:LeastLoadedPolicy",
}, docs={
    "kv": "where the prompt's KV pages are cached (tiered credits), then load",
    "round_robin": "the next worker id per stage",
    "random": "uniform (--seed)",
    "least_loaded": "fewest requests / queued prefill tokens",
})


class Policy(abc.ABC):
    name: ClassVar[str]
    wants_kv_events: ClassVar[bool] = False
    """True: the router subscribes to every publisher's KV events and hands them to the ``on_kv_*`` hooks."""

    def __init__(self, *, rng: random.Random | None = None, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rng = rng or random.Random()
        self.config = config
        """The router's configuration (None when a test builds the policy alone)."""
        self.clock = clock

    @abc.abstractmethod
    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        """One of ``candidates`` (never empty, sorted by worker id) for ``stage``."""

    def num_cached_tokens(self, ctx: RouteContext, worker: WorkerState) -> int:
        """Prompt tokens ``worker`` should find cached (any tier); 0 for a policy that keeps no index."""
        return 0

    def num_tokens_to_prefill(self, ctx: RouteContext, worker: WorkerState) -> int:
        """Prompt tokens ``worker`` would have to compute: the prompt less its cached prefix.

        The router compares this with ``min_disagg_tokens`` for the chosen decode
        worker to decide whether a separate prefill worker is worth the transfer.
        """
        return ctx.num_prompt_tokens - self.num_cached_tokens(ctx, worker)

    def reason(self, stage: Stage, ctx: RouteContext, worker: WorkerState) -> str:
        """One word for metrics: why ``worker`` was chosen."""
        return self.name

    # --- what the router tells every policy (defaults: nothing to do) -----------------------
    def on_worker_joined(self, worker: WorkerState) -> None:
        """A worker's first heartbeat (or its first after it left)."""

    def forget(self, worker_id: str) -> None:
        """The worker left (silent or draining): drop anything kept about it."""

    def on_routed(self, ctx: RouteContext, decode: WorkerState, prefill: WorkerState | None) -> None:
        """The decision was made (the prefill worker is None when the decode worker prefills)."""

    def on_kv_events(self, batch: KVEventBatchEvent) -> None:
        """A publisher's batch of stored/removed pages (``wants_kv_events`` only)."""

    def on_kv_dump(self, reply: KVDumpReply) -> None:
        """A publisher's whole state, asked for through :meth:`take_kv_dump_requests`."""

    def on_kv_dump_failed(self, publisher_id: str, *, no_responders: bool) -> None:
        """The dump was not answered (``no_responders``: nobody serves that publisher's dump subject)."""

    def take_kv_dump_requests(self) -> list[str]:
        """Publisher ids whose dump the router should ask for now (each once, answered by a hook above)."""
        return []

    def tick(self) -> None:
        """Called about once a second: expire what the policy keeps."""

    def detail(self) -> dict[str, int]:
        """Numbers for health output and metrics (a KV index's size, gaps, resyncs)."""
        return {}


class RoundRobinPolicy(Policy):
    """Each stage takes the next worker id after the one it chose last (stable when workers come and go)."""

    name = "round_robin"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._last: dict[str, str] = {}

    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        last = self._last.get(stage)
        chosen = next((w for w in candidates if last is None or w.worker_id > last), candidates[0])
        self._last[stage] = chosen.worker_id
        return chosen


class RandomPolicy(Policy):
    name = "random"

    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        return self.rng.choice(list(candidates))


class LeastLoadedPolicy(Policy):
    """Decode: fewest running + waiting, then most free pages. Prefill: fewest queued prefill tokens,
    then the decoder's host."""

    name = "least_loaded"
    decode_costs: Sequence[Cost] = (scoring.num_requests, scoring.fewer_free_pages)
    prefill_costs: Sequence[Cost] = (scoring.num_prefill_tokens, scoring.other_host)

    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        costs = self.decode_costs if stage == "decode" else self.prefill_costs
        return scoring.lowest_cost(ctx, candidates, costs)


def policy_class(name: str) -> type[Policy]:
    return POLICIES.get(name)


def make_policy(name: str, *, rng: random.Random | None = None, config: RouterConfig | None = None,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    return policy_class(name)(rng=rng, config=config, clock=clock)
