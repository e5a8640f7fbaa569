"""One lazy registry for every kind of plug-in: roles, router policies, drafters, transfer backends,
cache-tier links, write policies, tool-call parsers, reasoning parsers, grammar back-ends.

A registry maps a name to ``"module:attribute"``, imported on first use, so a CPU test never imports
CUDA code and a light user (the router) never imports the engine. The registry owns its choices:
CLI ``choices``, validation and the help text all come from it, so adding a plug-in is one module plus
one ``register`` line (or one entry in the dict the registry is built from)::

    TOOL_PARSERS = Registry("tool-call parser", {"hermes": "services.agent.tool_parsers.hermes:HermesParser"})
    TOOL_PARSERS.register("mine", "my_package.parsers:MyParser", doc="my model's format")
    parser_cls = TOOL_PARSERS.get("hermes")
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any


class UnknownPlugin(ValueError):
    """A name no registry entry has; the message lists the known ones."""


class Registry:
    """Names -> lazily imported objects (classes, usually) of one kind."""

    def __init__(self, kind: str, entries: Mapping[str, str] | None = None,
                 docs: Mapping[str, str] | None = None):
        self.kind = kind
        """What the entries are, for messages: ``"router policy"``."""
        self._targets: dict[str, str] = {}
        self._docs: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}
        for name, target in (entries or {}).items():
            self.register(name, target, doc=(docs or {}).get(name, ""))

    def register(self, name: str, target: str | Any, *, doc: str = "") -> None:
        """Add ``name``: a ``"module:attribute"`` path (imported when first asked for) or the object itself.

        Registering a name again replaces it (a third party may override a built-in)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        self._loaded.pop(name, None)
        if isinstance(target, str):
            if target.count(":") != 1:
                raise ValueError(f"{self.kind} {name!r}: target must be 'module:attribute', got {target!r}")
            self._targets[name] = target
        else:
            self._targets[name] = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
            self._loaded[name] = target
        self._docs[name] = doc

    def get(self, name: str) -> Any:
        """The object registered as ``name``; UnknownPlugin (a ValueError) names the known ones."""
        self.check(name)
        if name not in self._loaded:
            module, attr = self._targets[name].split(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._loaded[name] = obj
        return self._loaded[name]

    def check(self, name: str) -> str:
        """``name`` if registered, else UnknownPlugin listing the choices (for config validation)."""
        if name not in self._targets:
            raise UnknownPlugin(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return name

    def names(self) -> list[str]:
        return sorted(self._targets)

    def doc(self, name: str) -> str:
        return self._docs.get(name, "")

    def help(self) -> str:
        """One line per entry, for ``--help`` and docs."""
        return "; ".join(f"{n}: {self._docs[n]}" if self._docs.get(n) else n for n in self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._targets)
