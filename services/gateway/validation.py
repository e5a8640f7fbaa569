"""Request checks at the edge, before any work: OpenAI chat messages, unsupported fields, cheap limits.

The gateway refuses what the services cannot serve while it is still cheap to say no:
before tokenizing, routing or generating. Sampling bounds live on
:class:`schemas.engine.SamplingParams` (so the NATS subjects and the engine share them);
this module holds what only the edge knows: OpenAI's message rules and the context length.
"""

from __future__ import annotations

from typing import Any

from bus.errors import InvalidArgument
from schemas.generate import GenerateRequest
from schemas.tokenizer import CHAT_ROLES, ChatMessage, ToolCall
from services.agent.tools import BadField

MAX_CHAT_MESSAGES = 4096
"""More messages than this is refused before templating (each costs template work)."""

_REFUSED_CHAT_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
                        "verbosity", "web_search_options")


__all__ = ["BadField", "chat_messages", "check_before_work", "refuse_unsupported_chat_fields"]


def refuse_unsupported_chat_fields(req: Any) -> None:
    """OpenAI chat fields kvbus declares (so they are not 'unrecognized') but cannot honour."""
    for name in _REFUSED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            raise BadField(name, f"{name} is not supported")


def chat_messages(messages: list[Any]) -> list[ChatMessage]:
    """OpenAI messages -> ChatMessages, with OpenAI's rules for roles and content.

    Roles: system, developer, user, assistant, tool (``function`` is the deprecated
    function-calling role: not supported). Content: a string, or a list of text parts;
    null only for an assistant message (OpenAI allows it beside tool calls), read as "".
    A tool message needs its ``tool_call_id`` (that it answers an earlier call is checked
    with the other agent fields, for NATS callers too: services/agent/tools.py).
    """
    if not messages:
        raise BadField("messages", "messages must be a non-empty list")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise BadField("messages", f"messages holds {len(messages)} entries; at most {MAX_CHAT_MESSAGES}")
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(m: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if m.role not in CHAT_ROLES:
        raise BadField(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}")
    if m.function_call is not None:
        raise BadField(f"{where}.function_call", f"{where}: function_call is deprecated and not supported; "
                                                 "send tool_calls")
    if m.tool_calls and m.role != "assistant":
        raise BadField(f"{where}.tool_calls", f"{where}: only assistant messages carry tool_calls")
    if m.audio is not None:
        raise BadField(f"{where}.audio", f"{where}: audio is not supported")
    if m.role == "tool" and not m.tool_call_id:
        raise BadField(f"{where}.tool_call_id", f"{where}: a tool message needs tool_call_id")
    content = m.content
    if content is None:
        if m.role != "assistant":
            raise BadField(f"{where}.content", f"{where}.content must be a string or a list of text parts "
                                               f"for role {m.role!r}, got null")
        content = ""
    elif not isinstance(content, str):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise BadField(f"{where}.content",
                               f"content part of type {part.type!r} is not supported; only text parts")
            texts.append(part.text)
        content = "\n".join(texts)
    calls = [ToolCall(id=c.id, type=c.type, function=c.function) for c in m.tool_calls or ()]
    return ChatMessage(role=m.role, content=content, name=m.name, tool_calls=calls or None,
                       tool_call_id=m.tool_call_id if m.role == "tool" else None,
                       reasoning_content=m.reasoning_content if m.role == "assistant" else None)


def check_before_work(req: GenerateRequest, context_length: int | None) -> None:
    """What can be refused before tokenizing: the prompt source, stream_interval, limits.

    A text prompt or messages too large for NATS are refused by the bus when they would be
    sent (PayloadTooLarge, HTTP 413), still before any tokenizer work.
    """
    given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise InvalidArgument("exactly one of prompt, messages and prompt_token_ids must be given, "
                              f"got {', '.join(given) if given else 'none'}")
    if req.stream_interval < 1:
        raise InvalidArgument(f"stream_interval must be >= 1, got {req.stream_interval}")
    if req.messages is not None and len(req.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(f"messages holds {len(req.messages)} entries; at most {MAX_CHAT_MESSAGES}")
    if not context_length:
        return
    from services.gateway.pipeline import PromptTooLong  # NOTE: pipeline imports this module

    max_tokens = req.sampling.max_tokens
    if max_tokens is not None and max_tokens >= context_length:
        raise PromptTooLong(f"max_tokens is {max_tokens}; the context length is {context_length} "
                            "(the prompt needs at least one token)")
    if req.prompt_token_ids is not None and len(req.prompt_token_ids) >= context_length:
        raise PromptTooLong(f"the prompt has {len(req.prompt_token_ids)} tokens; the context length is "
                            f"{context_length} (prompt plus at least one generated token must fit)")
