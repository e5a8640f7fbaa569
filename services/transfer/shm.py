"""The ``shm`` backend: one POSIX shared-memory segment per transfer, on one host.

The sender creates ``kvbus-<sender id>-<instance>-<nonce>-<transfer id>``
(``instance``: random per :class:`ShmSender`, so two processes with one worker
id never collide; ``nonce``: 128 random bits per segment, so no name can be
guessed from another one), owner-only (mode 0600, whatever the umask), copies
the payload in, unmaps it and names it in the descriptor. The
receiver maps it and unlinks it at once (unlinking is the claim); the tensor it
hands over is a view of that mapping, so receiving copies nothing, and the
memory goes back to the system when the tensor is freed. The sender polls its
own segments: one that is gone was claimed; one still there after
``reap_after`` s is unlinked by the sender.

NOTE: Python's resource tracker. A process that creates a segment with
``SharedMemory`` (or, before 3.13, attaches one) registers it with its tracker,
which unlinks what is still registered when the process dies and warns about
"leaked" segments. The sender keeps its registration while it owns a segment
(so a crashed sender still cleans up) and drops it once a receiver has claimed
the segment. The receiver maps segments with ``shm_open`` + ``mmap`` itself and
never registers them: the tracker keeps one set of names per process, so a
second registration from a receiver in the sender's own process would make the
two unregistrations collide.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import time
from multiprocessing import resource_tracker, shared_memory

import torch

from bus.errors import InvalidArgument, Unavailable
from schemas.transfer import TransferDescriptor, TransferTarget
from services.transfer.base import Backend, ReceiverBackend, SenderBackend, Sent, TransferCorrupted
from services.transfer.payload import checksum, run_blocking

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "kvbus-"

try:
    import _posixshmem
except ImportError:  # Windows
    _posixshmem = None


def is_available() -> bool:
    return _posixshmem is not None


SEGMENT_MODE = 0o600
"""Owner-only: another user on the host can neither read nor write a request's pages."""


def segment_name(sender_id: str, instance: str, transfer_id: str) -> str:
    """A fresh, unguessable name: knowing one segment's name tells nothing about the next one's."""
    return f"{SEGMENT_PREFIX}{sender_id}-{instance}-{secrets.token_hex(16)}-{transfer_id}"


def segment_exists(name: str) -> bool:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0o600)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def _untrack(name: str) -> None:
    resource_tracker.unregister("/" + name, "shared_memory")


def unlink_segment(name: str, *, tracked: bool) -> bool:
    """Unlink ``name`` if it exists; forget it in this process's tracker if ``tracked``."""
    try:
        _posixshmem.shm_unlink("/" + name)
        existed = True
    except FileNotFoundError:
        existed = False
    if tracked:
        _untrack(name)
    return existed


def _fill(shm: shared_memory.SharedMemory, payload: torch.Tensor) -> int:
    # dst: [num_bytes] uint8 over the mapping; payload may live on any device.
    dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=payload.numel())
    if payload.is_cuda:
        dst.copy_(payload)
    else:
        # NOTE: a plain memcpy, not torch's copy_: this runs on a helper thread, and a torch
        # parallel region there would start a second OpenMP pool that slows the engine's
        # steps (services/engine/engine_thread.py).
        dst.numpy()[:] = payload.contiguous().numpy()
    crc = checksum(dst)
    del dst  # NOTE: the mapping cannot be closed while a tensor exports its buffer
    return crc


