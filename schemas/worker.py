"""Messages between gateway, router and engine workers (internal: MessagePack)."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.engine import FinishReason, SamplingParams, TokenLogprob, Usage
from schemas.transfer import TransferDescriptor, TransferTarget

WorkerRole = Literal["prefill", "decode", "worker"]

MAX_PREFIX_REPORTS = 256
"""Most :class:`PrefixReport` one heartbeat carries."""


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    num_queued_prefill_tokens: int = 0


class PrefixReport(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One request a worker finished: how many of its prompt tokens it found cached (any tier).

    Routers compare it with the overlap they predicted for the request (their accuracy)."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int


class WorkerHeartbeatEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Published by every engine worker every ``heartbeat_interval`` seconds."""

    worker_id: str
    role: WorkerRole
    host_id: str
    """Same value on the same machine: peers with equal host ids may use shared memory."""
    load: WorkerLoad
    model: str = ""
    page_size: int = 16
    transfer_backends: list[str] = []
    """KV transfer backends this worker's process can use (``services.transfer.available_backends``); a
    decode worker offers a prefill worker only those it advertised (empty, as from a peer that
    advertised none: any registered one)."""
    interval_s: float = 1.0
    is_draining: bool = False
    hash_scheme: str = ""
    """How the worker names KV pages (``services.engine.page_hash.SCHEME``); empty: not advertised (a
    router then assumes kvbus's scheme with an unsalted root). A router gives a worker whose scheme
    differs from its own no overlap credit."""
    hash_root: int = 0
    """The chain's root hash (``page_hash.root_hash(cache_salt)``): the router hashes prompts from it,
    so a salted worker is matched without the salt itself crossing the wire. 0: the unsalted root."""
    prefix_reports: list[PrefixReport] = []
    """Requests finished since the last heartbeat with their cached prompt tokens (at most
    ``MAX_PREFIX_REPORTS``; the oldest are dropped)."""


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    session_id: str | None = None
    exclude_worker_ids: list[str] = []
    """Workers that already failed this request (retries)."""


class RouteReply(msgspec.Struct, frozen=True, kw_only=True):
    decode_worker_id: str
    """Streams the tokens; also prefills when ``prefill_worker_id`` is None."""
    prefill_worker_id: str | None = None
    policy: str = ""
    prefill_host_id: str | None = None
    """Host of the prefill worker: the decode worker picks the KV transfer backend from it."""
    num_cached_tokens: int = 0
    """Prompt tokens the router expects the prefilling worker to find cached, any tier (its KV
    index's prediction; 0 from a policy that keeps no index)."""
    reason: str = ""
    """Why this decode worker: ``session`` (the conversation stays where it is), ``overlap`` (its
    cache), ``load``, or the policy's own word."""


class WorkerGenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Gateway -> decode (or aggregated) worker; the reply is a stream of TokenChunk."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_worker_id: str | None = None
    stream_interval: int = 1
    prefill_host_id: str | None = None
    deadline_s: float | None = None
    """Seconds left for the whole generation when the gateway sent it (relative: clocks need not agree);
    None: no deadline. The worker refuses work it cannot start in time and the bus cancels it past this."""


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] | None = None
    """Seconds spent per phase (queue, prefill, transfer, first decode step): first chunk only."""


class PrefillRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill worker: compute the prompt's KV and first token, push the pages to ``transfer``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    transfer: TransferTarget
    deadline_s: float | None = None
    """Seconds left for the prefill (and transfer) when the decode worker sent it; None: no deadline."""
    skip_pages: int = 0
    """Leading prompt pages the decode worker already holds (its prefix cache, or its host tier's
    L2): the prefill worker still computes or loads them (later tokens attend to them) but sends only
    the pages after them. At most ``(len(prompt_token_ids) - 1) // page_size``."""


class PrefillChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Two per prefill, streamed: the first token as soon as it is sampled (``kv`` None), then,
    once the pages are pushed, the transfer descriptor (``kv``)."""

    first_token_id: int
    kv: TransferDescriptor | None = None
    num_cached_tokens: int = 0
    first_logprob: TokenLogprob | None = None
    timings: dict[str, float] = {}
