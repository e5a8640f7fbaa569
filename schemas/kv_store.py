"""Messages of the kv_store (HiCache L2/L3 on one host) and of KV events.

kv_store messages carry metadata only (page hash -> arena slot, leases,
commits); page bytes stay in the host's shared-memory arena. KV events are
public (JSON): the KV-aware router and other consumers follow them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.transfer import TransferDescriptor, TransferTarget

KVTier = Literal["device", "host", "disk"]
KVEventKind = Literal["stored", "removed"]


class KVStoreAttachRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An engine maps the host's arena (the first one's layout and pool size create it)."""

    worker_id: str
    layout_key: str
    """Model, page shape, KV dtype and fp8 scales: only engines with equal keys share pages."""
    page_bytes: int
    page_size: int
    pool_bytes: int
    reset_leases: bool = True
    """Give back every slot this worker id leased before (a fresh start; False when re-attaching)."""


class KVStoreAttachReply(msgspec.Struct, frozen=True, kw_only=True):
    arena_name: str
    """POSIX shared-memory segment to map (mode 0600)."""
    num_slots: int
    page_bytes: int
    page_size: int


class KVStoreLeaseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Empty slots for write-back, taken ahead of need."""

    worker_id: str
    arena_name: str
    count: int


class KVStoreLeaseReply(msgspec.Struct, frozen=True, kw_only=True):
    slots: list[int]


class KVStoreCommitEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Leased slots an engine filled: ``slots[i]`` holds ``page_hashes[i]``."""

    worker_id: str
    arena_name: str
    slots: list[int]
    page_hashes: list[int]
    parent_hashes: list[int]


class KVStoreTouchEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Pages an engine loaded back (LRU order and hit counts)."""

    page_hashes: list[int]


class KVStoreLookupRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Which leading pages does L2 hold (L3 hits are promoted into L2 first)?"""

    page_hashes: list[int]
    first_of: bool = False
    """Instead: the first of ``page_hashes`` L2 holds (the tails of one page, longest first)."""


class KVStoreLookupReply(msgspec.Struct, frozen=True, kw_only=True):
    arena_name: str
    page_hashes: list[int]
    """The leading run of the requested hashes that L2 holds now (``first_of``: at most one)."""
    slots: list[int]


class KVStoreOfferRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An engine on another host offers pages to write back (the bytes follow by the transfer layer)."""

    worker_id: str
    layout_key: str
    page_hashes: list[int]
    parent_hashes: list[int]
    token_ids: list[list[int]]
    """Each page's tokens (the store verifies them on every later read, as for a local write)."""
    sender_host_id: str


class KVStoreOfferReply(msgspec.Struct, frozen=True, kw_only=True):
    wanted: list[int]
    """Indices into the offer of the pages the store lacks, in order; send only these."""
    target: TransferTarget | None = None
    """Where to push them (None when nothing is wanted)."""


class KVStorePutRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The wanted pages of an offer were sent: ``[len(wanted), page_bytes]`` uint8."""

    worker_id: str
    transfer: TransferDescriptor


class KVStorePutReply(msgspec.Struct, frozen=True, kw_only=True):
    stored: int
    """Pages stored (fewer when some were stored by another engine meanwhile or L2 had no room)."""


class KVStoreFetchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An engine on another host asks for the leading pages of a chain that the store holds."""

    worker_id: str
    layout_key: str
    page_hashes: list[int]
    target: TransferTarget
    """Where to push them (the engine's receiver, nats backend)."""
    max_pages: int = 1024


class KVStoreFetchReply(msgspec.Struct, frozen=True, kw_only=True):
    page_hashes: list[int]
    """The leading run of the requested pages found (L3 hits promoted first) and sent."""
    parent_hashes: list[int]
    token_ids: list[list[int]]
    transfer: TransferDescriptor | None = None
    """``[len(page_hashes), page_bytes]`` uint8; None when nothing was found."""


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    kind: KVEventKind
    tier: KVTier
    page_hashes: list[int]
    parent_hashes: list[int]
    """``parent_hashes[i]`` is the hash of the page before ``page_hashes[i]`` (the chain's root for a first page)."""


class KVEventBatchEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Pages a publisher (engine or kv_store) stored or removed, in order."""

    worker_id: str
    host_id: str
    event_id: int
    """Monotonic per publisher, +1 per batch: a consumer that sees a gap asks for a dump."""
    events: list[KVEvent]


class KVDumpRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class KVDumpReply(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a publisher holds now, as of ``event_id`` (the last batch it published)."""

    worker_id: str
    host_id: str
    event_id: int
    events: list[KVEvent]
