"""Paged decode attention: one new query token per sequence over its paged KV (GQA).

Shapes:
    q                 [B, Hq, D]
    k_cache, v_cache  [num_pages, page_size, Hkv, D]   (fp8 with k_scale/v_scale: [] or [Hkv])
    block_tables      [B, max_pages] int32; entries past a sequence's last page are ignored
    seq_lens          [B] int32, tokens in cache including the current one (>= 1)
    out               [B, Hq, D], dtype of q
Query head h reads KV head h // (Hq // Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import is_interpreter, require_triton, tl, triton
from kernels.fp8 import FP8_DTYPE, check_scale


def check_attention(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache, v_cache must both be [num_pages, page_size, Hkv, D]")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [*, Hq, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be [B, max_pages] int32, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must be [B={block_tables.shape[0]}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if k_cache.dtype == FP8_DTYPE:
        check_scale(k_scale, num_kv_heads, "k_scale")
        check_scale(v_scale, num_kv_heads, "v_scale")


def check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale) -> None:
    check_attention(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}")


def head_major(cache: torch.Tensor, page_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Gather pages [B * n] of a [num_pages, P, Hkv, D] cache into float32 [B, Hkv, n * P, D].

    One index_select (fast on strided pools) and one copy that permutes and converts dtype.
    fp8 values stay unscaled: callers fold the scales into q and the output.
    """
    _, page_size, num_kv_heads, head_dim = cache.shape
    try:
        pages = cache.index_select(0, page_ids)  # [B * n, P, Hkv, D]
    except IndexError:
        raise ValueError(f"block_tables hold page ids outside [0, {cache.shape[0]})") from None
    seq_len = page_ids.shape[0] // num_seqs * page_size
    out = torch.empty((num_seqs, num_kv_heads, seq_len, head_dim), dtype=torch.float32, device=cache.device)
    out.copy_(pages.view(num_seqs, seq_len, num_kv_heads, head_dim).transpose(1, 2))
    return out


def per_head(scale: torch.Tensor) -> torch.Tensor:
    """fp8 scale as a [Hkv, 1, 1] (or 0-d) factor for [.., Hkv, rows, D] tensors."""
    return scale.view(-1, 1, 1) if scale.dim() == 1 else scale


