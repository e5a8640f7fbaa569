"""services/engine/huge_pages.py: tensors carved from one mapping that asked for huge pages (the
engine's KV pool and packed weights held there: tests/engine/test_huge_pages_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.huge_pages import (
    HUGE_PAGE,
    _madvise_populate,
    huge_page_empty,
    huge_page_tensors,
    onto_huge_pages,
    populate,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")


def mappings_of(*tensors: torch.Tensor) -> list[dict[str, str]]:
    """The /proc/self/smaps fields of the mapping that holds each tensor's first element (the
    kernel merges neighbouring mappings alike): ``VmFlags`` has ``hg`` where huge pages were asked
    for, ``AnonHugePages`` says how much of it they back now. Empty where there is no smaps. One
    read for all: each read walks the page tables of every mapping (~0.1 s with a model loaded)."""
    addrs = [t.data_ptr() for t in tensors]
    found: list[dict[str, str]] = [{} for _ in addrs]
    try:
        with open("/proc/self/smaps") as f:
            inside: list[int] = []
            for line in f:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = [i for i, a in enumerate(addrs) if lo <= a < hi]
                else:
                    for i in inside:
                        found[i][head[:-1]] = rest.strip()
    except OSError:
        return [{} for _ in addrs]
    return found


def mapping_of(t: torch.Tensor) -> dict[str, str]:
    return mappings_of(t)[0]


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages in RAM now (mincore(2)), whatever mapping the kernel merged it into."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def _asked_for_huge_pages(*tensors: torch.Tensor) -> bool:
    """True if every tensor's mapping asked for huge pages."""
    return all("hg" in m.get("VmFlags", "").split() for m in mappings_of(*tensors))


def test_tensors_have_their_shapes_and_dtypes_and_do_not_overlap():
    specs = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((0, 4), torch.float32), ((2, 3, 4), torch.float8_e4m3fn),
             ((1000, 33), torch.float32)]
    ts = huge_page_tensors(specs)
    for t, (shape, dtype) in zip(ts, specs):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        if t.numel():
            assert t.data_ptr() % 64 == 0
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in ts]
    for t, v in zip(ts, values):
        t.copy_(v)
    for t, v in zip(ts, values):  # a later tensor's writes never reach an earlier one
        assert torch.equal(t.float(), v.float())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts if t.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_onto_huge_pages_copies_values_and_strided_sources():
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(64, 48, generator=gen).t(), torch.randn(10, generator=gen).bfloat16()]
    out = onto_huge_pages(src)
    for s, o in zip(src, out):
        assert o.is_contiguous() and o.dtype == s.dtype and torch.equal(o, s)
    src[0].zero_()  # copies, not views
    assert out[0].abs().sum() > 0


def test_the_mapping_outlives_every_reference_but_the_tensors():
    t = huge_page_empty((HUGE_PAGE // 4 + 3,), torch.float32)
    t.fill_(2.5)
    view = t[5:]
    del t
    import gc

    gc.collect()
    assert view.sum().item() == 2.5 * (HUGE_PAGE // 4 - 2)


@needs_smaps
def test_the_mapping_asks_for_huge_pages_and_plain_tensors_do_not():
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    t = huge_page_empty((2 * HUGE_PAGE // 4,), torch.float32)
    t.fill_(1.0)
    assert _asked_for_huge_pages(t)
    assert not _asked_for_huge_pages(torch.ones(2 * HUGE_PAGE // 4))
    small = huge_page_empty((2 * HUGE_PAGE // 4,), torch.float32, huge=False)
    small.fill_(1.0)
    assert "nh" in mapping_of(small)["VmFlags"].split() and not _asked_for_huge_pages(small)


def _can_populate() -> bool:
    probe = huge_page_empty((1024,), torch.float32)
    return _madvise_populate(probe.data_ptr() & ~4095, 4096)


@needs_smaps
@pytest.mark.parametrize("threads", [1, 3])
def test_populate_maps_every_page_and_changes_no_value(threads):
    t = huge_page_empty((3 * HUGE_PAGE // 4 + 1000,), torch.float32, huge=False)
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(50_000, generator=gen)
    t[:50_000] = head  # written before: a page already there is left as it is
    assert _resident_bytes(t) < t.numel() * 4
    populate(t, threads)
    assert _resident_bytes(t) >= t.numel() * 4
    if _can_populate():
        assert torch.equal(t[:50_000], head)
    assert t[50_000:].abs().sum().item() == 0  # the rest mapped fresh: zeros
