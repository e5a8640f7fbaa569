"""Store the new tokens' K/V into the paged cache by slot.

Shapes:
    k, v                  [T, Hkv, D]
    k_cache, v_cache      [num_pages, page_size, Hkv, D]  (may be strided views of a pool)
    slot_mapping          [T] int64, slot = page_id * page_size + offset; negative = skip
    k_scale, v_scale      fp8 caches only: [] or [Hkv] float32; stored = e4m3(x / scale)
"""

from __future__ import annotations

import torch

from kernels._triton import require_triton, tl, triton
from kernels.fp8 import FP8_DTYPE, check_scale, quantize_fp8_ref, round_to_e4m3


def check_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k, v must both be [T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache, v_cache must both be [num_pages, page_size, Hkv, D]")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k is [T, {k.shape[1]}, {k.shape[2]}] but the cache holds "
            f"[.., {k_cache.shape[2]}, {k_cache.shape[3]}] per slot"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    if k_cache.dtype == FP8_DTYPE:
        check_scale(k_scale, k.shape[1], "k_scale")
        check_scale(v_scale, k.shape[1], "v_scale")


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    page_size = k_cache.shape[1]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    pages = slots // page_size
    offsets = slots - pages * page_size
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_fp8_ref(k, k_scale), quantize_fp8_ref(v, v_scale)
    # NOTE: index_put_ with (page, offset) works on any strided view of a pool.
    try:
        k_cache[pages, offsets] = k.to(k_cache.dtype)
    except IndexError:
        raise ValueError(f"slot_mapping holds slots past the cache ({k_cache.shape[0] * page_size} slots)") from None
    v_cache[pages, offsets] = v.to(v_cache.dtype)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    stride_scale_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
):
    # One program per token: copy its [Hkv, D] K and V rows into the slot.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    if IS_FP8:
        # stored = saturate(x / scale); stride_scale_h is 0 for a per-tensor scale
        k_scale = tl.load(k_scale_ptr + offs_h * stride_scale_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + offs_h * stride_scale_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        k = round_to_e4m3(tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale[:, None]), -448.0, 448.0))
        v = round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale[:, None]), -448.0, 448.0))

    kc = k_cache_ptr + page * stride_kcp + offset * stride_kcs
    vc = v_cache_ptr + page * stride_vcp + offset * stride_vcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    require_triton(k, k_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if is_fp8 and k_scale.shape != v_scale.shape:
        raise ValueError("k_scale and v_scale must both be per-tensor or both per-head")
    if not slot_mapping.is_cuda and int(slot_mapping.max()) >= k_cache.shape[0] * k_cache.shape[1]:
        # host-side check only (a CUDA check would sync); the interpreter would segfault
        raise ValueError(f"slot_mapping holds slots past the cache ({k_cache.shape[0] * k_cache.shape[1]} slots)")
    scale_stride = k_scale.stride(0) if is_fp8 and k_scale.dim() == 1 else 0
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if is_fp8 else k, v_scale if is_fp8 else v,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), scale_stride,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8,
    )
