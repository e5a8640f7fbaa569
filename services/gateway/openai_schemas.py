"""OpenAI request and response bodies as msgspec Structs (the project's one schema library).

Requests refuse fields they do not know with a 400 that names the field, as
OpenAI does ("Unrecognized request argument"); every field OpenAI's API (and
so the openai python client) may send is declared, and fields the API defines
but kvbus cannot honour are refused by the mapping with a 400 instead of being
silently ignored (:mod:`services.gateway.validation`). Union types that msgspec cannot express
(``prompt``: str | list[str] | list[int] | list[list[int]]) are loosened here
and checked in :mod:`services.gateway.openai_mapping`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from schemas.generate import ResponseFormat, ToolChoice
from schemas.tokenizer import Tool, ToolCall

# --- requests -----------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Accepted and ignored: kvbus adds no obfuscation padding to stream events."""


class AgentHints(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Dynamo's ``nvext.agent_hints``."""

    priority: int | None = None
    """Higher goes first (Dynamo's meaning; kvbus's own ``priority`` is vLLM's: lower goes first)."""
    osl: int | None = None
    """Expected output length in tokens, for the router's load estimate."""
    strict_priority: int | None = None
    speculative_prefill: bool | None = None


class NvExt(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Dynamo's request extension; only ``agent_hints`` is known (anything else: unrecognized)."""

    agent_hints: AgentHints | None = None


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/completions and /v1/chat/completions (with vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI fields with no effect on a single self-hosted model: accepted, ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM / SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_tokens: int = 0
    priority: int = 0
    """Lower goes first (vLLM's meaning)."""
    # Dynamo's extension
    nvext: NvExt | None = None
    # kvbus extensions
    session_id: str | None = None
    """Conversation id: the router keeps a session on the worker that holds its cache."""
    stream_interval: int = 1


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    """A part of a message's content; only ``text`` parts are served (others get a 400 that says so)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class ToolCallIn(ToolCall, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A call in an assistant message of the history. ``index`` is accepted and dropped: clients that
    build the message from OpenAI's streamed deltas send it back (vLLM takes it too)."""

    index: int | None = None


class ChatMessageIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None
    reasoning_content: str | None = None
    """vLLM's: an assistant message's reasoning, sent back in the history."""


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: list[ChatMessageIn] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template, e.g. ``{"enable_thinking": false}``."""
    # OpenAI fields kvbus cannot honour: refused with a 400 when given (not null)
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None


# --- responses -----------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int = 0


class SpeculativeUsage(msgspec.Struct, frozen=True, kw_only=True):
    """kvbus extension: speculative decoding's share of the completion."""

    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    mean_accepted_length: float = 0.0


class UsageInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    kvbus_speculative: SpeculativeUsage | None = None
    """Present only when the request was decoded speculatively."""


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str  # "text_completion"; no default, or omit_defaults would leave it out
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    """Always on the whole response; on a stream only in the last chunk (stream_options.include_usage)."""


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """Null when the reply is tool calls alone (OpenAI's convention)."""
    # UNSET: left out of the body when the reply has none
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """OpenAI's streamed call: the first delta of call ``index`` has id, type and name, later ones arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"; no default, or omit_defaults would leave it out
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvbus"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorDetail
