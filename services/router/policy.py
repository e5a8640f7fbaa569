"""Routing policies, by name through a small registry.

A policy chooses one worker among candidates that are already alive, not
excluded and not busy (the router filters first), once per stage: ``decode``
(the worker that streams the tokens) and ``prefill``. To add one:

1. subclass :class:`Policy` (in this file, or its own module when it brings
   state such as a KV index), set ``name`` and implement ``choose``;
   override ``num_tokens_to_prefill`` when the policy knows a worker's cached
   prefix, and ``forget`` when it keeps per-worker state;
2. add ``"name": "module:Class"`` to :data:`POLICIES` (imported lazily), or call
   ``POLICIES.register("name", "module:Class")`` from your own package.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import ClassVar, Literal

from services.plugins import Registry
from services.router import scoring
from services.router.scoring import Cost, RouteContext
from services.router.workers import WorkerState

Stage = Literal["decode", "prefill"]

POLICIES = Registry("router policy", {
    "round_robin": "services.router.policy:RoundRobinPolicy",
    "random": "services.router.policy:RandomPolicy",
    "least_loaded": "services.router.policy:LeastLoadedPolicy",
})


class Policy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, *, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(self, stage: Stage, ctx: RouteContext, candidates: Sequence[WorkerState]) -> WorkerState:
        """One of ``candidates`` (never empty, sorted by worker id) for ``stage``."""

    def num_tokens_to_prefill(self, ctx: RouteContext, worker: WorkerState) -> int:
        """Prompt tokens ``worker`` would have to compute; a cache-aware policy subtracts its cached prefix.

        The router compares this with ``min_disagg_tokens`` for the chosen decode
        worker to decide whether a separate prefill worker is worth the transfer.
        """
        return ctx.num_prompt_tokens

    def forget(self, worker_id: str) -> None:
        """The worker left (silent or draining): drop anything kept about it."""


class RoundRobinPolicy(Policy):
    """Each stage takes the next worker id after the one it chose last (stable when workers come and go)."""

    name = "round_robin"

    def __init__(self, *, rng: random.Random | None = None):
        super().__init__(rng=rng)
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


def make_policy(name: str, *, rng: random.Random | None = None) -> Policy:
    return policy_class(name)(rng=rng)
