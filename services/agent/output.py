"""A reply's text -> content, reasoning and tool calls: the reasoning parser first, the tool-call parser
on what is left, over a stream of GenerateChunks. The gateway runs this for HTTP and NATS alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import msgspec

from schemas.generate import GenerateChunk, GenerateRequest, ToolCallDelta, ToolChoice
from schemas.tokenizer import ToolCall, ToolCallFunction
from services.agent.reasoning import REASONING_PARSERS
from services.agent.tool_parsers import TOOL_PARSERS
from services.agent.tool_parsers.base import Parsed, ToolParser, new_call_id


@dataclasses.dataclass
class ReplyParser:
    """One reply's parsers; either may be None (then its part passes through)."""

    reasoning: object | None
    tools: ToolParser | None

    def feed(self, text: str) -> tuple[str, Parsed]:
        """(new reasoning, new content and calls) for a new piece of text."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return reasoning, self._tools(content, final=False)

    def finish(self) -> tuple[str, Parsed]:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return reasoning, self._tools(content, final=True)

    def _tools(self, content: str, final: bool) -> Parsed:
        if self.tools is None:
            return Parsed(content=content)
        parsed = self.tools.feed(content) if content else Parsed()
        return parsed.add(self.tools.finish()) if final else parsed

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def chunk(self, chunk: GenerateChunk) -> GenerateChunk:
        """The chunk with its text split into content, reasoning and calls. The last chunk (it has a
        finish reason) flushes what the parsers held back; ``stop`` becomes ``tool_calls`` when the
        reply made calls (``length`` stays: the reply was cut)."""
        reasoning, parsed = self.feed(chunk.text)
        finish_reason = chunk.finish_reason
        if finish_reason is not None:
            more_reasoning, more = self.finish()
            reasoning += more_reasoning
            parsed.add(more)
            if finish_reason == "stop" and self.made_calls:
                finish_reason = "tool_calls"
        return msgspec.structs.replace(chunk, text=parsed.content, finish_reason=finish_reason,
                                       tool_calls=parsed.calls or None,
                                       reasoning_content=reasoning or None if self.reasoning is not None else None)


def forces_calls(req: GenerateRequest) -> bool:
    """Whether the reply must be tool calls (``tool_choice`` ``required`` or a named function): the
    gateway then constrains it with the parser's call grammar, and the parser streams arguments."""
    return bool(req.tools) and (req.tool_choice == "required" or isinstance(req.tool_choice, ToolChoice))


def reply_parser(req: GenerateRequest, *, tool_parser: str | None, reasoning_parser: str | None,
                 new_id: Callable[[], str] = new_call_id) -> ReplyParser | None:
    """The parsers a request needs, or None: tool calls are parsed when the request has tools and
    tool_choice is not ``none``; reasoning for chat requests when the gateway has a reasoning parser."""
    wants_tools = bool(req.tools) and req.tool_choice != "none" and tool_parser is not None
    wants_reasoning = req.messages is not None and reasoning_parser is not None
    if not wants_tools and not wants_reasoning:
        return None
    tools = TOOL_PARSERS.get(tool_parser)(req.tools, parallel=req.parallel_tool_calls, new_id=new_id,
                                          guaranteed=forces_calls(req)) if wants_tools else None
    return ReplyParser(REASONING_PARSERS.get(reasoning_parser)() if wants_reasoning else None, tools)


def merge_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their deltas (the non-streamed reply)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = d.id or call["id"]
        call["name"] = d.name or call["name"]
        call["arguments"] += d.arguments
    return [ToolCall(id=c["id"], function=ToolCallFunction(name=c["name"], arguments=c["arguments"]))
            for _, c in sorted(calls.items())]
