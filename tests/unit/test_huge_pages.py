"""services/engine/huge_pages.py: tensors carved from one mapping that asked for huge pages, and
the engine's KV pool and packed weights held there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.huge_pages import (
    HUGE_PAGE,
    Populator,
    _madvise_populate,
    huge_page_empty,
    huge_page_tensors,
    mapping_of,
    onto_huge_pages,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_smaps = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")


def _asked_for_huge_pages(t: torch.Tensor) -> bool:
    return "hg" in mapping_of(t).get("VmFlags", "").split()


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
def test_the_populator_maps_every_page_and_changes_no_value():
    if not _can_populate():
        pytest.skip("no MADV_POPULATE_WRITE (Linux < 5.14)")
    t = huge_page_empty((3 * HUGE_PAGE // 4 + 1000,), torch.float32)
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(50_000, generator=gen)
    t[:50_000] = head  # written before: the populator must leave it as it is
    p = Populator(t, chunk=1 << 20)
    assert p.done.wait(60)
    nbytes = t.numel() * 4
    assert p.populated >= nbytes
    assert int(mapping_of(t)["Rss"].split()[0]) * 1024 >= nbytes
    assert torch.equal(t[:50_000], head)
    assert t[50_000:].abs().sum().item() == 0  # the rest mapped fresh: zeros


def test_the_populator_stops_once_its_tensor_is_gone():
    t = huge_page_empty((64 * HUGE_PAGE // 4,), torch.float32)
    p = Populator(t, chunk=1 << 20)
    del t
    import gc

    gc.collect()
    assert p.done.wait(60)


@needs_smaps
def test_the_engine_keeps_its_packed_weights_on_huge_pages_and_maps_its_pool_ahead(model_dir):
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    from services.engine import EngineConfig, LLMEngine
    from services.engine.linear import CpuWeight

    eng = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.05, load_tokenizer=False))
    assert not _asked_for_huge_pages(eng.kv_pool.data)  # kv_huge_pages is off by default
    assert eng.kv_pool.populator is not None and eng.kv_pool.populator.done.wait(60)
    if _can_populate():
        assert eng.kv_pool.populator.populated >= eng.kv_pool.num_bytes
    huge = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.05, load_tokenizer=False,
                                  kv_huge_pages=True, kv_prefault=False))
    assert _asked_for_huge_pages(huge.kv_pool.data) and huge.kv_pool.populator is None
    w = eng.model.w
    packed = [getattr(layer, n) for layer in w.layers for n in ("qkv", "o", "gate_up", "down")] + [w.lm_head]
    if not all(type(p) is CpuWeight for p in packed):
        pytest.skip("no packed decode weights (native kernels not built)")
    assert all(_asked_for_huge_pages(p.packed) for p in packed)
    # in the order a decode step reads them
    ptrs = [p.packed.data_ptr() for p in packed]
    assert ptrs == sorted(ptrs)
