"""Service configuration: one frozen dataclass per service, CLI and env generated from it.

A field's help text is the string literal written under it (an attribute
docstring). Precedence: command-line flag > ``KVBUS_<FIELD>`` environment
variable > the dataclass default. A bad environment value fails loudly, naming
the variable. A ``tuple[str, ...]`` field is a repeatable flag (``--api-key A
--api-key B``) and a comma-separated environment variable.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import os
import textwrap
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "KVBUS_"


class ConfigError(ValueError):
    """A configuration value is missing or malformed."""


def plugin(registry: str, default: Any, *, extra: tuple[str, ...] = ()) -> Any:
    """A field naming an entry of a plug-in registry (``"module:ATTRIBUTE"`` of a
    :class:`services.plugins.Registry`), or one of ``extra`` (``"auto"``, ``"off"``): its flag's
    choices and help come from the registry, and :func:`check_choices` checks it, so a plug-in
    registered in one place is offered, described and validated everywhere. An optional field
    (``str | None``) also takes ``none``."""
    return dataclasses.field(default=default, metadata={"registry": registry, "extra": tuple(extra)})


def _registry(f: dataclasses.Field) -> Any:
    """The Registry a :func:`plugin` field names (None for other fields)."""
    path = f.metadata.get("registry")
    if path is None:
        return None
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases, by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _is_repeated(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, ...)


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, is_optional) of a field annotation like ``int | None``."""
    if _is_repeated(tp):
        return str, False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config field type {tp}")
        return _base_type(args[0])[0], True
    if typing.get_origin(tp) is typing.Literal:
        return str, False
    return tp, False


def _parse(value: str | list[str], tp: Any, where: str) -> Any:
    if _is_repeated(tp):  # repeated flag (a list) or a comma-separated environment value
        items = value if isinstance(value, list) else value.split(",")
        return tuple(item.strip() for item in items if item.strip())
    base, optional = _base_type(tp)
    if optional and value.strip().lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(base, '__name__', base)}") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field of ``cls``; defaults stay unset so env can apply."""
    docs = field_docs(cls)
    hints = _hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        base, _ = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f"{docs.get(f.name, '')} [env {env_name(f.name)}; default {default!r}]"
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else None
        registry = _registry(f)
        if registry is not None:
            choices = [*f.metadata["extra"], *registry.names(), *(["none"] if _base_type(hints[f.name])[1] else [])]
            help_text += f" ({registry.kind}s: {registry.help()})"
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        elif _is_repeated(hints[f.name]):
            group.add_argument(flag, dest=f.name, action="append", type=str, default=argparse.SUPPRESS,
                               metavar="STR", help=help_text + " (repeatable)")
        else:
            group.add_argument(flag, dest=f.name, type=str, default=argparse.SUPPRESS, choices=choices,
                               metavar=None if choices else base.__name__.upper(), help=help_text)


def check_choices(config: Any) -> None:
    """ConfigError naming the first ``Literal`` or :func:`plugin` field of ``config`` whose value is not
    one of its choices (a plug-in field: its registry's names and its ``extra``; None where optional).

    Flags are checked by argparse already; call this from ``__post_init__`` so that environment values
    and configs built in code are checked too."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{type(config).__name__}.{f.name} must be one of "
                              f"{', '.join(map(str, choices))}, got {value!r}")
        registry = _registry(f)
        if registry is None or value in f.metadata["extra"] or (value is None and _base_type(hints[f.name])[1]):
            continue
        if value not in registry:
            raise ConfigError(f"{type(config).__name__}.{f.name}: unknown {registry.kind} {value!r}; choose one of: "
                              f"{', '.join([*f.metadata['extra'], *registry.names()])}")


def build(cls: type[T], args: argparse.Namespace | dict | None = None,
          env: typing.Mapping[str, str] | None = None) -> T:
    """Make ``cls`` from parsed flags, then ``KVBUS_*`` env, then defaults."""
    env = os.environ if env is None else env
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in given:
            raw = given[f.name]
            values[f.name] = _parse(raw, hints[f.name], "--" + f.name.replace("_", "-")) \
                if isinstance(raw, str) or (isinstance(raw, list) and _is_repeated(hints[f.name])) else raw
        elif env_name(f.name) in env:
            values[f.name] = _parse(env[env_name(f.name)], hints[f.name], env_name(f.name))
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
