"""Keep the engine's activation memory mapped between steps (glibc malloc settings).

A prefill step allocates and frees a few hundred megabytes of activations (a 1,024-token step:
~60,000 fresh 4 KiB pages). With glibc's defaults a freed block of more than 128 KiB (or, after
the dynamic threshold has grown, a heap top past the trim threshold) goes back to the kernel, so
the next step faults every page in again and the kernel zeroes it: measured on the 2-core dev VM,
60k minor faults and ~85 ms of a 1.43 s prefill at ISL 1024 (6%). With the settings below the
same step takes 11.5k faults (the KV pages written for the first time) and 1.35 s.

The price is that a worker's resident memory stays at its high-water mark of activations (a few
hundred MB at the default chunk of 2,048 tokens) instead of shrinking between requests: what a
serving process wants. This is process-wide state, so only process entry points call
:func:`keep_freed_memory` (``kvbus serve``), never a constructor; in-process users (tests,
benchmarks) opt in themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap, not a fresh mapping (glibc's maximum on 64-bit)."""

TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top kept before any of it goes back to the kernel."""


def keep_freed_memory() -> bool:
    """Tell glibc malloc to reuse freed activation memory instead of unmapping it; False (and
    nothing changed) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the activation-memory settings; prefill steps will page-fault more")
    return ok
