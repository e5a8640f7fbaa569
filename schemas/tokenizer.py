"""Messages at the tokenizer boundary (public: JSON)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles OpenAI's chat API accepts; anything else is refused."""


# --- tools: the OpenAI shapes, so a NATS client sends the same JSON as an HTTP one ---------------


class ToolFunction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A function the model may call; ``parameters`` is a JSON Schema (checked against the meta-schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: str = "function"
    function: ToolFunction


class ToolCallFunction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's convention), e.g. ``'{"city": "Paris"}'``."""


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A call the assistant made: in a reply, and in the history sent back with the tool's result."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One OpenAI-style chat message.

    ``content`` may be null only for an assistant message (one that only calls tools); a ``tool``
    message answers the call named by its ``tool_call_id``. Fields left at their defaults are left
    out on the wire, so a plain message encodes as it did before tools existed.
    """

    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages: the calls it made."""
    tool_call_id: str | None = None
    """Tool messages: the id of the call this is the result of."""
    reasoning_content: str | None = None
    """Assistant messages: the reasoning it returned (templates that render past reasoning use it)."""

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}; got {self.role!r}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r} (only an assistant message may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to role {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")


class EncodeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    text: str
    add_special_tokens: bool = True


class EncodeReply(msgspec.Struct, frozen=True, kw_only=True):
    ids: list[int]


class DecodeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ids: list[int]
    skip_special_tokens: bool = True


class DecodeReply(msgspec.Struct, frozen=True, kw_only=True):
    text: str


class ChatTemplateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    # NOTE: UNSET (not None) so that a request without them encodes as it did before they existed
    tools: list[Tool] | UnsetType = UNSET
    """Rendered through the model's template when it takes tools, else in kvbus's fallback format
    (docs/agents.md)."""
    chat_template_kwargs: dict[str, Any] | UnsetType = UNSET
    """Extra variables for the template, e.g. ``{"enable_thinking": false}``."""


class ChatTemplateReply(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str
    ids: list[int]


class TokenizerInfoRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ask for vocabulary facts; empty on purpose."""


class TokenizerInfoReply(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    context_length: int
    has_chat_template: bool
