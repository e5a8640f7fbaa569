"""The native CPU paged attention (kernels/cpu/paged_attention.cpp) against the torch references
and against dense float64 attention, on irregular shapes: odd page sizes and head dims, GQA
groups, long contexts that take the split-KV path, extends after a cached prefix, fp8 scales."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
from paged_cases import FP8, dense_attention, make_paged

from kernels import native
from kernels.attention_cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu
from kernels.attention_decode import paged_decode_attention_ref
from kernels.attention_prefill import paged_prefill_attention_ref

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, FP8: 2e-5}


def _q(num_tokens, num_q_heads, head_dim, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q_dtype = torch.float32 if dtype == FP8 else dtype
    return torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(q_dtype)


DECODE_CASES = [
    # page_size, Hkv, group, head_dim, dtype, fp8 scales
    (1, 2, 1, 24, torch.float32, None),
    (5, 3, 3, 16, torch.float32, None),
    (16, 3, 3, 64, torch.float32, None),
    (16, 2, 4, 128, torch.float32, None),
    (7, 1, 8, 40, torch.float32, None),
    (5, 1, 4, 16, torch.bfloat16, None),
    (16, 3, 3, 64, torch.bfloat16, None),
    (5, 3, 3, 16, FP8, "tensor"),
    (16, 2, 4, 64, FP8, "head"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,scales", DECODE_CASES)
@pytest.mark.parametrize("seq_lens", [[1, 70, 13], [1100], [2, 1500, 700, 31]])
def test_decode_matches_reference(page_size, num_kv_heads, group, head_dim, dtype, scales, seq_lens):
    # [1100] and [.., 1500, ..]: few sequences with long contexts take the split-KV path
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales)
    q = _q(len(seq_lens), num_kv_heads * group, head_dim, dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3, case.k_scale, case.v_scale)
    out = paged_decode_attention_cpu(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = paged_decode_attention_ref(*args)
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,scales", [(torch.float32, None), (FP8, "head")])
def test_decode_matches_dense_float64(dtype, scales):
    seq_lens = [3, 600, 41]
    case = make_paged(seq_lens, 16, 3, 64, dtype, scales, seed=5)
    q = _q(3, 9, 64, dtype, seed=6)
    out = paged_decode_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125,
                                     case.k_scale, case.v_scale)
    for b, n in enumerate(seq_lens):
        want = dense_attention(q[b:b + 1], case.keys[b], case.values[b], 0.125, torch.tensor([n - 1]))
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=1e-5, rtol=1e-5)


PREFILL_CASES = [
    (1, 2, 1, 24, torch.float32, None),
    (5, 3, 3, 16, torch.float32, None),
    (16, 3, 3, 64, torch.float32, None),
    (16, 1, 4, 16, torch.bfloat16, None),
    (5, 2, 2, 16, FP8, "head"),
    (16, 3, 3, 64, FP8, "tensor"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,scales", PREFILL_CASES)
def test_prefill_matches_reference(page_size, num_kv_heads, group, head_dim, dtype, scales):
    # whole prompts (19: two query blocks), extends after a cached prefix (37 = 18 + 19,
    # 300 = 299 + 1), a sequence with no new tokens, and one longer than a split
    seq_lens, q_lens = [19, 37, 6, 300, 4, 700], [19, 19, 1, 1, 0, 45]
    case = make_paged(seq_lens, page_size, num_kv_heads, head_dim, dtype, scales)
    q = _q(sum(q_lens), num_kv_heads * group, head_dim, dtype, seed=2)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.3, case.k_scale, case.v_scale)
    out = paged_prefill_attention_cpu(*args)
    want = paged_prefill_attention_ref(*args)
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_matches_dense_float64():
    seq_lens, q_lens = [33, 90], [33, 40]
    case = make_paged(seq_lens, 16, 3, 64, seed=7)
    q = _q(73, 9, 64, torch.float32, seed=8)
    cu = torch.tensor([0, 33, 73], dtype=torch.int32)
    out = paged_prefill_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens, 0.125)
    for b, (n, m) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_attention(q[rows], case.keys[b], case.values[b], 0.125, torch.arange(n - m, n))
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_result_does_not_depend_on_thread_count(threads):
    # the split-KV decision depends on the thread count; every split must give the same answer
    case = make_paged([2000, 9], 16, 3, 64, seed=3)
    q = _q(2, 9, 64, torch.float32, seed=4)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = paged_decode_attention_cpu(*args)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=2e-5, rtol=2e-5)


def test_junk_past_seq_len_is_never_read():
    # slots past seq_len hold NaN: a kernel that reads them returns NaN
    case = make_paged([21, 5], 8, 2, 16, seed=9)
    for cache in (case.k_cache, case.v_cache):
        for b, n in enumerate((21, 5)):
            page = int(case.block_tables[b, (n - 1) // 8])
            cache[page, (n - 1) % 8 + 1:] = float("nan")
    q = _q(2, 4, 16, torch.float32)
    out = paged_decode_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.3)
    assert torch.isfinite(out).all()


def test_bad_inputs_are_value_errors():
    case = make_paged([9], 4, 2, 16)
    q = _q(1, 2, 16, torch.float32)
    tables = case.block_tables.clone()
    tables[0, 1] = case.k_cache.shape[0]
    with pytest.raises(ValueError, match="page ids"):
        paged_decode_attention_cpu(q, case.k_cache, case.v_cache, tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="pages"):
        paged_decode_attention_cpu(q, case.k_cache, case.v_cache, case.block_tables[:, :2], case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode_attention_cpu(q.double(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="new tokens but seq_len"):
        paged_prefill_attention_cpu(torch.zeros(10, 2, 16), case.k_cache, case.v_cache, case.block_tables,
                                    torch.tensor([0, 10], dtype=torch.int32), case.seq_lens, 1.0)


@pytest.mark.parametrize("head_dim,group,dtype", [(64, 3, torch.float32), (128, 4, torch.float32),
                                                  (64, 3, torch.bfloat16), (64, 3, FP8)])
def test_row_result_does_not_depend_on_its_task(head_dim, group, dtype):
    # A query row gives the same bits whether it is computed in a whole-prompt prefill (blocks of
    # many rows), an extend after a cached prefix of any length (its block starts elsewhere and
    # holds fewer rows) or as a decode (one token): the engine relies on this for a prompt's last
    # token to give the same logits with and without prefix-cache hits.
    n = 150
    case = make_paged([n], 16, 2, head_dim, dtype, "head" if dtype == FP8 else None, seed=11)
    q = _q(n, 2 * group, head_dim, dtype, seed=12)
    args = (case.k_cache, case.v_cache, case.block_tables)
    full = paged_prefill_attention_cpu(q, *args, torch.tensor([0, n], dtype=torch.int32), case.seq_lens, 0.125,
                                       case.k_scale, case.v_scale)
    for new in (1, 2, 5, 6, 11, 33, 70, 149):
        cu = torch.tensor([0, new], dtype=torch.int32)
        part = paged_prefill_attention_cpu(q[n - new:], *args, cu, case.seq_lens, 0.125, case.k_scale, case.v_scale)
        assert torch.equal(part, full[n - new:]), new
    last = paged_decode_attention_cpu(q[n - 1:], *args, case.seq_lens, 0.125, case.k_scale, case.v_scale)
    assert torch.equal(last, full[n - 1:])


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
@pytest.mark.skipif("avx512f" not in native._cpu_flags().split(), reason="needs avx512f (the tile walks with prefetch are the AVX-512 paths)")
def test_build_keeps_the_kv_prefetch():
    # GCC deletes a loop whose only statements are _mm_prefetch calls, and the tile walk's
    # next-tile prefetch is such a loop: built that way, decode attention ran 1.6x slower with
    # every test above still passing. Every instantiation of both tile paths must keep a prefetch.
    so = native.build_dir() / f"{native.NAME}.so"
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                             check=True).stdout
    with_prefetch, without = set(), set()
    for body in listing.split("\n\n"):
        name = re.search(r"::(attend_(?:lanes|wide)<[^>]*>)\(", body.split("\n", 1)[0] if body else "")
        if name:
            (with_prefetch if "prefetcht1" in body else without).add(name.group(1))
    assert len(with_prefetch | without) >= 8, f"expected the tile paths' instantiations in {so}"
    assert not without, f"compiled without their KV prefetch: {sorted(without)}"
