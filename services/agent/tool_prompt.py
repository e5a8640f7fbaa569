"""Chat messages with tools -> what a chat template renders: through the template's own tool support
when it has some, else through kvbus's fallback format (docs/agents.md, "Templates without tools").

The fallback teaches the Hermes convention, which the default ``hermes`` tool-call parser reads:

- the tools go in a system message (appended to the first one, or a new one in front): each tool's
  JSON, between ``<tools>`` and ``</tools>``, and how to call one, ``<tool_call>{json}</tool_call>``;
- an assistant message's calls become its text: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
- tool results become messages of role ``tool`` (or ``user``, for a template that refuses the role
  ``tool``): ``<tool_response>\\n...\\n</tool_response>``, consecutive results in one message.

Measured with SmolLM2-135M-Instruct: with results under role ``tool`` it repeats a call pattern shown
twice in the history (greedy); under ``user`` it needed three examples.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from schemas.tokenizer import ChatMessage, Tool
from services.agent.tools import arguments_object

FALLBACK_TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. "
    "The functions you may call are described within <tools></tools> tags:\n<tools>\n")
FALLBACK_TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, reply with a JSON object giving its name and arguments within "
    "<tool_call></tool_call> tags, one call per block:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>\n"
    "The results come back within <tool_response></tool_response> tags.")


def tool_dict(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": tool.type, "function": function}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as HF chat templates take them (arguments as objects, as transformers' docs ask)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def fallback_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                      result_role: str = "tool") -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` messages carrying tools, calls and results as text (see above)."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            result = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if out and out[-1].get("is_tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": result_role, "content": result, "is_tool_result": True})
            continue
        content = m.content or ""
        if m.tool_calls:
            calls = [f"<tool_call>\n{json.dumps({'name': c.function.name, 'arguments': arguments_object(c.function.arguments)}, ensure_ascii=False)}\n</tool_call>"  # noqa: E501
                     for c in m.tool_calls]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": m.role, "content": content})
    for d in out:
        d.pop("is_tool_result", None)
    if tools:
        section = FALLBACK_TOOLS_HEADER + "\n".join(json.dumps(tool_dict(t), ensure_ascii=False) for t in tools) \
            + FALLBACK_TOOLS_FOOTER
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` (it reads the variable) and so, we take it, tool calls
    and tool messages too (true of the Qwen2.5, Hermes, Llama 3.1 and Mistral templates)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "tools" in template
    return "tools" in jinja2.meta.find_undeclared_variables(ast)
