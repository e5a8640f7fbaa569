"""Checks on the agent fields of a request, before any work: tools, tool_choice, the calls in the
history, response_format and chat_template_kwargs. The same checks for HTTP and NATS; each refusal is
a :class:`BadField` naming the field as OpenAI does (``tools[1].function.parameters``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from bus.errors import InvalidArgument
from schemas.generate import ResponseFormat, ToolChoice
from schemas.tokenizer import ChatMessage, Tool

MAX_TOOLS = 128
"""OpenAI's limit on ``tools``."""
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""apply_chat_template's own arguments: a request may not set them through chat_template_kwargs."""


class BadField(InvalidArgument):
    """A request field kvbus refuses; ``param`` names it in the OpenAI error body."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def check_json_schema(schema: Any, param: str) -> None:
    """A JSON Schema, checked against its meta-schema (draft 2020-12 unless ``$schema`` says otherwise)."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    if not isinstance(schema, dict):
        raise BadField(param, f"{param} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise BadField(param, f"{param} is not a valid JSON Schema: {exc.message}"
                              f"{f' (at {where[1:]})' if where else ''}") from None


def check_tools(tools: Sequence[Tool] | None) -> None:
    if tools is None:
        return
    if len(tools) > MAX_TOOLS:
        raise BadField("tools", f"tools holds {len(tools)} entries; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise BadField(f"{where}.type", f"{where}.type must be 'function', got {tool.type!r}")
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise BadField(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, "
                                                     f"'_', '-' or '.', got {name!r}")
        if name in seen:
            raise BadField(f"{where}.function.name", f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None:
            check_json_schema(parameters, f"{where}.function.parameters")
            if parameters.get("type", "object") not in ("object", ["object"]):
                raise BadField(f"{where}.function.parameters", f"{where}.function.parameters must describe an "
                                                               f"object (the arguments), got type "
                                                               f"{parameters['type']!r}")


def check_tool_choice(tool_choice: str | ToolChoice | None, tools: Sequence[Tool] | None) -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise BadField("tool_choice", f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                                          f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                          f"got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise BadField("tool_choice", "tool_choice 'required' needs tools")
        return
    if tool_choice.type != "function":
        raise BadField("tool_choice.type", f"tool_choice.type must be 'function', got {tool_choice.type!r}")
    names = [t.function.name for t in tools or ()]
    if tool_choice.function.name not in names:
        raise BadField("tool_choice.function.name", f"tool_choice names function {tool_choice.function.name!r}, "
                                                    f"which is not in tools ({', '.join(names) or 'none given'})")


def check_tool_history(messages: Sequence[ChatMessage] | None) -> None:
    """Every tool message answers a call an earlier assistant message made."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages or ()):
        for j, call in enumerate(m.tool_calls or ()):
            if call.type != "function":
                raise BadField(f"messages[{i}].tool_calls[{j}].type",
                               f"messages[{i}].tool_calls[{j}].type must be 'function', got {call.type!r}")
            if not call.function.name:
                raise BadField(f"messages[{i}].tool_calls[{j}].function.name",
                               f"messages[{i}].tool_calls[{j}].function.name must not be empty")
            call_ids.add(call.id)
        if m.role == "tool" and m.tool_call_id not in call_ids:
            raise BadField(f"messages[{i}].tool_call_id",
                           f"messages[{i}].tool_call_id {m.tool_call_id!r} matches no tool call of an earlier "
                           "assistant message")


def check_response_format(response_format: ResponseFormat | None) -> None:
    if response_format is None:
        return
    if response_format.type not in RESPONSE_FORMATS:
        raise BadField("response_format.type", f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, "
                                               f"got {response_format.type!r}")
    if response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema is None:
            raise BadField("response_format.json_schema", "response_format of type json_schema needs "
                                                          "json_schema.schema")
        check_json_schema(response_format.json_schema.schema, "response_format.json_schema.schema")


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in kwargs or {}:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise BadField(f"chat_template_kwargs.{key}", f"chat_template_kwargs may not set {key!r}"
                                                          f"{' (set by kvbus itself)' if key.isidentifier() else ''}")


def check_agent_fields(req: Any) -> None:
    """Every check above, on a GenerateRequest."""
    check_tools(req.tools)
    check_tool_choice(req.tool_choice, req.tools)
    check_tool_history(req.messages)
    check_response_format(req.response_format)
    check_chat_template_kwargs(req.chat_template_kwargs)
    if req.messages is None and (req.tools or req.chat_template_kwargs):
        raise BadField("tools" if req.tools else "chat_template_kwargs",
                       "tools and chat_template_kwargs need messages (a chat), not a plain prompt")


def arguments_object(arguments: str) -> Any:
    """A call's arguments (JSON text) as templates want them: the object when the text is one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
