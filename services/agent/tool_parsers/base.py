"""What every tool-call parser shares: the streaming contract, call validation, ids and deltas.

Contract: ``feed(text)`` for each new piece of the model's text, ``finish()`` once at the end; each
returns a :class:`Parsed` (new content, and tool-call deltas). Whatever the pieces, the content joined
and the calls merged are the same as for the whole text fed at once: decisions depend only on the
text, never on where a piece ends (tests/unit/test_tool_parsers.py feeds every output split at every
character). Each call goes out as OpenAI streams it: first a delta with its id and name, then its
arguments (JSON text).

Unconstrained output (``tool_choice`` ``auto``): a call is sent only once its JSON is complete and
valid, so text that merely looks like a call (broken JSON, no name) stays content; its arguments come
in one delta, since a stream cannot take back what it sent. Output the call grammar enforces
(``guaranteed``: ``tool_choice`` ``required`` or a named function) is calls by construction: a call's
id and name go out as soon as its name is complete and its arguments piece by piece as the model
writes them (:class:`LiveCall`), exactly the model's JSON text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from schemas.generate import ToolCallDelta
from schemas.tokenizer import Tool


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's JSON text, or None when it is not a call.

    Accepted: an object with a non-empty string ``name`` and ``arguments`` or ``parameters`` that is
    an object or a string holding a JSON object (some models quote it); missing arguments are ``{}``.
    """
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (held back: it may
    become the marker with the next piece)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    """Base class: subclasses implement ``_parse(final)`` over ``self.buffer`` and call ``_content``
    and ``_call``; the base holds whitespace around calls back, numbers the calls and makes deltas."""

    name = ""

    def __init__(self, tools: list[Tool] | None = None, *, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id, guaranteed: bool = False):
        self.tool_names = {t.function.name for t in tools or ()}
        self.parallel = parallel
        """False: only the first call counts (OpenAI's parallel_tool_calls=false); later ones are dropped."""
        self.guaranteed = guaranteed
        """The call grammar constrains the output: calls stream their arguments (:meth:`_live_call`)."""
        self._live: LiveCall | None = None
        self.new_id = new_id
        self.buffer = ""
        self.num_calls = 0
        self._held_space = ""
        self._after_call = False
        self._out = Parsed()
        self._is_finished = False

    def feed(self, text: str) -> Parsed:
        if self._is_finished:
            raise RuntimeError(f"{type(self).__name__}: feed after finish")
        self.buffer += text
        self._parse(final=False)
        return self._take()

    def finish(self) -> Parsed:
        if not self._is_finished:
            self._parse(final=True)
            self._is_finished = True
            if not self.num_calls:  # plain text keeps its whitespace: content is exactly the text
                self._out.content += self._held_space
            self._held_space = ""
        return self._take()

    # --- for subclasses ----------------------------------------------------------------------
    def _parse(self, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        """Content, except whitespace at its end: held until more content follows (whitespace
        before, between and after calls is dropped, so a reply of calls alone has no content)."""
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        body = text.rstrip()
        if body:
            self._out.content += self._held_space + body
            self._held_space = ""
        self._held_space += text[len(body):]

    def _call(self, name: str, arguments: dict[str, Any]) -> None:
        index = self._open_call(name)
        if index is not None:
            self._out.calls.append(ToolCallDelta(index=index, arguments=json.dumps(arguments, ensure_ascii=False)))

    def _open_call(self, name: str) -> int | None:
        """A call named ``name`` starts: its first delta (id and name) goes out; its index, or None when
        parallel_tool_calls=false drops it (a call came before)."""
        self._held_space, self._after_call = "", True
        if self.num_calls and not self.parallel:
            return None
        index = self.num_calls
        self.num_calls += 1
        self._out.calls.append(ToolCallDelta(index=index, id=self.new_id(), name=name, arguments=""))
        return index

    def _live_call(self, text: str, *, complete: bool, block: str | None = None) -> None:
        """Guaranteed output: ``text`` is the JSON of the call being written, so far (``complete``: all
        of it). Its id and name go out once the name is complete, then each new piece of its arguments.
        A call whose JSON does not open with its name (the grammar allows the keys in any order) is sent
        whole once complete; one that is no call even then (cut before its name) is content: ``block``,
        the format's whole text of it (its tags too), else ``text``."""
        live = self._live
        if live is None:
            head = _CALL_HEAD.match(text)
            if head is None or not text[head.end():].lstrip().startswith("{"):
                if complete:
                    call = parse_call(text)
                    self._call(*call) if call else self._content(text if block is None else block)
                return
            live = self._live = LiveCall(self._open_call(json.loads(f'"{head.group(1)}"')), head.end())
        piece = live.arguments(text)
        if piece and live.index is not None:
            self._out.calls.append(ToolCallDelta(index=live.index, arguments=piece))
        if complete:
            self._live = None

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        return out

    # --- constrained decoding: the grammar of this format's calls -------------------------------
    @classmethod
    def call_grammar(cls, tools: list[Tool], *, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose sentences are calls in this format to ``tools``
        with arguments valid for each tool's schema: tool_choice ``required`` or a named function."""
        raise NotImplementedError(f"{cls.__name__} has no call grammar")


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
"""The opening of a call object whose name comes first: ``{"name": "f", "arguments": `` (or ``parameters``)."""


class LiveCall:
    """The call being written (guaranteed output): its index (None: dropped, parallel_tool_calls=false),
    where its arguments object starts in the call's text, how much of it was sent, and where it ends."""

    def __init__(self, index: int | None, start: int):
        self.index = index
        self.start = self.sent = start
        self._scan = ObjectEnd()
        self._end: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments' text in ``text`` (the call so far) not sent yet: up to the object's closing
        brace once seen (what follows it is the call's own closing)."""
        if self._end is None:
            end = self._scan.feed(text[self.start:])
            self._end = None if end is None else self.start + end
        stop = len(text) if self._end is None else self._end
        piece, self.sent = text[self.sent:stop], max(self.sent, stop)
        return piece


class ObjectEnd:
    """Finds where a JSON object that starts a text ends, reading each character once across feeds."""

    def __init__(self):
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """Index just past the object's closing brace in ``text`` (which only grew since the last
        call), or None while it is still open."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def call_schema(tools: list[Tool], *, arguments_key: str) -> dict[str, Any]:
    """JSON Schema of one call object ``{"name": <one of tools>, <arguments_key>: <its parameters>}``."""
    variants = []
    for tool in tools:
        parameters = tool.function.parameters or {"type": "object"}
        variants.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          arguments_key: parameters},
                         "required": ["name", arguments_key], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # llguidance: compact JSON, so a sampler cannot loop on whitespace (grammar.JSON_OPTIONS)
    return {**schema, "x-guidance": {"whitespace_flexible": False}}
