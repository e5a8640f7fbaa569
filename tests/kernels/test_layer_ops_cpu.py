"""The native CPU layer ops (kernels/cpu/layer_ops.cpp) against their torch references, on
irregular shapes: odd head dims and page sizes, strided views of a pool, skipped slots, extreme
SiLU inputs. Store-KV copies, so it must match bit for bit; the arithmetic ops within a few ulp."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.activation import silu_and_mul_ref
from kernels.layer_ops_cpu import apply_rotary_cpu, silu_and_mul_cpu, store_kv_cpu, store_kv_ok
from kernels.paged_store import store_kv_ref
from kernels.rotary import apply_rotary_ref, rope_cos_sin_cache

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(pages, page_size, heads, dim, dtype, seed=0):
    # the engine's layout: [pages, layers, 2, page_size, Hkv, D]; layer 1's K and V are strided views
    data = torch.randn(pages, 2, 2, page_size, heads, dim, generator=_gen(seed)).to(dtype)
    return data, data[:, 1, 0], data[:, 1, 1]


@pytest.mark.parametrize("page_size,heads,dim", [(1, 2, 24), (5, 3, 16), (16, 3, 64), (7, 1, 40)])
@pytest.mark.parametrize("kv_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])  # last: rounded as .to() rounds
def test_store_kv_matches_reference_bit_for_bit(page_size, heads, dim, kv_dtype, dtype):
    pages, tokens = 6, min(13, 6 * page_size)
    gen = _gen(1)
    k = torch.randn(tokens, heads, dim, generator=gen).to(kv_dtype)
    v = torch.randn(tokens, heads, dim, generator=gen).to(kv_dtype)
    if kv_dtype != dtype:  # values that round differently from a truncation, and a tie (to even)
        k[0, 0, :3] = torch.tensor([1.0 + 2**-8 + 2**-12, 1.0 - 2**-10, 1.0 + 2**-8])
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    slots[3] = -1  # skipped
    got, k_cache, v_cache = _pool(pages, page_size, heads, dim, dtype)
    want, k_ref, v_ref = _pool(pages, page_size, heads, dim, dtype)
    assert store_kv_ok(k, v, k_cache, v_cache)
    store_kv_cpu(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_store_kv_from_a_strided_qkv_split():
    # the engine passes k and v as views of one fused qkv projection
    gen = _gen(2)
    qkv = torch.randn(9, 4 * 8 + 2 * 2 * 8, generator=gen)
    _, k, v = qkv.split([32, 16, 16], dim=-1)
    k, v = k.view(9, 2, 8), v.view(9, 2, 8)
    got, k_cache, v_cache = _pool(4, 5, 2, 8, torch.float32)
    want, k_ref, v_ref = _pool(4, 5, 2, 8, torch.float32)
    slots = torch.arange(2, 11)
    store_kv_cpu(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(got, want)


def test_store_kv_rejects_slots_past_the_cache():
    _, k_cache, v_cache = _pool(3, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="slots past the cache"):
        store_kv_cpu(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), k_cache, v_cache, torch.tensor([12]))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 24), (2, 1, 40), (3, 1, 2)])
def test_rotary_matches_reference(heads, kv_heads, dim):
    gen = _gen(3)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)  # strided, as in the engine
    cache = rope_cos_sin_cache(dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    got_q, got_k = apply_rotary_cpu(q, k, positions, cache)
    want_q, want_k = apply_rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)


def test_rotary_rejects_positions_past_the_table():
    cache = rope_cos_sin_cache(8, 16, 10000.0)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_cpu(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.tensor([16]), cache)


@pytest.mark.parametrize("tokens,d", [(1, 1536), (7, 37), (33, 16), (3, 1)])
def test_silu_and_mul_matches_reference(tokens, d):
    gen = _gen(4)
    x = torch.randn(tokens, 2 * d, generator=gen) * 6
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, 2 * d)]  # saturated gates and zero
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 37), (17, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(tokens, hidden, with_residual):
    from kernels.layer_ops_cpu import rms_norm_cpu, rms_norm_ok
    from kernels.norm import rms_norm_ref

    gen = _gen(5)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    res = torch.randn(tokens, hidden, generator=gen) if with_residual else None
    assert rms_norm_ok(x, w, 1e-5, res)
    got, want = rms_norm_cpu(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum is exact
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
