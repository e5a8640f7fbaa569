"""Transfer backends: the interface, the registry by name, and the choice of one.

A backend has two halves. Its :class:`SenderBackend` runs in the prefill worker
and pushes a payload (``[num_bytes]`` uint8) towards a
:class:`~schemas.transfer.TransferTarget`; its :class:`ReceiverBackend` runs in
the decode worker and hands the bytes back for a
:class:`~schemas.transfer.TransferDescriptor`. Backends are registered by name
and imported on first use, so choosing ``nats`` never imports shared-memory code
(and a future RDMA backend never imports its drivers in a CPU test).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from bus.core import Bus
from bus.errors import InvalidArgument, Timeout, Unavailable
from schemas.transfer import TransferDescriptor, TransferTarget

REQUESTS = ("auto", "shm", "nats")
"""What a worker may ask for (``WorkerConfig.kv_transfer``)."""


class TransferCorrupted(Unavailable):
    """The payload arrived with a wrong size or checksum: worth retrying on another sender."""


class TransferTimeout(Timeout):
    """The payload did not arrive in time (missing chunks, or a sender that never sent)."""


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """Knobs of the transfer layer; the defaults suit one request of a small model."""

    max_chunk_bytes: int = 1 << 20
    """Receiver: the largest KVChunkEvent body it asks for (senders also stay under the server's max_payload)."""
    flush_bytes: int = 8 << 20
    """Sender (nats): bytes published between flushes (a round trip with the server), bounding buffers."""
    reap_after: float = 120.0
    """Sender (shm): seconds before a segment no receiver claimed is unlinked; above any receive timeout."""
    stale_after: float = 600.0
    """Receiver: seconds after which an expected transfer that was never received or cancelled is dropped."""

    def __post_init__(self) -> None:
        if self.max_chunk_bytes < 1024 or self.flush_bytes < 1:
            raise ValueError("TransferOptions.max_chunk_bytes must be >= 1024 and flush_bytes >= 1")
        if not (self.reap_after > 0 and self.stale_after > 0):
            raise ValueError("TransferOptions.reap_after and stale_after must be > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """What a sender backend reports about a payload it pushed."""

    checksum: int
    num_chunks: int
    shm_name: str | None = None


class SenderBackend(abc.ABC):
    name: ClassVar[str]

    def __init__(self, bus: Bus, worker_id: str, options: TransferOptions):
        self.bus = bus
        self.worker_id = worker_id
        self.options = options

    @abc.abstractmethod
    async def send(self, target: TransferTarget, payload: torch.Tensor) -> Sent:
        """Push ``payload`` ([num_bytes] uint8, any device) to ``target``."""

    async def close(self, grace: float) -> None:
        """Release what is still held, after waiting up to ``grace`` s for receivers to claim it."""


class ReceiverBackend(abc.ABC):
    name: ClassVar[str]

    def __init__(self, bus: Bus, worker_id: str, options: TransferOptions):
        self.bus = bus
        self.worker_id = worker_id
        self.options = options

    async def start(self) -> None:
        """Begin listening (before any target is handed out)."""

    def expect(self, transfer_id: str) -> None:
        """A sender was told to send ``transfer_id`` here."""

    @abc.abstractmethod
    async def receive(self, descriptor: TransferDescriptor, timeout: float) -> torch.Tensor:
        """The payload as a CPU ``[num_bytes]`` uint8 tensor (not yet checksummed as a whole)."""

    def discard(self, descriptor_or_id: TransferDescriptor | str) -> None:
        """Drop everything held for a transfer (idempotent; also for transfers never expected)."""

    async def close(self) -> None:
        """Stop listening and drop everything."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    sender: type[SenderBackend]
    receiver: type[ReceiverBackend]
    is_available: Callable[[], bool] = lambda: True


_REGISTRY: dict[str, str] = {
    "shm": "services.transfer.shm",
    "nats": "services.transfer.nats",
}
"""Backend name -> module holding its ``BACKEND``; imported on first use."""


def register_backend(name: str, module: str) -> None:
    """Add a backend whose module defines ``BACKEND: Backend``."""
    _REGISTRY[name] = module


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def load_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise InvalidArgument(f"unknown transfer backend {name!r}; known: {', '.join(_REGISTRY)}")
    backend = importlib.import_module(_REGISTRY[name]).BACKEND
    assert backend.name == name, f"{_REGISTRY[name]} registers {backend.name!r}, not {name!r}"
    return backend


def available_backends() -> tuple[str, ...]:
    """The backends this process can use (what its heartbeat advertises)."""
    return tuple(name for name in _REGISTRY if load_backend(name).is_available())


def choose_backend(requested: str, sender_host: str | None, receiver_host: str,
                   sender_backends: Sequence[str], receiver_backends: Sequence[str]) -> str:
    """The backend for one transfer.

    ``auto`` takes ``shm`` when both workers are on the same host and both
    support it, else ``nats``. A forced backend must be supported by both, and
    ``shm`` needs the same host; ``sender_host=None`` (not known) is trusted for
    a forced ``shm`` (the sender checks again) and means "another host" for
    ``auto``. Raises InvalidArgument when nothing fits.
    """
    if requested not in REQUESTS:
        raise InvalidArgument(f"kv transfer must be one of {', '.join(REQUESTS)}, got {requested!r}")
    common = [name for name in receiver_backends if name in sender_backends]
    if requested == "auto":
        if "shm" in common and sender_host is not None and sender_host == receiver_host:
            return "shm"
        if "nats" in common:
            return "nats"
        raise InvalidArgument(f"no transfer backend both workers support "
                              f"(sender {list(sender_backends)}, receiver {list(receiver_backends)})")
    if requested not in common:
        raise InvalidArgument(f"transfer backend {requested!r} is not supported by both workers "
                              f"(sender {list(sender_backends)}, receiver {list(receiver_backends)})")
    if requested == "shm" and sender_host is not None and sender_host != receiver_host:
        raise InvalidArgument(f"shm transfer needs one host; sender on {sender_host!r}, "
                              f"receiver on {receiver_host!r}")
    return requested
