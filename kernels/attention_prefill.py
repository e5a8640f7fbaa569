"""Paged prefill/extend attention: packed new tokens attend causally to a cached prefix and
to themselves. Their K/V must already be stored (store_kv) before the call.

Shapes:
    q                 [T, Hq, D]   new tokens of B sequences, packed
    cu_seqlens_q      [B+1] int32  sequence b owns q rows cu[b]:cu[b+1] (q_len_b of them)
    seq_lens          [B] int32    cached prefix + new tokens
    k_cache, v_cache  [num_pages, page_size, Hkv, D]  (fp8 with k_scale/v_scale)
    block_tables      [B, max_pages] int32
    out               [T, Hq, D]
New token i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to every
position <= its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton
from kernels.attention_decode import (
    attention_launch_args,
    check_attention,
    check_tables_in_bounds,
    head_major,
    per_q_head,
)
from kernels.fp8 import FP8_DTYPE


def check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale):
    check_attention(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must be [B+1={seq_lens.shape[0] + 1}], got {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale)
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to T={q.shape[0]}, got {cu[0]}..{cu[-1]}")
    group = q.shape[1] // num_kv_heads
    q_scale = out_scale = None
    if k_cache.dtype == FP8_DTYPE:
        # fold the fp8 scales into q and the output: q . (k8 * s) == (q * s) . k8
        q_scale, out_scale = per_q_head(k_scale, group), per_q_head(v_scale, group)
    out = torch.empty_like(q)
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"sequence {b}: {q_len} new tokens but seq_len {seq_len}")
        num_pages = -(-seq_len // page_size)
        if num_pages > block_tables.shape[1]:
            raise ValueError(f"sequence {b} needs {num_pages} pages, block_tables has {block_tables.shape[1]}")
        page_ids = block_tables[b, :num_pages].long()
        # k, v: [Hkv, L, D] float32
        k = head_major(k_cache, page_ids, 1)[0, :, :seq_len]
        v = head_major(v_cache, page_ids, 1)[0, :, :seq_len]
        qh = q[start:end].transpose(0, 1).to(torch.float32)  # [Hq, n, D]
        if q_scale is not None:
            qh = qh * q_scale
        if q_len == seq_len:
            mask, is_causal = None, True
        else:
            # bottom-right aligned causal mask: row i sees keys <= prefix + i
            prefix = seq_len - q_len
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= torch.arange(
                prefix, seq_len, device=q.device).unsqueeze(1)
            is_causal = False
        # NOTE: 4-d inputs take torch's fused CPU flash kernel; 3-d ones fall back to the
        # math path (~4x slower at 1024 tokens, it materializes [Hq, n, L] scores).
        o = F.scaled_dot_product_attention(
            qh[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )[0]  # [Hq, n, D]
        if out_scale is not None:
            o = o * out_scale
        out[start:end] = o.transpose(0, 1)
    return out


# --------------------------------------------------------------------------- Triton


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_bt_b, stride_bt_p,
    stride_ot, stride_oh, stride_od,
    stride_k_scale_h, stride_v_scale_h,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (B, Hq, query blocks). One program: BLOCK_M new tokens of one sequence, one q head.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if block_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    # q: [BLOCK_M, BLOCK_D]; query i sits at position prefix + i
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    if UPCAST_DOT:  # every tl.dot below runs in q's dtype
        q = q.to(tl.float32)
    q_pos = prefix + offs_m
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale_h)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale_h)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt_b
    # keys past the block's last query position are all masked: stop there
    kv_end = tl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        tokens = start + offs_n
        mask_n = tokens < kv_end
        pages = tl.load(table + (tokens // PAGE_SIZE) * stride_bt_p, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_slots = pages * stride_kp + (tokens % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_slots[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if IS_FP8:
            k = k.to(tl.float32) * k_scale
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        # causal: every query row sees key 0 in the first tile, so m_i is finite from there on
        visible = mask_n[None, :] & (tokens[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_slots = pages * stride_vp + (tokens % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_slots[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if IS_FP8:
            v = v.to(tl.float32) * v_scale
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale)
    require_triton(q, k_cache)
    check_tables_in_bounds(k_cache, block_tables, seq_lens)
    launch = attention_launch_args(q, k_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # NOTE: syncs on CUDA
    block_m = 64 if max_seqlen_q > 32 else 16
    grid = (num_seqs, num_q_heads, triton.cdiv(max_seqlen_q, block_m))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, launch["k_scale"], launch["v_scale"], float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        launch["k_scale_stride"], launch["v_scale_stride"],
        PAGE_SIZE=page_size, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=32 if head_dim > 128 else 64,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **launch["constexprs"],
    )
    return out
