"""KVSender: the prefill worker's end of a KV transfer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bus import tracing
from bus.core import Bus
from bus.errors import InvalidArgument
from schemas.transfer import TransferDescriptor, TransferTarget
from services.transfer.base import Backend, SenderBackend, TransferOptions, available_backends, load_backend
from services.transfer.payload import as_bytes, check_id, dtype_name


class KVSender:
    """Pushes KV payloads to the targets receivers hand out, by the backend each target names.

    One per worker; ``close()`` (or leaving ``async with``) releases what
    receivers have not claimed.
    """

    def __init__(self, bus: Bus, worker_id: str, host_id: str, *, backends: Sequence[str] | None = None,
                 options: TransferOptions = TransferOptions()):
        self.bus = bus
        self.worker_id = check_id("worker id", worker_id)
        self.host_id = host_id
        self.backends = tuple(backends) if backends is not None else available_backends()
        self.options = options
        self._backends: dict[str, Backend] = {name: load_backend(name) for name in self.backends}
        self._senders = {name: b.sender(bus, self.worker_id, options) for name, b in self._backends.items()}

    def backend(self, name: str) -> SenderBackend:
        """This sender's half of backend ``name``."""
        if name not in self.backends:
            raise InvalidArgument(f"transfer backend {name!r} is not enabled on {self.worker_id} "
                                  f"(enabled: {', '.join(self.backends)})")
        return self._senders[name]

    async def send(self, target: TransferTarget, tensor: torch.Tensor, *,
                   scales: Sequence[float] = ()) -> TransferDescriptor:
        """Push ``tensor`` (any shape, dtype and device) to ``target``; returns what the receiver needs.

        ``scales``: fp8 caches' per-tensor scales, passed through in the descriptor.
        """
        check_id("transfer id", target.transfer_id)
        check_id("receiver id", target.receiver_id)
        sender = self.backend(target.backend)
        if self._backends[target.backend].needs_same_host and target.host_id != self.host_id:
            raise InvalidArgument(f"{target.backend} target {target.transfer_id} is on host {target.host_id!r}, "
                                  f"this sender on {self.host_id!r}")
        payload = as_bytes(tensor)
        with tracing.untraced():  # one span for the transfer (the caller's), not one per chunk on the receiver
            sent = await sender.send(target, payload)
        return TransferDescriptor(
            transfer_id=target.transfer_id, backend=target.backend, shape=list(tensor.shape),
            dtype=dtype_name(tensor.dtype), num_bytes=payload.numel(), checksum=sent.checksum,
            num_chunks=sent.num_chunks, shm_name=sent.shm_name, scales=[float(s) for s in scales],
        )

    async def close(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` s for receivers to claim what was sent, then release the rest."""
        for sender in self._senders.values():
            await sender.close(grace)

    async def __aenter__(self) -> "KVSender":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
