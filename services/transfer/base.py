"""Transfer backends: the interface, the registry by name, and the choice of one.

A backend has two halves. Its :class:`SenderBackend` runs in the prefill worker
and pushes a payload (``[num_bytes]`` uint8) towards a
:class:`~schemas.transfer.TransferTarget`; its :class:`ReceiverBackend` runs in
the decode worker and hands the bytes back for a
:class:`~schemas.transfer.TransferDescriptor`. Backends are registered by name
in :data:`BACKENDS` and imported on first use, so choosing ``nats`` never imports
shared-memory code (and a future RDMA backend never imports its drivers in a CPU test).

Adding a backend: 1. a module defining ``BACKEND = Backend(name, Sender, Receiver, ...)``
(its ``needs_same_host`` and ``auto_rank`` say when ``auto`` may take it);
2. ``register_backend(name, "module")`` (or one line in :data:`BACKENDS`). Worker
configuration, ``--kv-transfer`` choices, heartbeats and the wire schemas (plain
``str``) take their names from the registry.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from bus.errors import InvalidArgument, Timeout, Unavailable
from schemas.transfer import TransferDescriptor, TransferTarget
from services.plugins import Registry

if TYPE_CHECKING:  # light importers (worker configuration) need the names, not torch
    import torch

    from bus.core import Bus

AUTO = "auto"
"""What a worker may ask for besides a backend's name: the best one both ends support."""


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
    needs_same_host: bool = False
    """Sender and receiver must share a host (``shm``): forced across hosts it is refused, and ``auto``
    takes it only for a sender known to share the receiver's host."""
    auto_rank: int = 100
    """``auto`` takes the fitting backend both ends support with the lowest rank (``shm`` 0, ``nats`` 10)."""


BACKENDS = Registry("transfer backend", {
    "shm": "services.transfer.shm:BACKEND",
    "nats": "services.transfer.nats:BACKEND",
}, docs={
    "shm": "a shared-memory segment per transfer (same host; NATS carries the descriptor)",
    "nats": "chunked NATS messages under the server's max_payload (any host)",
})
"""Backend name -> its ``Backend``, imported on first use."""


def register_backend(name: str, target: str | Backend, *, doc: str = "") -> None:
    """Add a backend: a module defining ``BACKEND: Backend``, a ``"module:attribute"`` path, or the
    ``Backend`` itself. Registering a name again replaces it."""
    if isinstance(target, str) and ":" not in target:
        target = f"{target}:BACKEND"
    BACKENDS.register(name, target, doc=doc)


def backend_names() -> tuple[str, ...]:
    """Every registered backend, whether or not this process can use it."""
    return tuple(BACKENDS.names())


def transfer_choices() -> tuple[str, ...]:
    """What a worker may ask for (``WorkerConfig.kv_transfer``, ``--kv-transfer``): auto or a backend."""
    return (AUTO, *backend_names())


def check_request(requested: str) -> str:
    """``requested`` if it is auto or a registered backend, else InvalidArgument naming the choices."""
    if requested != AUTO and requested not in BACKENDS:
        raise InvalidArgument(f"kv transfer must be one of {', '.join(transfer_choices())}, got {requested!r}")
    return requested


def load_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise InvalidArgument(f"unknown transfer backend {name!r}; known: {', '.join(backend_names())}")
    backend: Any = BACKENDS.get(name)
    if not isinstance(backend, Backend) or backend.name != name:
        raise ValueError(f"transfer backend {name!r} is registered as {backend!r}, not a Backend named {name!r}")
    return backend


def available_backends() -> tuple[str, ...]:
    """The backends this process can use (what its heartbeat advertises)."""
    return tuple(name for name in backend_names() if load_backend(name).is_available())


def choose_backend(requested: str, sender_host: str | None, receiver_host: str,
                   sender_backends: Sequence[str], receiver_backends: Sequence[str]) -> str:
    """The backend for one transfer.

    ``auto`` takes, of the backends both workers support, the one with the lowest
    ``auto_rank`` that fits: ``shm`` when both are on the same host, else ``nats``.
    A forced backend must be supported by both, and one that needs the same host
    (``shm``) needs it; ``sender_host=None`` (not known) is trusted for a forced
    ``shm`` (the sender checks again) and means "another host" for ``auto``.
    Raises InvalidArgument when nothing fits.
    """
    check_request(requested)
    common = [name for name in receiver_backends if name in sender_backends and name in BACKENDS]
    is_same_host = sender_host is not None and sender_host == receiver_host
    if requested == AUTO:
        fitting = [load_backend(name) for name in common]
        fitting = [b for b in fitting if is_same_host or not b.needs_same_host]
        if fitting:
            return min(fitting, key=lambda b: (b.auto_rank, b.name)).name
        raise InvalidArgument(f"no transfer backend both workers support "
                              f"(sender {list(sender_backends)}, receiver {list(receiver_backends)})")
    if requested not in common:
        raise InvalidArgument(f"transfer backend {requested!r} is not supported by both workers "
                              f"(sender {list(sender_backends)}, receiver {list(receiver_backends)})")
    if load_backend(requested).needs_same_host and sender_host is not None and not is_same_host:
        raise InvalidArgument(f"{requested} transfer needs one host; sender on {sender_host!r}, "
                              f"receiver on {receiver_host!r}")
    return requested
