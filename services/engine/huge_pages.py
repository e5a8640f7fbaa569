"""CPU tensors on transparent huge pages, for the memory every step reads across: the KV pool and
the packed decode weights.

A decode step reads each sequence's K and V as a 12 KiB slice per page and layer, scattered over
a pool of gigabytes, and streams every packed weight (540 MB for the default model in fp32). On
4 KiB pages both walk the page tables again every few kilobytes. Backed by 2 MiB pages, the pool
and the weights of a step fit the TLB. Measured on the 2-core dev VM (docs/engine.md, "Huge
pages"): decode attention over 30 cold layers 13-22% faster at 4 x 3000, 8 x 1000 and 1 x 3000,
and a decode step's projections 2-9% faster.

Linux backs a mapping with huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always``, or ``madvise`` (most distributions' default) and the mapping asked for them, as these
do. With ``never``, or where there is no ``madvise``, the same tensors sit on 4 KiB pages: slower,
nothing else changes. Pages stay untouched, costing no RAM, until first written, as with
``torch.empty``; a huge page commits its 2 MiB at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without writing it


def _mapping(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of at least ``nbytes`` that asked for huge pages (or, not
    ``huge``, for 4 KiB ones), and the offset of its first 2 MiB boundary (where huge pages can
    start)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # a kernel built without THP: 4 KiB pages
            pass
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return mm, -base % HUGE_PAGE


def huge_page_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]], huge: bool = True) -> list[torch.Tensor]:
    """Uninitialized contiguous CPU tensors of the given shapes and dtypes, carved from one
    mapping on huge pages (``huge=False``: on 4 KiB pages, even where THP is ``always``), each
    starting on a 64-byte line. The mapping lives as long as any of them (each holds a reference
    to it)."""
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // 64) * 64
    mm, start = _mapping(max(end, 1), huge)
    return [
        torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=start + off).view(dtype).view(shape)
        if n else torch.empty(shape, dtype=dtype)
        for (shape, dtype), n, off in zip(specs, sizes, offsets)
    ]


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on huge pages (``huge=False``: on 4 KiB pages, in a
    mapping of its own that a :class:`Populator` can map ahead)."""
    return huge_page_tensors([(shape, dtype)], huge)[0]


def onto_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` in one mapping on huge pages (same shapes, dtypes and
    values)."""
    out = huge_page_tensors([(tuple(t.shape), t.dtype) for t in tensors])
    for dst, src in zip(out, tensors):
        dst.copy_(src)
    return out


def _madvise_populate(start: int, length: int) -> bool:
    """Fault in [start, start + length) writable without writing it (Linux 5.14+); False where
    the kernel or C library cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError):
        return False


class Populator:
    """Faults in every page of a contiguous CPU tensor from a background thread at idle priority
    (``SCHED_IDLE``: it runs only on a core nothing else wants), front to back in ``chunk``-byte
    steps, so that a later first write does not wait on the kernel for a fresh page. A fresh
    huge page costs more than zeroing it where the machine is a VM whose host takes freed memory
    back (the dev VM's balloon: 2.5 s a GB of huge pages against 0.3 s a GB of 4 KiB pages), and
    then a 1,024-token prompt's first write of 47 MB of KV waits ~0.1 s for them.

    Safe beside writers: ``MADV_POPULATE_WRITE`` never changes a page already there, only maps
    the missing ones (zeroed). Where the kernel lacks it (before 5.14) nothing is populated and
    pages are faulted in as first written. It holds the tensor only while it maps a chunk, and
    stops once the tensor is gone. ``done`` is set when the whole tensor is in, or it stopped."""

    def __init__(self, t: torch.Tensor, chunk: int = 32 << 20):
        self.done = threading.Event()
        self.populated = 0  # bytes, front to back
        self._ref, self._chunk = weakref.ref(t), chunk
        self._start, self._end = t.data_ptr() & ~(mmap.PAGESIZE - 1), t.data_ptr() + t.numel() * t.element_size()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvbus-populate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._thread.join()

    def _run(self) -> None:
        try:
            if hasattr(os, "sched_setscheduler"):
                try:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
                except OSError:
                    pass
            pos = self._start
            while pos < self._end and not self._stopping:
                t = self._ref()  # held while mapping, so the memory cannot go away meanwhile
                if t is None:
                    break
                n = min(self._chunk, self._end - pos)
                ok = _madvise_populate(pos, n)
                del t
                if not ok:
                    break
                pos += n
                self.populated = pos - self._start
        finally:
            self.done.set()


def mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``t``'s first element (the kernel
    merges neighbouring mappings alike): ``VmFlags`` has ``hg`` where huge pages were asked for,
    ``AnonHugePages`` says how much of it they back now. Empty where there is no smaps."""
    addr = t.data_ptr()
    fields: dict[str, str] = {}
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside:
                    fields[head[:-1]] = rest.strip()
    except OSError:
        return {}
    return fields