def per_q_head(scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 scale as a [Hq, 1, 1] (or 0-d) factor for [.., Hq, rows, D] tensors."""
    return scale.repeat_interleave(group).view(-1, 1, 1) if scale.dim() == 1 else scale


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if num_seqs == 0:
        return torch.empty_like(q)
    # Gather every sequence's pages into a padded [B, Hkv, L, D] and mask the tail.
    num_pages = -(-int(seq_lens.max()) // page_size)
    if num_pages > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {num_pages} pages but block_tables has {block_tables.shape[1]}")
    if num_seqs == 1 and q.dtype == torch.float32 and k_cache.dtype == torch.float32:
        # single fp32 stream (the engine's batch-1 decode): attend over strided views of the
        # gathered pages; skipping head_major's copy saves ~1/3 of this call, same result.
        seq_len = int(seq_lens[0])
        page_ids = block_tables[0, :num_pages].long()
        try:
            k, v = k_cache.index_select(0, page_ids), v_cache.index_select(0, page_ids)
        except IndexError:
            raise ValueError(f"block_tables hold page ids outside [0, {k_cache.shape[0]})") from None
        k = k.view(1, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)  # [1, Hkv, L, D]
        v = v.view(1, -1, num_kv_heads, head_dim)[:, :seq_len].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.view(1, num_q_heads, 1, head_dim), k, v, scale=scale, enable_gqa=True
        )  # [1, Hq, 1, D]
        return out.view(1, num_q_heads, head_dim)
    pages = block_tables[:, :num_pages]
    if num_seqs > 1:
        # padding entries may be anything: point them at page 0 (masked below)
        used = torch.arange(num_pages, device=q.device).unsqueeze(0) * page_size < seq_lens.unsqueeze(1)
        pages = pages.masked_fill(~used, 0)
    page_ids = pages.reshape(-1).long()
    k = head_major(k_cache, page_ids, num_seqs)
    v = head_major(v_cache, page_ids, num_seqs)
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if num_seqs == 1:
        # single stream: no padding to mask, one fused SDPA call (~25% faster than below)
        seq_len = int(seq_lens[0])
        qs = q.view(1, num_q_heads, 1, head_dim).to(torch.float32)
        if is_fp8:
            qs = qs * per_q_head(k_scale, group)
        out = F.scaled_dot_product_attention(
            qs, k[:, :, :seq_len], v[:, :, :seq_len], scale=scale, enable_gqa=True
        )  # [1, Hq, 1, D]
        if is_fp8:
            out = out * per_q_head(v_scale, group)
        return out.view(1, num_q_heads, head_dim).to(q.dtype)
    max_len = k.shape[2]
    # q: [B, Hkv, G, D]; scores: [B, Hkv, G, L]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).to(torch.float32) * scale
    if is_fp8:
        qg = qg * per_head(k_scale)  # q . (k8 * s) == (q * s) . k8
    scores = torch.matmul(qg, k.transpose(-1, -2))
    is_pad = torch.arange(max_len, device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [B, L]
    scores.masked_fill_(is_pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # NOTE: padded slots hold whatever the pool had (never-written memory can be NaN) and
    # 0 * NaN = NaN, so zero them in v (a private copy) rather than trust the zero probs.
    v.masked_fill_(is_pad[:, None, :, None], 0.0)
    out = torch.matmul(probs, v)  # [B, Hkv, G, D]
    if is_fp8:
        out.mul_(per_head(v_scale))
    return out.view(num_seqs, num_q_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_bt_b, stride_bt_p,
    stride_ob, stride_oh, stride_od,
    stride_k_scale_h, stride_v_scale_h,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # grid: (B, Hkv). One program serves the GROUP query heads that share KV head `kv_head`,
    # so each K/V tile is read once per group (GQA). Online softmax over BLOCK_N-token tiles;
    # a tile's tokens may span pages, so each token looks up its own page (any page size).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g
    # q: [BLOCK_G, BLOCK_D]
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :], other=0.0,
    )
    if UPCAST_DOT:  # every tl.dot below runs in q's dtype
        q = q.to(tl.float32)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr + kv_head * stride_k_scale_h)
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale_h)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt_b
    for start in range(0, seq_len, BLOCK_N):
        tokens = start + offs_n
        mask_n = tokens < seq_len
        pages = tl.load(table + (tokens // PAGE_SIZE) * stride_bt_p, mask=mask_n, other=0).to(tl.int64)
        slots = pages * stride_kp + (tokens % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # k: [BLOCK_N, BLOCK_D]; masked rows load 0 so padding never injects NaN
        k = tl.load(k_cache_ptr + slots[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if IS_FP8:
            k = k.to(tl.float32) * k_scale
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
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
        out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :],
    )


def check_tables_in_bounds(k_cache, block_tables, seq_lens) -> None:
    """Host-side bounds check of the pages a launch will read (skipped for CUDA tensors: it
    would sync every step). Under the interpreter an out-of-range page id is a segfault."""
    if block_tables.is_cuda or seq_lens.shape[0] == 0:
        return
    page_size = k_cache.shape[1]
    need = (seq_lens.long() + page_size - 1) // page_size  # pages per sequence
    if int(need.max()) > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {int(need.max())} pages but block_tables has {block_tables.shape[1]}")
    used = torch.arange(block_tables.shape[1]).unsqueeze(0) < need.unsqueeze(1)
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
        raise ValueError(f"block_tables hold page ids outside [0, {k_cache.shape[0]})")


def attention_launch_args(q, k_cache, k_scale, v_scale) -> dict:
    """Launch arguments shared by the decode and prefill launchers (fp8 scales, dot dtype)."""
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float32/float16/bfloat16, got {q.dtype}")
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if not is_fp8 and k_cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from q dtype {q.dtype} (and is not fp8)")
    # NOTE: the Triton interpreter computes bf16/fp16 tl.dot on raw bits (garbage), so under
    # TRITON_INTERPRET the dots run in float32; on a GPU they run in q's dtype.
    upcast = q.dtype != torch.float32 and is_interpreter()
    return {
        "k_scale": k_scale if is_fp8 else q,  # dummy pointer when unused
        "v_scale": v_scale if is_fp8 else q,
        "k_scale_stride": k_scale.stride(0) if is_fp8 and k_scale.dim() == 1 else 0,
        "v_scale_stride": v_scale.stride(0) if is_fp8 and v_scale.dim() == 1 else 0,
        "constexprs": {
            "IS_FP8": is_fp8,
            "UPCAST_DOT": upcast,
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 or upcast else "tf32",
        },
    }


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    check_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    require_triton(q, k_cache)
    check_tables_in_bounds(k_cache, block_tables, seq_lens)
    launch = attention_launch_args(q, k_cache, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, launch["k_scale"], launch["v_scale"], float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        launch["k_scale_stride"], launch["v_scale_stride"],
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **launch["constexprs"],
    )
    return out
