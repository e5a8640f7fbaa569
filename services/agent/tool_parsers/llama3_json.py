"""Llama 3.1 / 3.2 / 3.3's JSON tool calls: the whole reply is the call, optionally after ``<|python_tag|>``
(a special token: seen only when special tokens are kept in the text), several separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not start with ``{`` (or the tag) is content. A first object that is not a call makes
the whole reply content; text after the last call that is not another call is content.
"""

from __future__ import annotations

import json

from schemas.tokenizer import Tool
from services.agent.tool_parsers.base import ObjectEnd, ToolParser, call_schema, parse_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._mode = "start"  # start -> calls -> content
        self._scan = ObjectEnd()
        self._raw = ""
        """Every piece fed while no call is made yet: the content if the first object is no call."""

    def feed(self, text: str):
        if not self.num_calls and self._mode != "content":
            self._raw += text
        return super().feed(text)

    def _parse(self, final: bool) -> None:
        if self._mode == "start":
            head = self.buffer.lstrip()
            tagged = head.startswith(PYTHON_TAG)
            body = head[len(PYTHON_TAG):].lstrip() if tagged else head
            if not final and (not body if tagged else (not head or PYTHON_TAG.startswith(head))):
                return  # undecided so far: whitespace, the tag or the start of it
            if body.startswith("{"):
                self._mode, self.buffer = "calls", body
            else:
                self._mode = "content"
        if self._mode == "calls":
            self._parse_calls(final)
        if self._mode == "content":
            self._content(self.buffer)
            self.buffer = ""

    def _parse_calls(self, final: bool) -> None:
        while True:
            rest = self.buffer.lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                self.buffer = "" if final else self.buffer
                return
            if not rest.startswith("{"):
                self._give_up(rest)
                return
            if len(rest) != len(self.buffer):  # a new object starts here
                self.buffer, self._scan = rest, ObjectEnd()
            end = self._scan.feed(self.buffer)
            if end is None:
                if self.guaranteed:
                    self._live_call(self.buffer, complete=final)
                    self.buffer = "" if final else self.buffer
                elif final:
                    self._give_up(self.buffer)
                return
            if self.guaranteed:
                self._live_call(self.buffer[:end], complete=True)
                self.buffer, self._scan = self.buffer[end:], ObjectEnd()
                continue
            call = parse_call(self.buffer[:end])
            if call is None:
                self._give_up(self.buffer)
                return
            self._call(*call)
            self.buffer, self._scan = self.buffer[end:], ObjectEnd()

    def _give_up(self, rest: str) -> None:
        """Not (or no more) calls: the rest is content; with no call made, the whole reply is."""
        self._mode = "content"
        self.buffer = rest if self.num_calls else self._raw

    @classmethod
    def call_grammar(cls, tools: list[Tool], *, parallel: bool) -> str:
        schema = json.dumps(call_schema(tools, arguments_key="parameters"))
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {schema}\n"
