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

To add a drafter: subclass :class:`Drafter`, set ``name`` and ``cost_per_token``,
and add ``"name": "module:Class"`` to :data:`DRAFTERS` (imported lazily).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

DRAFTERS: dict[str, str] = {
    "ngram": "services.draft.ngram:NgramDrafter",
    "model": "services.draft.model:ModelDrafter",
}


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


def make_drafter(name: str, **options) -> Drafter:
    """The drafter registered as ``name``, constructed with ``options``."""
    target = DRAFTERS.get(name)
    if target is None:
        raise DraftError(f"unknown drafter {name!r}; known: {', '.join(sorted(DRAFTERS))}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
