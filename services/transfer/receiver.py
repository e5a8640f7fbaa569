"""KVReceiver: the decode worker's end of a KV transfer."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from bus.core import Bus
from bus.errors import InvalidArgument
from schemas.transfer import TransferDescriptor, TransferTarget
from services.transfer.base import (
    AUTO,
    ReceiverBackend,
    TransferOptions,
    available_backends,
    backend_names,
    check_request,
    choose_backend,
    load_backend,
)
from services.transfer.payload import check_descriptor, check_id, rebuild, run_blocking


class KVReceiver:
    """Hands out transfer targets and turns descriptors back into tensors.

    One per worker, made with :meth:`open`. For each transfer: ``expect`` before
    the sender starts, then ``receive`` the sender's descriptor, or ``cancel``.
    Whatever happens, ``receive`` leaves nothing behind: no partial buffers, no
    shared-memory segment.
    """

    def __init__(self, bus: Bus, worker_id: str, host_id: str, requested: str,
                 receivers: dict[str, ReceiverBackend], options: TransferOptions):
        self.bus = bus
        self.worker_id = worker_id
        self.host_id = host_id
        self.requested = requested
        self.options = options
        self._receivers = receivers
        self._expected: dict[str, tuple[str, float]] = {}  # transfer id -> (backend, expected at)

    @classmethod
    async def open(cls, bus: Bus, worker_id: str, host_id: str, backend: str = AUTO, *,
                   backends: Sequence[str] | None = None,
                   options: TransferOptions = TransferOptions()) -> "KVReceiver":
        """Start receiving for ``worker_id``.

        ``backend``: ``auto`` or a registered backend's name (``WorkerConfig.kv_transfer``).
        ``backends``: those this worker supports (default: all this process can use).
        """
        check_id("worker id", worker_id)
        check_request(backend)
        names = tuple(backends) if backends is not None else available_backends()
        if backend != AUTO:
            if backend not in names:
                raise InvalidArgument(f"transfer backend {backend!r} is not among {list(names)}")
            names = (backend,)
        receivers: dict[str, ReceiverBackend] = {}
        try:
            for name in names:
                receivers[name] = load_backend(name).receiver(bus, worker_id, options)
                await receivers[name].start()
        except BaseException:
            for receiver in receivers.values():
                await receiver.close()
            raise
        return cls(bus, worker_id, host_id, backend, receivers, options)

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._receivers)

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    def expect(self, transfer_id: str, *, sender_host_id: str | None = None,
               sender_backends: Sequence[str] | None = None) -> TransferTarget:
        """Get ready for ``transfer_id`` and return the target to give its sender.

        Pass the sender's ``host_id`` and backends (from its heartbeat) when known:
        ``auto`` takes shared memory only for a sender known to share this host, and
        only backends the sender advertises (unknown: every registered one).
        """
        check_id("transfer id", transfer_id)
        self._drop_stale()
        if transfer_id in self._expected:
            raise InvalidArgument(f"transfer {transfer_id} is already expected")
        backend = choose_backend(self.requested, sender_host_id, self.host_id,
                                 backend_names() if sender_backends is None else sender_backends,
                                 self.backends)
        self._receivers[backend].expect(transfer_id)
        self._expected[transfer_id] = (backend, time.monotonic())
        return TransferTarget(transfer_id=transfer_id, backend=backend, receiver_id=self.worker_id,
                              host_id=self.host_id, max_chunk_bytes=self.options.max_chunk_bytes)

    async def receive(self, descriptor: TransferDescriptor, *, timeout: float) -> torch.Tensor:
        """The sent tensor (CPU, the descriptor's shape and dtype).

        Raises TransferTimeout (a ``Timeout``) when the payload is not complete
        within ``timeout`` s, TransferCorrupted (an ``Unavailable``) on a size or
        checksum mismatch, ``Unavailable`` when a segment is gone, and
        ``InvalidArgument`` for a descriptor that does not fit what was expected.
        """
        tid = descriptor.transfer_id
        expected = self._expected.pop(tid, None)
        receiver = self._receivers.get(descriptor.backend)
        try:
            if expected is None:
                raise InvalidArgument(f"transfer {tid} is not expected (cancelled, timed out or unknown)")
            if expected[0] != descriptor.backend:
                raise InvalidArgument(f"transfer {tid} was expected by {expected[0]}, "
                                      f"arrived by {descriptor.backend}")
            dtype, shape = check_descriptor(descriptor)
            buf = await receiver.receive(descriptor, timeout)
            return await run_blocking(descriptor.num_bytes, rebuild, buf, descriptor, dtype, shape)
        finally:
            if receiver is not None:
                receiver.discard(descriptor)
            if expected is not None and expected[0] != descriptor.backend:
                self._receivers[expected[0]].discard(tid)

    def cancel(self, transfer_id: str) -> None:
        """Stop waiting for ``transfer_id`` and drop whatever of it arrived (idempotent).

        A ``receive`` already waiting for it raises ``Cancelled``.
        """
        self._expected.pop(transfer_id, None)
        for receiver in self._receivers.values():
            receiver.discard(transfer_id)

    def _drop_stale(self) -> None:
        cutoff = time.monotonic() - self.options.stale_after
        for tid in [t for t, (_, at) in self._expected.items() if at < cutoff]:
            self.cancel(tid)

    async def close(self) -> None:
        for tid in list(self._expected):
            self.cancel(tid)
        for receiver in self._receivers.values():
            await receiver.close()

    async def __aenter__(self) -> "KVReceiver":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
