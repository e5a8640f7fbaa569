"""Messages at the tokenizer boundary (public: JSON)."""

from __future__ import annotations

import msgspec


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles OpenAI's chat API accepts; anything else is refused."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One OpenAI-style chat message."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}; got {self.role!r}")


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
