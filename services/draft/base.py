"""The drafter protocol and its registry.

A drafter keeps one stream per request in step with the tokens the target
engine accepted:

* ``open(request_id, prompt_ids)``: a new request;
* ``propose(request_id, k)``: up to ``k`` tokens that may follow the stream, as a
  :class:`Proposal` stamped with the stream length it continues (its position);
* ``commit(request_id, tokens)``: tokens the target appended (accepted drafts plus
  its own correction or bonus token); a model drafter rolls its KV back to the
  longest prefix it still shares with the stream;
* ``close(request_id)``: the request finished.

The engine drops a proposal whose position is not the sequence's current length
(stale: the stream moved on while it was computed). ``propose_many`` serves a
batch (the remote draft service batches proposals of several decode workers); the
default loops over ``propose``.

To add a drafter: one module with a :class:`Drafter` subclass (``name``, ``from_config``
reading its own options from the engine's or the draft service's configuration, and
``cost_per_token`` or ``cost_for``), and one line in :data:`DRAFTERS`. The configurations'
``speculative_method`` choices, their validation and ``kvbus up --speculative`` come from the
registry.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from services.plugins import Registry, UnknownPlugin

DRAFTERS = Registry("drafter", {
    "ngram": "services.draft.ngram:NgramDrafter",
    "model": "services.draft.model:ModelDrafter",
}, docs={
    "ngram": "prompt lookup: the tokens that followed the stream's tail earlier in it",
    "model": "a small model sharing the target's tokenizer (draft_model)",
})


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens for the stream positions ``position``, ``position + 1``, ...

    ``probs`` ([len(tokens), V] float32) is the distribution each token was drawn
    from; None means each token had probability 1 under the drafter (n-gram
    lookup, greedy drafting), which the rejection sampler treats as q = 1 on the
    proposed token.
    """

    position: int
    tokens: list[int]
    probs: object | None = None  # torch.Tensor; kept untyped so this module stays torch-free


class Drafter(abc.ABC):
    name: ClassVar[str]
    cost_per_token: ClassVar[float] = 0.0
    """Time to draft one token as a share of one target decode step (adaptive k's cost model)."""

    @classmethod
    def from_config(cls, config, *, target_dir: str | None = None) -> Drafter:
        """This drafter built from the fields of ``config`` (an EngineConfig or a DraftConfig) it
        uses; ``target_dir``: the target model's folder. The default takes no options."""
        return cls()

    @classmethod
    def config_problem(cls, config) -> tuple[str, str] | None:
        """``(field, why)`` when ``config`` lacks what this drafter needs, else None."""
        return None

    @classmethod
    def cost_for(cls, config, *, target_dir: str | None = None) -> float:
        """``cost_per_token`` of the drafter ``config`` would build, without building it (a
        worker whose drafts come from the draft service weighs them with it)."""
        return cls.cost_per_token

    @abc.abstractmethod
    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def propose(self, request_id: str, k: int) -> Proposal | None:
        """Up to ``k`` tokens after the stream; None (or no tokens) when there is nothing to propose."""

    @abc.abstractmethod
    def commit(self, request_id: str, tokens: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def close(self, request_id: str) -> None: ...

    def propose_many(self, wants: dict[str, int]) -> dict[str, Proposal | None]:
        return {rid: self.propose(rid, k) for rid, k in wants.items()}

    def has(self, request_id: str) -> bool:
        """Whether ``request_id`` is open."""
        return False


class DraftError(ValueError):
    """A drafter that cannot serve this target (e.g. another tokenizer)."""


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class registered as ``name`` (DraftError naming the known ones)."""
    try:
        return DRAFTERS.get(name)
    except UnknownPlugin as exc:
        raise DraftError(str(exc)) from None


def make_drafter(name: str, **options) -> Drafter:
    """The drafter registered as ``name``, constructed with ``options`` (its own keyword arguments)."""
    return drafter_class(name)(**options)


def speculative_method_problem(config) -> tuple[str, str] | None:
    """``(field, why)`` when ``config.speculative_method`` (None: off) names no registered drafter,
    or lacks an option its drafter needs; None when fine (the configurations raise ConfigError).
    Only a configured drafter's module is imported."""
    method = config.speculative_method
    if method is None:
        return None
    if method not in DRAFTERS:
        return "speculative_method", f"must be one of {', '.join(DRAFTERS.names())}"
    return DRAFTERS.get(method).config_problem(config)
