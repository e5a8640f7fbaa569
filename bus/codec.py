"""Encoding of Structs on the wire: JSON for public subjects, MessagePack inside.

The content type travels in the ``Content-Type`` header; a receiver decodes by
that header (falling back to the subject's default), so any language may send
JSON to any subject. Encoders and decoders are built once per type.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import msgspec

from bus.errors import InvalidArgument

CONTENT_TYPE_HEADER = "Content-Type"


class Encoding(str, enum.Enum):
    JSON = "application/json"
    MSGPACK = "application/msgpack"

    @classmethod
    def from_header(cls, value: str | None, default: "Encoding") -> "Encoding":
        if not value:
            return default
        value = value.split(";", 1)[0].strip().lower()
        if value in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack"):
            return cls.MSGPACK
        if value == "application/json":
            return cls.JSON
        raise InvalidArgument(f"unsupported content type {value!r}: use application/json or application/msgpack")


_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def encode(message: Any, encoding: Encoding) -> bytes:
    if encoding is Encoding.JSON:
        return _json_encoder.encode(message)
    return _msgpack_encoder.encode(message)


@functools.lru_cache(maxsize=None)
def _decoder(type_: type, encoding: Encoding):
    if encoding is Encoding.JSON:
        return msgspec.json.Decoder(type_)
    return msgspec.msgpack.Decoder(type_)


def decode(data: bytes, type_: type, encoding: Encoding, subject: str | None = None) -> Any:
    """Decode ``data`` as ``type_``; a malformed payload raises InvalidArgument.

    The message names the subject (when given), the expected type and the encoding, and
    msgspec's reason (which names an unknown or mistyped field and its path), so a
    message of the wrong type or version is refused with a clear error.
    """
    try:
        return _decoder(type_, encoding).decode(data if data else _empty(encoding))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        where = f" on {subject}" if subject else ""
        kind = "JSON" if encoding is Encoding.JSON else "MessagePack"
        raise InvalidArgument(f"malformed {type_.__name__} ({kind}){where}: {exc}") from None


def _empty(encoding: Encoding) -> bytes:
    # An empty body stands for an empty object (e.g. HealthRequest from the CLI).
    return b"{}" if encoding is Encoding.JSON else b"\x80"
