"""The ``nats`` backend: the payload as KVChunkEvents on ``kvbus.v1.kv.{receiver}.{transfer}``.

Works between any two hosts. The sender cuts the payload into chunks no larger
than the receiver asked for and than the server accepts (``bus.max_payload``
less room for headers and the envelope), each with its crc32, and flushes every
``flush_bytes`` so a large payload never piles up in client buffers. The
receiver subscribes once to ``kvbus.v1.kv.{its id}.*``; for each transfer it
expects it checks every chunk on arrival and writes it into place in one buffer,
which it hands over when all are in (chunks of other transfers are dropped).

NOTE: flushing bounds what the *sender* buffers; nats-server still queues up to
its ``max_pending`` (64 MB by default) for a receiver that reads slowly before
dropping it as a slow consumer. The receiver only reads in its event loop, so a
decode worker must not block its loop for long while large transfers arrive.
"""

from __future__ import annotations

import asyncio
import zlib

import torch

from bus.errors import Cancelled, InvalidArgument, Unavailable
from bus.subjects import KV_CHUNK
from schemas.transfer import KVChunkEvent, TransferDescriptor, TransferTarget
from services.transfer.base import (
    Backend,
    ReceiverBackend,
    SenderBackend,
    Sent,
    TransferCorrupted,
    TransferTimeout,
)

HEADROOM_BYTES = 4096
"""Room under the server's max_payload for headers (content type, request id, traceparent) and the envelope."""

MAX_CHUNKS = 1 << 20


def chunk_size(requested: int, max_payload: int | None) -> int:
    if requested <= 0:
        raise InvalidArgument(f"max_chunk_bytes must be positive, got {requested}")
    if max_payload is None:
        return requested
    if max_payload <= 2 * HEADROOM_BYTES:
        raise Unavailable(f"the server's max_payload ({max_payload} B) is too small for KV chunks")
    return min(requested, max_payload - HEADROOM_BYTES)


