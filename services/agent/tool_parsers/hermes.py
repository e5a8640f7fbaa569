"""Hermes' tool-call format (also Qwen2.5 / Qwen3's, and kvbus's fallback prompt's):

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ...}
    </tool_call>

Calls may follow content and each other (parallel calls). A block whose JSON is not a call stays
content, tags and all. A block left open at the end (the model or a stop string cut the closing tag)
is a call when its JSON is one.
"""

from __future__ import annotations

import json

from schemas.tokenizer import Tool
from services.agent.tool_parsers.base import ToolParser, call_schema, parse_call, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_call = False
        self._searched = 0
        """Where the search for the closing tag goes on (the text before it holds none)."""

    def _parse(self, final: bool) -> None:
        while True:
            if not self._in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = 0 if final else partial_suffix(self.buffer, OPEN)
                    self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return
                self._content(self.buffer[:start])
                self.buffer = self.buffer[start:]
                self._in_call, self._searched = True, len(OPEN)
            end = self.buffer.find(CLOSE, self._searched)
            if end < 0:
                self._searched = max(len(OPEN), len(self.buffer) - len(CLOSE) + 1)
                if self.guaranteed:
                    self._live_call(self.buffer[len(OPEN):], complete=final, block=self.buffer)
                elif final:
                    call = parse_call(self.buffer[len(OPEN):])
                    self._call(*call) if call else self._content(self.buffer)
                if final:
                    self.buffer = ""
                return
            block, self.buffer = self.buffer[:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            self._in_call = False
            if self.guaranteed:
                self._live_call(block[len(OPEN):end], complete=True)
                continue
            call = parse_call(block[len(OPEN):end])
            self._call(*call) if call else self._content(block)

    @classmethod
    def call_grammar(cls, tools: list[Tool], *, parallel: bool) -> str:
        schema = json.dumps(call_schema(tools, arguments_key="arguments"))
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n'
