"""Rotary position embedding (rotate-half / HF Llama convention) and its cos/sin cache.

Shapes:
    q                [T, Hq, D];  k  [T, Hkv, D]
    positions        [T] int64
    cos_sin_cache    [max_position, D]: cos in [:, :D/2], sin in [:, D/2:]
out_i     = x_i * cos_i - x_{i+D/2} * sin_i
out_{i+D/2} = x_{i+D/2} * cos_i + x_i * sin_i        for i < D/2
"""

from __future__ import annotations

import math

import torch

from kernels._triton import require_triton, tl, triton


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # float32 throughout, exactly as transformers computes it (the model oracle)
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same as transformers' _compute_llama3_parameters.
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling needs {exc.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] table; scaling is an HF rope_scaling / rope_parameters dict."""
    if head_dim % 2 or head_dim <= 0:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = _inv_freq(head_dim, float(base))
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (default, linear, llama3)")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_position, D/2]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cache.to(dtype=dtype, device=device)


def check_rotary(q, k, positions, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q, k must be [T, Hq, D], [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64, got {positions.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_position, D={q.shape[2]}], got {tuple(cos_sin_cache.shape)}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rotary(q, k, positions, cos_sin_cache)
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long())  # [T, D]
    if cs.dtype != q.dtype:
        cs = cs.to(q.dtype)
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, positions_ptr, cos_sin_ptr,
    stride_xt, stride_xh, stride_xd,
    stride_ot, stride_oh, stride_od,
    stride_cs,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: rotate all its heads with one cos/sin row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mask = (offs_h[:, None] < NUM_HEADS) & mask_d[None, :]
    x1_ptrs = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    o1_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o1_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + HALF * stride_od, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotary_launch(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens and num_heads:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, out, positions, cos_sin_cache,
            *x.stride(), *out.stride(), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
        )
    return out


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rotary(q, k, positions, cos_sin_cache)
    require_triton(q)
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    return _rotary_launch(q, positions, cos_sin_cache), _rotary_launch(k, positions, cos_sin_cache)