def _attach(name: str) -> mmap.mmap:
    """Map an existing segment without registering it anywhere (see the NOTE above)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class ShmSender(SenderBackend):
    name = "shm"

    def __init__(self, bus, worker_id, options):
        super().__init__(bus, worker_id, options)
        self.instance = secrets.token_hex(3)
        self._deadlines: dict[str, float] = {}  # segment name -> monotonic time to reap it
        self._reaper: asyncio.Task | None = None
        resource_tracker.ensure_running()  # now, not on the first transfer (it starts a process)

    @property
    def num_segments(self) -> int:
        """Segments this sender still owns (not yet claimed, reaped or closed)."""
        return len(self._deadlines)

    async def send(self, target: TransferTarget, payload: torch.Tensor) -> Sent:
        num_bytes = payload.numel()
        if num_bytes == 0:
            return Sent(checksum=checksum(b""), num_chunks=0)
        name = segment_name(self.worker_id, self.instance, target.transfer_id)
        try:
            shm = shared_memory.SharedMemory(name, create=True, size=num_bytes)
        except FileExistsError:
            raise InvalidArgument(f"transfer {target.transfer_id} was already sent") from None
        except OSError as exc:  # /dev/shm full or too small
            raise Unavailable(f"cannot create a {num_bytes} B shared-memory segment: {exc}") from None
        os.fchmod(shm._fd, SEGMENT_MODE)  # NOTE: already 0600 on CPython; stated here, not assumed
        self._deadlines[name] = time.monotonic() + self.options.reap_after
        try:
            crc = await run_blocking(num_bytes, _fill, shm, payload)
        except BaseException:
            self._deadlines.pop(name, None)
            shm.close()
            unlink_segment(name, tracked=True)
            raise
        shm.close()
        self._start_reaper()
        return Sent(checksum=crc, num_chunks=1, shm_name=name)

    def reap(self, *, force: bool = False) -> int:
        """Forget claimed segments and unlink expired ones (all of them if ``force``); returns how many it unlinked."""
        now, num_reaped = time.monotonic(), 0
        for name, deadline in list(self._deadlines.items()):
            if not segment_exists(name):
                _untrack(name)  # a receiver claimed it
            elif force or now >= deadline:
                if unlink_segment(name, tracked=True):
                    num_reaped += 1
                    log.warning("unlinked shared-memory segment %s: no receiver claimed it", name)
            else:
                continue
            del self._deadlines[name]
        return num_reaped

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap_loop())

    async def _reap_loop(self) -> None:
        interval = min(1.0, self.options.reap_after / 4)
        while self._deadlines:
            await asyncio.sleep(interval)
            try:
                self.reap()
            except Exception:  # keep reaping; the next round retries
                log.exception("reaping shared-memory segments failed")

    async def close(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._deadlines and time.monotonic() < deadline:
            self.reap()
            await asyncio.sleep(0.02)
        self.reap(force=True)
        if self._reaper is not None:
            self._reaper.cancel()


class ShmReceiver(ReceiverBackend):
    name = "shm"

    async def receive(self, descriptor: TransferDescriptor, timeout: float) -> torch.Tensor:
        num_bytes = descriptor.num_bytes
        if num_bytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        name = self._segment(descriptor)
        try:
            mapping = _attach(name)
        except FileNotFoundError:
            raise Unavailable(f"transfer {descriptor.transfer_id}: segment {name} is gone "
                              f"(reaped by its sender?)") from None
        except (OSError, ValueError) as exc:  # ValueError: an empty segment cannot be mapped
            raise TransferCorrupted(f"transfer {descriptor.transfer_id}: cannot map {name}: {exc}") from None
        finally:
            unlink_segment(name, tracked=False)  # the claim; the mapping outlives the name
        if len(mapping) < num_bytes:
            mapping.close()
            raise TransferCorrupted(f"transfer {descriptor.transfer_id}: segment holds {len(mapping)} B, "
                                    f"descriptor says {num_bytes}")
        # No copy: the tensor keeps the mapping alive, and the memory goes back
        # to the system when the tensor is freed.
        return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)

    def discard(self, descriptor_or_id: TransferDescriptor | str) -> None:
        if isinstance(descriptor_or_id, TransferDescriptor) and descriptor_or_id.shm_name:
            try:
                name = self._segment(descriptor_or_id)
            except InvalidArgument:
                return
            unlink_segment(name, tracked=False)

    @staticmethod
    def _segment(descriptor: TransferDescriptor) -> str:
        name = descriptor.shm_name or ""
        # Only ever touch kvbus segments of this transfer, whatever a descriptor says.
        if not (name.startswith(SEGMENT_PREFIX) and name.endswith("-" + descriptor.transfer_id)
                and "/" not in name):
            raise InvalidArgument(f"transfer {descriptor.transfer_id}: bad segment name {name!r}")
        return name


BACKEND = Backend("shm", ShmSender, ShmReceiver, is_available, needs_same_host=True, auto_rank=0)
