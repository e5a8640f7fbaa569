"""A KV payload as bytes and back: dtype names, checksums, rebuilding the tensor.

The payload of one request is ``[num_pages, num_layers, 2, page_size, num_kv_heads,
head_dim]`` in any dtype; on the wire it is its raw bytes, described by a
:class:`~schemas.transfer.TransferDescriptor` (shape, dtype name, size, crc32).
Nothing here copies unless it has to: a contiguous tensor is viewed as bytes.
"""

from __future__ import annotations

import asyncio
import math
import re
import zlib
from collections.abc import Callable
from typing import TypeVar

import torch

from bus.errors import InvalidArgument
from schemas.transfer import TransferDescriptor
from services.transfer.base import TransferCorrupted

T = TypeVar("T")

# Worker and transfer ids become subject tokens and shared-memory names.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Below this many bytes a copy or checksum runs inline: a thread hop costs more.
INLINE_BYTES = 1 << 20


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise InvalidArgument(f"{kind} must be 1-64 characters of [A-Za-z0-9_-], got {value!r}")
    return value


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[num_bytes]`` uint8 on its own device; a view when it is contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"a KV payload must be a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown KV dtype {name!r}")
    return dtype


def check_descriptor(descriptor: TransferDescriptor) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape a descriptor announces, once they agree with its byte count."""
    dtype = parse_dtype(descriptor.dtype)
    shape = tuple(descriptor.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"negative dimension in KV shape {list(shape)}")
    expected = math.prod(shape) * dtype.itemsize
    if expected != descriptor.num_bytes:
        raise InvalidArgument(f"KV shape {list(shape)} of {descriptor.dtype} is {expected} bytes, "
                              f"descriptor says {descriptor.num_bytes}")
    return dtype, shape


def checksum(data: torch.Tensor | memoryview | bytes) -> int:
    """zlib.crc32 of a CPU uint8 tensor (no copy) or any buffer."""
    return zlib.crc32(data.numpy() if isinstance(data, torch.Tensor) else data)


def rebuild(buf: torch.Tensor, descriptor: TransferDescriptor, dtype: torch.dtype,
            shape: tuple[int, ...]) -> torch.Tensor:
    """Verify the whole payload's crc32 and view ``buf`` ([num_bytes] uint8) as the KV tensor."""
    if buf.numel() != descriptor.num_bytes:
        raise TransferCorrupted(f"transfer {descriptor.transfer_id}: got {buf.numel()} bytes, "
                                f"expected {descriptor.num_bytes}")
    if checksum(buf) != descriptor.checksum:
        raise TransferCorrupted(f"transfer {descriptor.transfer_id}: payload checksum mismatch")
    return buf.view(dtype).view(shape)


async def run_blocking(num_bytes: int, fn: Callable[..., T], *args) -> T:
    """Run a copy or checksum of ``num_bytes``: inline when small, else in a thread.

    NOTE: the thread always runs to completion, even when the caller is
    cancelled, because it may be reading a shared-memory mapping that the
    caller's cleanup is about to unmap.
    """
    if num_bytes < INLINE_BYTES:
        return fn(*args)
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                continue
            except Exception:
                break
        raise
