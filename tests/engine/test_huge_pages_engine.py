"""The engine's KV pool and packed weights on huge pages (services/engine/huge_pages.py)."""

from __future__ import annotations

import pytest

from tests.unit.test_huge_pages import THP, _asked_for_huge_pages, _resident_bytes, needs_smaps


@needs_smaps
def test_the_engine_keeps_its_packed_weights_on_huge_pages_and_maps_its_pool(model_dir):
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    from services.engine import EngineConfig, LLMEngine
    from services.engine.linear import CpuWeight

    eng = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.05, load_tokenizer=False))
    assert not _asked_for_huge_pages(eng.kv_pool.data)  # kv_huge_pages and kv_prefault are off by default
    assert _resident_bytes(eng.kv_pool.data) < eng.kv_pool.num_bytes / 2
    mapped = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.05, load_tokenizer=False,
                                    kv_huge_pages=True, kv_prefault=True))
    assert _asked_for_huge_pages(mapped.kv_pool.data)
    assert _resident_bytes(mapped.kv_pool.data) >= mapped.kv_pool.num_bytes
    w = eng.model.w
    packed = [getattr(layer, n) for layer in w.layers for n in ("qkv", "o", "gate_up", "down")] + [w.lm_head]
    if not all(type(p) is CpuWeight for p in packed):
        pytest.skip("no packed decode weights (native kernels not built)")
    assert _asked_for_huge_pages(*(p.packed for p in packed))
    # in the order a decode step reads them
    ptrs = [p.packed.data_ptr() for p in packed]
    assert ptrs == sorted(ptrs)
