"""Messages between engine workers and the draft service (internal: MessagePack).

A worker keeps each request's stream in step with the service by sending, with
every proposal request, the tokens appended since the last one (``tokens`` from
stream position ``base``). A service that does not hold the stream at ``base``
(a restart, another replica) answers ``resync`` and the worker sends the whole
stream next time: drafters are a cache, never a source of truth.
"""

from __future__ import annotations

import msgspec


class DraftItem(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    base: int
    """Stream length the service is expected to hold; ``tokens`` follow it (0: open with the whole stream)."""
    tokens: list[int]
    k: int
    """Most tokens to propose after the updated stream."""


class DraftProposeRequest(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    items: list[DraftItem]


class DraftResult(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    position: int = 0
    """Stream length the proposal continues."""
    tokens: list[int] = []
    resync: bool = False
    """The service did not hold the stream at ``base``: send it whole next time."""


class DraftProposeReply(msgspec.Struct, frozen=True, kw_only=True):
    items: list[DraftResult]


class DraftCloseEvent(msgspec.Struct, frozen=True, kw_only=True):
    request_ids: list[str]
