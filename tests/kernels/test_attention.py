"""Paged decode and prefill attention: references vs dense float64 attention on unpaged K/V,
Triton vs the references at small irregular shapes (interpreter on CPU) and at real shapes (gpu)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import FP8, dense_attention, make_paged

from kernels import paged_decode_attention, paged_prefill_attention
from kernels.attention_decode import paged_decode_attention_ref
from kernels.attention_prefill import paged_prefill_attention_ref

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, FP8: 2e-5}


def _q(num_tokens, num_q_heads, head_dim, dtype, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    q_dtype = torch.float32 if dtype == FP8 else dtype
    return torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(device=device, dtype=q_dtype)


def _prefill_inputs(case, q_lens, num_q_heads, head_dim, dtype, device="cpu"):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return _q(sum(q_lens), num_q_heads, head_dim, dtype, device, seed=2), cu


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    "page_size,num_kv_heads,group,dtype,scales",
    [
        (1, 2, 1, torch.float32, None),
        (5, 3, 3, torch.float32, None),
        (16, 2, 4, torch.float32, None),
        (5, 3, 3, torch.bfloat16, None),
        (5, 1, 4, FP8, "tensor"),
        (16, 3, 3, FP8, "head"),
    ],
)
def test_decode_reference_matches_dense(page_size, num_kv_heads, group, dtype, scales):
    seq_lens, head_dim, scale = [1, 7, 33, 16], 24, 0.19
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales)
    q = _q(len(seq_lens), num_kv_heads * group, head_dim, dtype)
    out = paged_decode_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, case.k_scale, case.v_scale
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(seq_lens):
        want = dense_attention(q[b : b + 1], case.keys[b], case.values[b], scale, torch.tensor([n - 1]))
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,scales", [(torch.float32, None), (torch.bfloat16, None), (FP8, "head")])
def test_decode_reference_single_sequence(dtype, scales):
    # B == 1 takes its own path (no padding, one SDPA call)
    case = make_paged([37], 5, 3, 16, dtype, scales)
    q = _q(1, 9, 16, dtype)
    out = paged_decode_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.4, case.k_scale, case.v_scale
    )
    want = dense_attention(q, case.keys[0], case.values[0], 0.4, torch.tensor([36]))
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "page_size,num_kv_heads,group,dtype,scales",
    [
        (1, 2, 1, torch.float32, None),
        (5, 3, 3, torch.float32, None),
        (16, 2, 4, torch.bfloat16, None),
        (5, 3, 3, FP8, "head"),
    ],
)
def test_prefill_reference_matches_dense(page_size, num_kv_heads, group, dtype, scales):
    # full prefill, extend after a cached prefix, a single new token, a sequence with no new tokens
    seq_lens, q_lens, head_dim, scale = [9, 21, 6, 4], [9, 5, 1, 0], 16, 0.25
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales)
    q, cu = _prefill_inputs(case, q_lens, num_kv_heads * group, head_dim, dtype)
    out = paged_prefill_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, scale, case.k_scale, case.v_scale
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, (n, m) in enumerate(zip(seq_lens, q_lens)):
        if m == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_attention(q[rows], case.keys[b], case.values[b], scale, torch.arange(n - m, n))
        torch.testing.assert_close(out[rows].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_reference_rejects_short_block_table():
    case = make_paged([40], 5, 1, 8)
    q = _q(1, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="pages"):
        paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables[:, :3], case.seq_lens, 1.0)


def test_attention_shape_errors_are_value_errors():
    case = make_paged([5], 4, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.zeros(1, 3, 8), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(
            torch.zeros(5, 2, 8), case.k_cache, case.v_cache, case.block_tables,
            torch.tensor([0, 5, 5], dtype=torch.int32), case.seq_lens, 1.0,
        )
    fp8 = make_paged([5], 4, 2, 8, FP8)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(torch.zeros(1, 2, 8), fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens, 1.0)


@pytest.mark.parametrize("backend", ["torch_backend", "triton_backend"])
def test_bad_page_ids_are_value_errors(backend, request):
    request.getfixturevalue(backend)  # the interpreter would segfault on a wild pointer
    case = make_paged([9], 4, 2, 16)
    tables = case.block_tables.clone()
    tables[0, 1] = case.k_cache.shape[0]
    q = _q(1, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="page ids"):
        paged_decode_attention(q, case.k_cache, case.v_cache, tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="page ids"):
        paged_prefill_attention(q, case.k_cache, case.v_cache, tables, torch.tensor([0, 1], dtype=torch.int32),
                                case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="pages"):
        paged_decode_attention(q, case.k_cache, case.v_cache, tables[:, :2], case.seq_lens, 1.0)


# --------------------------------------------------------------------------- Triton (small)

DECODE_CASES = [
    # page_size, Hkv, group, head_dim, dtype, fp8 scales
    (1, 2, 1, 24, torch.float32, None),
    (5, 3, 3, 16, torch.float32, None),
    (16, 2, 4, 40, torch.float32, None),
    (5, 1, 4, 16, torch.bfloat16, None),
    (16, 3, 3, 64, torch.bfloat16, None),
    (5, 3, 3, 16, FP8, "tensor"),
    (1, 2, 4, 24, FP8, "head"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,scales", DECODE_CASES)
def test_decode_triton_matches_reference(triton_backend, device, page_size, num_kv_heads, group, head_dim, dtype, scales):
    seq_lens = [1, 70, 13]  # 70 spans two 64-token tiles
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales, device=device)
    q = _q(len(seq_lens), num_kv_heads * group, head_dim, dtype, device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3, case.k_scale, case.v_scale)
    out = paged_decode_attention(*args)
    want = paged_decode_attention_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


PREFILL_CASES = [
    (1, 2, 1, 24, torch.float32, None),
    (5, 3, 3, 16, torch.float32, None),
    (16, 1, 4, 16, torch.bfloat16, None),
    (5, 2, 2, 16, FP8, "head"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,scales", PREFILL_CASES)
def test_prefill_triton_matches_reference(triton_backend, device, page_size, num_kv_heads, group, head_dim, dtype, scales):
    # 19 new tokens -> two 16-row query blocks; 37 = 18 cached + 19 new; one single-token extend
    seq_lens, q_lens = [19, 37, 6], [19, 19, 1]
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales, device=device)
    q, cu = _prefill_inputs(case, q_lens, num_kv_heads * group, head_dim, dtype, device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3, case.k_scale, case.v_scale)
    out = paged_prefill_attention(*args)
    want = paged_prefill_attention_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------- Triton (real shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scales", [(torch.bfloat16, None), (torch.float16, None), (FP8, "head")])
def test_decode_triton_real_shapes(triton_backend, dtype, scales):
    # SmolLM2-135M: 9 q heads, 3 kv heads, head_dim 64, page 16; a batch of 32 up to 2k tokens
    seq_lens = torch.randint(1, 2048, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    case = make_paged(seq_lens, 16, 3, 64, dtype, scales, device="cuda")
    q = _q(32, 9, 64, dtype, "cuda")
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, case.k_scale, case.v_scale)
    out = paged_decode_attention(*args)
    want = paged_decode_attention_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,scales", [(torch.bfloat16, None), (FP8, "tensor")])
def test_prefill_triton_real_shapes(triton_backend, dtype, scales):
    seq_lens, q_lens = [512, 1000, 300, 77], [512, 488, 300, 1]
    case = make_paged(seq_lens, 16, 3, 64, dtype, scales, device="cuda")
    q, cu = _prefill_inputs(case, q_lens, 9, 64, dtype, "cuda")
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.125, case.k_scale, case.v_scale)
    out = paged_prefill_attention(*args)
    want = paged_prefill_attention_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
