"""Host-memory settings of a serving process: activations kept mapped, kernel caches bounded.

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
import os

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


KERNEL_CACHE_CAPACITY = 64
"""oneDNN primitive-cache entries a serving process keeps (oneDNN's default: 1,024)."""


def bound_kernel_cache(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Bound oneDNN's primitive cache and ideep's computation cache, each unless the user set it
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

    A prefill's row count is part of every projection's shape, so a server that sees many prompt
    lengths keeps making new kernels. Two caches keep them, each 1,024 entries by default:
    oneDNN's primitive cache (one JIT-compiled kernel per shape, ~0.2-0.3 MB: the worker's RSS
    grew 12% over the 2,000-request soak) and, above it, ideep's LRU cache of prepared
    computations for torch's prepacked linear (``mkldnn::_linear_pointwise``), which holds far more
    per entry: 120 prompt lengths through the default model's four projection shapes took +700 MB
    of private memory with it at 1,024, whatever oneDNN's bound, +324 MB at 64 and +136 MB at 16
    (tests/unit/test_host_memory.py). Decode steps never use oneDNN (the packed kernel serves
    them) and a step uses about five shapes, so 64 entries keep every shape a run repeats (chunked
    prefill). Read when the first primitive is made: call before the model runs. Process-wide, so
    only process entry points call it (``kvbus serve``).
    """
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
