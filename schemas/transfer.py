"""Messages of the KV transfer layer: where pages go, what was sent, the pages themselves."""

from __future__ import annotations

import msgspec

TransferBackendName = str
"""A registered transfer backend's name (``services.transfer.BACKENDS``: ``shm``, ``nats``, or one added
with ``register_backend``). A plain string on the wire, so a registered backend's messages decode in any
peer; the transfer layer checks the name against its registry."""


class TransferTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Set by the receiver before the sender starts: how to reach it."""

    transfer_id: str
    backend: TransferBackendName
    receiver_id: str
    """Worker id of the receiver (the nats backend publishes to its KV subject)."""
    host_id: str
    max_chunk_bytes: int = 1 << 20


class TransferDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """Set by the sender once the pages are out: enough to find, check and rebuild them."""

    transfer_id: str
    backend: TransferBackendName
    shape: list[int]
    dtype: str
    num_bytes: int
    checksum: int
    """zlib.crc32 of the payload bytes."""
    num_chunks: int = 1
    shm_name: str | None = None
    scales: list[float] = []
    """fp8 KV caches: the per-tensor scales the pages were stored with."""


class KVChunkEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One piece of a KV payload on the nats backend."""

    transfer_id: str
    index: int
    num_chunks: int
    data: bytes
    checksum: int
    """zlib.crc32 of ``data``."""
