"""``<think>...</think>`` reasoning, streamed: the text inside goes to reasoning_content, the rest is content.

Like the tool-call parsers, decisions depend only on the text, never on how it was split into pieces.
Whitespace right after ``</think>`` is dropped (templates put a blank line there).
"""

from __future__ import annotations

from services.agent.tool_parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ThinkReasoningParser:
    name = ""
    is_reasoning_without_tag = False
    """True: the reply is reasoning from its start even without ``<think>`` (the template opened it)."""

    def __init__(self):
        self.buffer = ""
        self.mode = "start"  # start -> reasoning -> after -> content

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._parse(final=False)

    def finish(self) -> tuple[str, str]:
        return self._parse(final=True)

    def _parse(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.mode == "start":
            head = self.buffer.lstrip()
            if not final and OPEN.startswith(head):
                return "", ""  # whitespace or the start of <think>, so far
            if head.startswith(OPEN):
                self.mode, self.buffer = "reasoning", head[len(OPEN):]
            else:
                self.mode = "reasoning" if self.is_reasoning_without_tag else "content"
        if self.mode == "reasoning":
            end = self.buffer.find(CLOSE)
            if end < 0:
                keep = 0 if final else partial_suffix(self.buffer, CLOSE)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
            self.mode = "after"
        if self.mode == "after":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return reasoning, ""
            self.mode = "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    is_reasoning_without_tag = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
