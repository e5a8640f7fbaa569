"""Messages every service understands: health, cancellation, debug echo."""

from __future__ import annotations

import msgspec


class HealthRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ask a service whether it is ready; empty on purpose."""


class HealthReply(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    worker_id: str
    ready: bool
    version: str
    uptime_s: float
    num_inflight: int = 0
    detail: dict[str, str] = {}


class CancelEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Broadcast by a caller that abandons a streamed request."""

    request_id: str


class EchoRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Debug and benchmark payload: echoed back, or streamed `count` times."""

    data: bytes = b""
    count: int = 1


class EchoReply(msgspec.Struct, frozen=True, kw_only=True):
    data: bytes = b""


class EchoChunk(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    index: int
    data: bytes = b""
