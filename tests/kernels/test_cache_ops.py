"""store_kv, page gather/scatter and fp8 quantization: references vs plain indexing / formulas,
Triton vs the references (bit-exact: these kernels only move and round values)."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    FP8_DTYPE,
    compute_fp8_scale,
    dequantize_fp8,
    gather_pages,
    quantize_fp8,
    scatter_pages,
    store_kv,
)
from kernels.fp8 import dequantize_fp8_ref, quantize_fp8_ref
from kernels.page_copy import gather_pages_ref, scatter_pages_ref
from kernels.paged_store import store_kv_ref


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _pool(num_pages, page_size, heads, dim, dtype, device="cpu"):
    # engine layout [pages, layers, 2, page, H, D]: per-layer caches are strided views
    pool = torch.zeros(num_pages, 3, 2, page_size, heads, dim, dtype=dtype, device=device)
    return pool[:, 2, 0], pool[:, 2, 1]


def _scales(x, kind):
    return None if kind is None else compute_fp8_scale(x, per_head=kind == "head")


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_reference_writes_slots(page_size, dtype):
    k_cache, v_cache = _pool(6, page_size, 3, 8, dtype)
    num_slots = 6 * page_size
    slots = torch.randperm(num_slots)[:5]
    slots[2] = -1  # padding token: skipped
    k, v = torch.randn(5, 3, 8).to(dtype), torch.randn(5, 3, 8).to(dtype)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    want_k = torch.zeros(num_slots, 3, 8, dtype=dtype)
    want_v = torch.zeros(num_slots, 3, 8, dtype=dtype)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = k[t], v[t]
    assert torch.equal(k_cache.reshape(num_slots, 3, 8), want_k)
    assert torch.equal(v_cache.reshape(num_slots, 3, 8), want_v)


@pytest.mark.parametrize("kind", ["tensor", "head"])
def test_store_kv_reference_quantizes_fp8(kind):
    k_cache, v_cache = _pool(4, 5, 3, 8, FP8_DTYPE)
    k, v = torch.randn(7, 3, 8) * 3, torch.randn(7, 3, 8)
    k_scale, v_scale = _scales(k, kind), _scales(v, kind)
    slots = torch.tensor([0, 19, 3, 7, 11, 12, 4])
    store_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    flat_k = k_cache.reshape(20, 3, 8)[slots].float()
    div = k_scale.view(-1, 1) if kind == "head" else k_scale
    assert torch.equal(flat_k, (k / div).to(FP8_DTYPE).float())
    # dequantized values are within e4m3's relative precision (3 mantissa bits)
    torch.testing.assert_close(flat_k * div, k, rtol=2**-4, atol=div.max().item() * 2**-9)


def test_fp8_reference_formulas():
    x = torch.tensor([[[1000.0, -1000.0, 0.3, -0.0]]])  # [1, 1, 4]
    q = quantize_fp8_ref(x, torch.tensor(1.0))
    assert q.float().tolist() == [[[448.0, -448.0, 0.3125, -0.0]]]  # saturates, rounds to nearest
    x = torch.randn(4, 3, 8)
    scale = compute_fp8_scale(x, per_head=True)
    assert scale.shape == (3,)
    torch.testing.assert_close(scale, x.abs().amax(dim=(0, 2)) / 448)
    assert quantize_fp8_ref(x, scale).float().abs().amax(dim=(0, 2)).eq(448).all()
    back = dequantize_fp8_ref(quantize_fp8_ref(x, scale), scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.float(), x, rtol=2**-3, atol=1e-3)
    assert compute_fp8_scale(torch.zeros(3)).item() > 0  # never a zero scale


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_page_copy_reference(dtype):
    cache = torch.randn(9, 2, 2, 5, 3, 4).to(dtype)[:, 1, 0]  # strided [9, 5, 3, 4]
    ids = torch.tensor([7, 0, 3])
    got = gather_pages_ref(cache, ids)
    assert torch.equal(_bits(got), _bits(torch.stack([cache[i] for i in ids.tolist()])))
    out = torch.empty_like(got)
    assert gather_pages_ref(cache, ids, out=out) is out
    src = torch.randn(3, 5, 3, 4).to(dtype)
    before = cache.clone()
    scatter_pages_ref(cache, ids, src)
    for j, i in enumerate(ids.tolist()):
        assert torch.equal(_bits(cache[i]), _bits(src[j]))
    untouched = [i for i in range(9) if i not in ids.tolist()]
    assert torch.equal(_bits(cache[untouched]), _bits(before[untouched]))


def test_cache_op_errors():
    k_cache, v_cache = _pool(2, 4, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), k_cache, v_cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="per slot"):
        store_kv(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), k_cache, v_cache, torch.zeros(2, dtype=torch.long))
    f_k, f_v = _pool(2, 4, 3, 8, FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), f_k, f_v, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="out must be"):
        gather_pages(k_cache, torch.tensor([0]), out=torch.empty(2, 4, 3, 8))
    with pytest.raises(ValueError, match="per-head"):
        quantize_fp8(torch.zeros(2, 3, 8), torch.ones(4))


@pytest.mark.parametrize("backend", ["torch_backend", "triton_backend"])
def test_out_of_range_ids_are_value_errors(backend, request):
    request.getfixturevalue(backend)  # the interpreter would segfault on a wild pointer
    k_cache, v_cache = _pool(3, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="slot"):
        store_kv(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), k_cache, v_cache, torch.tensor([12]))
    with pytest.raises(ValueError, match="page_ids"):
        gather_pages(k_cache, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="page_ids"):
        scatter_pages(k_cache, torch.tensor([-1]), torch.zeros(1, 4, 2, 8))


# --------------------------------------------------------------------------- Triton


@pytest.mark.parametrize(
    "page_size,heads,dim,dtype,kind",
    [
        (1, 2, 24, torch.float32, None),
        (5, 3, 16, torch.bfloat16, None),
        (16, 3, 40, torch.float32, None),
        (5, 3, 16, FP8_DTYPE, "tensor"),
        (16, 2, 24, FP8_DTYPE, "head"),
    ],
)
def test_store_kv_triton_matches_reference(triton_backend, device, page_size, heads, dim, dtype, kind):
    num_pages, num_tokens = 12, 11
    src_dtype = torch.float32 if dtype == FP8_DTYPE else dtype
    k = (torch.randn(num_tokens, heads, dim) * 4).to(device=device, dtype=src_dtype)
    v = torch.randn(num_tokens, heads, dim).to(device=device, dtype=src_dtype)
    k_scale, v_scale = _scales(k, kind), _scales(v, kind)
    slots = torch.randperm(num_pages * page_size)[:num_tokens]
    slots[[1, 6]] = -1
    slots = slots.to(device)
    k_cache, v_cache = _pool(num_pages, page_size, heads, dim, dtype, device)
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    rk, rv = _pool(num_pages, page_size, heads, dim, dtype)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    store_kv_ref(k.cpu(), v.cpu(), rk, rv, slots.cpu(), cpu(k_scale), cpu(v_scale))
    assert torch.equal(_bits(k_cache), _bits(rk))
    assert torch.equal(_bits(v_cache), _bits(rv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("page_shape", [(5, 3, 4), (7,), (2, 3, 2, 5)])
def test_page_copy_triton_matches_reference(triton_backend, device, dtype, page_shape):
    pool = torch.randn(9, 2, *page_shape).to(dtype)
    cache = pool[:, 1]  # strided pages
    ids = torch.tensor([6, 0, 8, 2])
    got = gather_pages(cache.to(device) if device != "cpu" else cache, ids.to(device))
    assert torch.equal(_bits(got), _bits(gather_pages_ref(cache, ids)))
    src = torch.randn(4, *page_shape).to(dtype)
    want = cache.clone()
    scatter_pages_ref(want, ids, src)
    target = pool.to(device)[:, 1]
    scatter_pages(target, ids.to(device), src.to(device))
    assert torch.equal(_bits(target), _bits(want))


@pytest.mark.parametrize("kind", ["tensor", "head"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_quant_triton_matches_reference(triton_backend, device, kind, out_dtype):
    # values straddle binade edges (-31.9 -> -32) and the saturation bound
    x = torch.cat([torch.randn(5, 3, 24) * 200, torch.linspace(-600, 600, 72).view(1, 3, 24)]).to(device)
    scale = _scales(x, kind) * 1.3
    q = quantize_fp8(x, scale)
    assert torch.equal(_bits(q), _bits(quantize_fp8_ref(x.cpu(), scale.cpu())))
    back = dequantize_fp8(q, scale, out_dtype)
    want = dequantize_fp8_ref(q.cpu(), scale.cpu(), out_dtype)
    # NOTE: the interpreter casts float32 -> bf16 by truncation (GPUs round to nearest): 1 ulp
    tol = 0 if out_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(back.cpu().float(), want.float(), rtol=tol, atol=0)


@pytest.mark.gpu
def test_cache_ops_triton_real_shapes(triton_backend):
    # a prefill chunk of 2048 tokens into a 4096-page pool, then offload 256 pages
    k_cache, v_cache = _pool(4096, 16, 3, 64, torch.bfloat16, "cuda")
    k, v = torch.randn(2048, 3, 64, device="cuda").bfloat16(), torch.randn(2048, 3, 64, device="cuda").bfloat16()
    slots = torch.randperm(4096 * 16, device="cuda")[:2048]
    store_kv(k, v, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.reshape(-1, 3, 64)[slots], k)
    ids = torch.randperm(4096, device="cuda")[:256]
    assert torch.equal(gather_pages(v_cache, ids), v_cache[ids])