class NatsSender(SenderBackend):
    name = "nats"

    async def send(self, target: TransferTarget, payload: torch.Tensor) -> Sent:
        # view: [num_bytes] over the payload's own memory (a copy only when it is on a GPU).
        payload = payload.cpu()
        view = memoryview(payload.numpy())
        size = chunk_size(target.max_chunk_bytes, self.bus.max_payload)
        num_chunks = -(-len(view) // size)
        total, unflushed = zlib.crc32(b""), 0
        for index in range(num_chunks):
            piece = view[index * size:(index + 1) * size]
            total = zlib.crc32(piece, total)
            chunk = KVChunkEvent(transfer_id=target.transfer_id, index=index, num_chunks=num_chunks,
                                 data=piece, checksum=zlib.crc32(piece))
            await self.bus.publish(KV_CHUNK, chunk, worker_id=target.receiver_id,
                                   transfer_id=target.transfer_id)
            unflushed += len(piece)
            if unflushed >= self.options.flush_bytes:
                await self.bus.flush()
                unflushed = 0
        await self.bus.flush()
        return Sent(checksum=total, num_chunks=num_chunks)


class _Assembly:
    """One expected transfer, written into its buffer as the chunks arrive.

    The sender cuts evenly, so every chunk but the last has one size S and
    chunk i lands at offset i * S. S is learnt from the first chunk that is not
    the last: NATS keeps one sender's order, so that is chunk 0, and a last
    chunk arriving first is held until then.
    """

    def __init__(self) -> None:
        self.num_chunks = 0
        self.chunk_bytes = 0
        self.last_bytes = 0
        self.num_received = 0
        self.out: torch.Tensor | None = None  # [chunk_bytes * num_chunks] uint8
        self._view: memoryview | None = None
        self._seen = bytearray()
        self._held_last: bytes | None = None
        self.error: Exception | None = None
        self.done = asyncio.Event()

    @property
    def num_bytes(self) -> int:
        return self.chunk_bytes * (self.num_chunks - 1) + self.last_bytes

    def add(self, chunk: KVChunkEvent, max_chunk_bytes: int) -> None:
        """Check and place one chunk; raises TransferCorrupted."""
        tid, index, n = chunk.transfer_id, chunk.index, chunk.num_chunks
        if not self.num_chunks:
            if not 1 <= n <= MAX_CHUNKS:
                raise TransferCorrupted(f"transfer {tid}: bad chunk count {n}")
            self.num_chunks, self._seen = n, bytearray(n)
        if n != self.num_chunks or not 0 <= index < n or self._seen[index]:
            raise TransferCorrupted(f"transfer {tid}: unexpected chunk {index}/{n}")
        if not 0 < len(chunk.data) <= max_chunk_bytes:
            raise TransferCorrupted(f"transfer {tid}: chunk {index} has {len(chunk.data)} B")
        if zlib.crc32(chunk.data) != chunk.checksum:
            raise TransferCorrupted(f"transfer {tid}: checksum mismatch in chunk {index}")
        self._seen[index] = 1
        self.num_received += 1
        if self.out is None:
            if index == n - 1 and n > 1:
                self._held_last = chunk.data
                return
            self.chunk_bytes = len(chunk.data)
            self.out = torch.empty(self.chunk_bytes * n, dtype=torch.uint8)
            self._view = memoryview(self.out.numpy())
        self._place(tid, index, chunk.data)
        if self._held_last is not None:
            self._place(tid, n - 1, self._held_last)
            self._held_last = None
        if self.num_received == n:
            self.done.set()

    def _place(self, tid: str, index: int, data: bytes) -> None:
        is_last = index == self.num_chunks - 1
        if len(data) > self.chunk_bytes or (not is_last and len(data) != self.chunk_bytes):
            raise TransferCorrupted(f"transfer {tid}: chunk {index} has {len(data)} B, "
                                    f"the others {self.chunk_bytes} B")
        offset = index * self.chunk_bytes
        self._view[offset:offset + len(data)] = data
        if is_last:
            self.last_bytes = len(data)

    def result(self) -> torch.Tensor:
        return self.out[:self.num_bytes]

    def fail(self, error: Exception) -> None:
        self.error = error
        self.out = self._view = self._held_last = None  # drop what arrived at once
        self.done.set()


class NatsReceiver(ReceiverBackend):
    name = "nats"

    def __init__(self, bus, worker_id, options):
        super().__init__(bus, worker_id, options)
        self._assemblies: dict[str, _Assembly] = {}
        self._subscription = None
        self.num_dropped_chunks = 0
        """Chunks for transfers not (or no longer) expected: late, cancelled or foreign."""

    @property
    def num_pending(self) -> int:
        return len(self._assemblies)

    async def start(self) -> None:
        self._subscription = await self.bus.subscribe(KV_CHUNK, self._on_chunk, worker_id=self.worker_id)
        await self.bus.flush()  # the server knows the subscription before any sender is told about it

    def expect(self, transfer_id: str) -> None:
        self._assemblies[transfer_id] = _Assembly()

    async def _on_chunk(self, chunk: KVChunkEvent) -> None:
        asm = self._assemblies.get(chunk.transfer_id)
        if asm is None or asm.done.is_set():
            self.num_dropped_chunks += 1
            return
        try:
            asm.add(chunk, self.options.max_chunk_bytes)
        except TransferCorrupted as exc:
            asm.fail(exc)
        except (RuntimeError, MemoryError) as exc:  # the announced size cannot be allocated
            asm.fail(Unavailable(f"transfer {chunk.transfer_id}: cannot hold it: {exc}"))

    async def receive(self, descriptor: TransferDescriptor, timeout: float) -> torch.Tensor:
        tid = descriptor.transfer_id
        asm = self._assemblies.get(tid)
        if asm is None:
            raise InvalidArgument(f"transfer {tid} is not expected here")
        try:
            if descriptor.num_chunks == 0 and descriptor.num_bytes == 0:
                return torch.empty(0, dtype=torch.uint8)
            try:
                async with asyncio.timeout(timeout):
                    await asm.done.wait()
            except TimeoutError:
                raise TransferTimeout(f"transfer {tid}: {asm.num_received}/{asm.num_chunks or descriptor.num_chunks}"
                                      f" chunks after {timeout:g}s") from None
            if asm.error is not None:
                raise asm.error
            if asm.num_chunks != descriptor.num_chunks or asm.num_bytes != descriptor.num_bytes:
                raise TransferCorrupted(f"transfer {tid}: got {asm.num_chunks} chunks, {asm.num_bytes} B; "
                                        f"descriptor says {descriptor.num_chunks}, {descriptor.num_bytes} B")
            return asm.result()
        finally:
            self.discard(tid)

    def discard(self, descriptor_or_id: TransferDescriptor | str) -> None:
        tid = descriptor_or_id if isinstance(descriptor_or_id, str) else descriptor_or_id.transfer_id
        asm = self._assemblies.pop(tid, None)
        if asm is not None and not asm.done.is_set():
            asm.fail(Cancelled(f"transfer {tid} was cancelled"))  # wakes a receive() waiting on it

    async def close(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        self._assemblies.clear()


BACKEND = Backend("nats", NatsSender, NatsReceiver, auto_rank=10)
