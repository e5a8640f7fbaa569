"""Reading deploy/nats/*.conf in tests: NATS subject matching and the lists a block allows."""

from __future__ import annotations

import re


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def allowed(block: str, direction: str) -> list[str]:
    """The subjects of the first ``publish``/``subscribe`` ``allow`` list in ``block``."""
    found = re.search(rf"{direction}:\s*\{{\s*allow:\s*\[(.*?)\]", block, re.S)
    assert found, f"no {direction} allow list in {block[:80]!r}"
    return re.findall(r'"([^"]+)"', found.group(1))


def block(text: str, opening: str) -> str:
    """The text of the ``{ ... }`` block that starts at the first ``opening`` (which ends with ``{``)."""
    start = text.index(opening) + len(opening)
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise ValueError(f"unbalanced braces after {opening!r}")
