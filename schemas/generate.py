"""Messages at the public generation boundary (gateway, JSON) and between gateway and workers."""

from __future__ import annotations

import msgspec

from schemas.engine import FinishReason, SamplingParams, TokenLogprob, Usage
from schemas.tokenizer import ChatMessage


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A generation request from any language: exactly one of prompt, messages, prompt_token_ids.

    Unknown fields are refused with their name (``max_tokens`` belongs in ``sampling``).
    """

    prompt: str | None = None
    """Plain text prompt (no chat template applied)."""
    messages: list[ChatMessage] | None = None
    """OpenAI-style chat; the model's chat template is applied."""
    prompt_token_ids: list[int] | None = None
    """Already tokenized prompt."""
    sampling: SamplingParams = SamplingParams()
    session_id: str | None = None
    """Conversation id: the router keeps a session on the worker that holds its cache."""
    model: str | None = None
    """Checked against the served model when given."""
    stream_interval: int = 1
    """Coalesce this many tokens per streamed chunk."""
    include_token_ids: bool = True
    timeout_s: float | None = None
    """Seconds the caller waits for the whole generation; past it the generation is cancelled and its
    pages freed (the ``Kvbus-Timeout`` header does the same; the earlier of the two wins)."""


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed piece of a generation; the last one has ``finish_reason`` and ``usage``."""

    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] | None = None
    """First chunk only: seconds per phase (tokenize_s, route_s, prefill_s, transfer..., first_token_s)."""


class GenerateReply(msgspec.Struct, frozen=True, kw_only=True):
    """The whole generation at once (non-streaming variant)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
