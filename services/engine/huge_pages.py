"""CPU tensors in anonymous mappings of their own: on transparent huge pages (the packed decode
weights; the KV pool with ``kv_huge_pages``), and mapped all at once (the KV pool, ``kv_prefault``).

A decode step streams every packed weight (540 MB for the default model in fp32) and reads each
sequence's K and V as a 12 KiB slice per page and layer, scattered over the pool. On 4 KiB pages
both walk the page tables again every few kilobytes; on 2 MiB pages they fit the TLB. Measured on
the 2-core dev VM (docs/engine.md, "CPU notes", "Pages"): all 121 projections 0.82-0.90x the time
on huge pages, decode attention over 30 cold layers 0.69-0.82x.

Linux backs a mapping with huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always``, or ``madvise`` (most distributions' default) and the mapping asked for them, as these
do. With ``never``, or where there is no ``madvise``, the same tensors sit on 4 KiB pages: slower,
nothing else changes. Pages stay untouched, costing no RAM, until first written or mapped by
:func:`populate`, as with ``torch.empty``; a huge page commits its 2 MiB at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

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
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
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
    mapping of its own that :func:`populate` can map at once)."""
    return huge_page_tensors([(shape, dtype)], huge)[0]


def onto_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` in one mapping on huge pages (same shapes, dtypes and
    values)."""
    out = huge_page_tensors([(tuple(t.shape), t.dtype) for t in tensors])
    for dst, src in zip(out, tensors):
        dst.copy_(src)
    return out


@functools.cache
def _madvise():
    """libc's ``madvise`` (looked up once: find_library runs ldconfig), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return libc.madvise
    except (OSError, AttributeError):
        return None


def _madvise_populate(start: int, length: int) -> bool:
    """Fault in [start, start + length) writable without writing it (Linux 5.14+); False where
    the kernel or C library cannot."""
    madvise = _madvise()
    return madvise is not None and madvise(start, length, _MADV_POPULATE_WRITE) == 0


def populate(t: torch.Tensor, threads: int | None = None) -> None:
    """Map every page of the contiguous CPU tensor ``t`` now, so that no later first write waits
    on the kernel for a fresh page. Its values become unspecified (zeros where freshly mapped):
    call it before anything is written. ``MADV_POPULATE_WRITE`` (Linux 5.14+) over ``threads``
    slices at once (default: every core this process may use), else a pass of zeros.

    Measured on the 2-core dev VM: 0.2 s a GB of 4 KiB pages on two threads (0.35 s on one);
    huge pages cost 2.5 s a GB there, since the VM's balloon hands freed memory back to the host,
    which must back it again."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    start, end = t.data_ptr() & ~(mmap.PAGESIZE - 1), t.data_ptr() + nbytes
    step = -(-(end - start) // max(1, threads) // mmap.PAGESIZE) * mmap.PAGESIZE
    slices = [(a, min(step, end - a)) for a in range(start, end, step)]
    with ThreadPoolExecutor(len(slices), thread_name_prefix="kvbus-populate") as pool:
        done = list(pool.map(lambda s: _madvise_populate(*s), slices))  # ctypes lets go of the GIL
    if not all(done):
        t.view(torch.uint8).zero_()
