"""services.engine.host_memory: freed activation memory stays mapped, so a step stops page-faulting it in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process: malloc a 16 MiB block, write it, free it, then do the same again and count the
# minor page faults of the second round only. glibc's defaults serve the first block with a fresh
# mapping and unmap it on free; the second one is new memory again (~4,096 faults of 4 KiB). With
# keep_freed_memory() the block comes from the heap and stays there once freed: the second round
# reuses its pages (a handful of faults at most).
SCRIPT = """
import ctypes, resource, sys
if sys.argv[1] == "keep":
    from services.engine.host_memory import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 16 << 20
def round_trip():
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
round_trip()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _second_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_blocks_stay_mapped():
    # each in its own process: the setting is process-wide and never undone
    plain, kept = _second_round_faults("plain"), _second_round_faults("keep")
    assert plain >= 2048, plain  # the default: fresh pages again (16 MiB = 4,096 pages)
    assert kept < 256, kept


# In a fresh process with oneDNN's verbose log: projections of 10, 20, 30 and again 10 rows. The
# last one finds its kernel in the primitive cache by default; bounded to 2 entries, 10 rows was
# evicted by 30 and is built again. Deterministic: oneDNN logs every creation as hit or miss.
CACHE_SCRIPT = """
import os, sys, torch
if sys.argv[1] == "bound":
    from services.engine.host_memory import bound_kernel_cache
    bound_kernel_cache(2)
if sys.argv[1] == "user":  # a user's own setting wins
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "1024"
    from services.engine.host_memory import bound_kernel_cache
    bound_kernel_cache(2)
from services.engine.linear import prepack
w = prepack(torch.randn(64, 32), 16)
for m in (10, 20, 30, 10):
    torch.ops.mkldnn._linear_pointwise(torch.randn(m, 32), w, None, "none", [], "")
"""


def _creations(mode: str) -> list[str]:
    import re

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "ONEDNN_VERBOSE": "all"}
    out = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=env)
    return [m.group(1) for line in out.stdout.splitlines() if "inner_product" in line
            for m in [re.search(r"create:cache_(hit|miss)", line)] if m]


@pytest.mark.skipif(sys.platform != "linux", reason="oneDNN CPU build")
def test_bound_kernel_cache_bounds_onednn_primitive_cache():
    assert _creations("default") == ["miss", "miss", "miss", "hit"]
    assert _creations("bound") == ["miss", "miss", "miss", "miss"]
    assert _creations("user") == ["miss", "miss", "miss", "hit"]


# In a fresh process: one prepacked projection (the default model's gate_up shape) run at 56 row
# counts, as a prefill sees prompt lengths. ideep's LRU cache keeps a prepared computation per
# row count (1,024 by default); bound_kernel_cache bounds it too. Prints private memory growth (KiB).
LRU_SCRIPT = """
import sys, torch
if sys.argv[1] == "bound":
    from services.engine.host_memory import bound_kernel_cache
    bound_kernel_cache(8)
from services.engine.linear import prepack
def anon_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1])
w = prepack(torch.randn(1536, 576), 16)
x = torch.randn(520, 576)
torch.ops.mkldnn._linear_pointwise(x[:512], w, None, "none", [], "")
before = anon_kib()
for m in range(64, 512, 8):
    torch.ops.mkldnn._linear_pointwise(x[:m], w, None, "none", [], "")
print(anon_kib() - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="oneDNN CPU build")
def test_bound_kernel_cache_bounds_ideep_computation_cache():
    def growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", LRU_SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                             check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        return int(out.stdout.strip().splitlines()[-1])

    default, bound = growth("default"), growth("bound")
    assert default > 60_000, default  # ~95 MB: one prepared computation kept per row count
    assert bound < default / 2, (bound, default)  # ~32 MB
