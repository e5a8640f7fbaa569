"""Messages at the public generation boundary (gateway, JSON) and between gateway and workers."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas.engine import SamplingParams, TokenLogprob, Usage
from schemas.tokenizer import ChatMessage, Tool, ToolCall

ReplyFinishReason = Literal["stop", "length", "abort", "tool_calls"]
"""The engine's finish reasons, plus ``tool_calls``: the model stopped after calling tools."""


class ToolChoiceFunction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A named function the model must call: ``{"type": "function", "function": {"name": "f"}}``."""

    type: str = "function"
    function: ToolChoiceFunction


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    """The JSON Schema the reply must validate against (checked against the meta-schema)."""
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``{"type": "text"}`` (the default), ``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a tool call in a stream: the first piece of call ``index`` has its id and name, the
    following ones more of its ``arguments`` (JSON text); joined in order they make the whole call."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


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
    # --- agents (docs/agents.md): the same fields, with the same meaning, as OpenAI's chat API ---
    tools: list[Tool] | None = None
    """Functions the model may call (with ``messages``); calls come back in ``tool_calls``."""
    tool_choice: str | ToolChoice | None = None
    """``"auto"`` (the default with tools), ``"none"``, ``"required"`` or a named function."""
    parallel_tool_calls: bool = True
    """False: at most one call per reply (the first one the model makes)."""
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template, e.g. ``{"enable_thinking": false}``."""


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed piece of a generation; the last one has ``finish_reason`` and ``usage``."""

    text: str = ""
    """New content (with tools or a reasoning parser: the text that is neither a call nor reasoning)."""
    token_ids: list[int] = []
    finish_reason: ReplyFinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] | None = None
    """First chunk only: seconds per phase (tokenize_s, route_s, prefill_s, transfer..., first_token_s)."""
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None
    index: int = 0
    """The choice this chunk belongs to (``sampling.n`` > 1: chunks of the n choices interleave; each
    choice ends with its own chunk carrying ``finish_reason`` and that choice's ``usage``)."""


class GenerateReply(msgspec.Struct, frozen=True, kw_only=True):
    """The whole generation at once (non-streaming variant)."""

    text: str
    token_ids: list[int]
    finish_reason: ReplyFinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None
    """The calls the model made (``finish_reason`` is then ``tool_calls``)."""
    reasoning_content: str | None = None
