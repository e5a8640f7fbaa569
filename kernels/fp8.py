"""fp8 e4m3 KV quantization: per-tensor or per-head scales.

Shapes:
    x      [..., H, D]   any float dtype (the head dim is -2)
    scale  []  (per-tensor) or [H] (per-head), float32
    fp8    same shape as x, torch.float8_e4m3fn

stored = saturate(x / scale) in e4m3 (+-448); read = fp8 * scale.
The attention and store_kv kernels apply the same formulas inline; these standalone functions
serve page transfer, the host tier and tests.
"""

from __future__ import annotations

import torch

from kernels._triton import require_triton, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12


def check_scale(scale: torch.Tensor | None, num_heads: int, name: str = "scale") -> None:
    if scale is None:
        raise ValueError(f"{name} is required for an fp8 tensor")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor")
    if scale.dim() == 1 and scale.shape[0] != num_heads:
        raise ValueError(f"per-head {name} has {scale.shape[0]} entries for {num_heads} heads")
    if scale.dim() > 1:
        raise ValueError(f"{name} must be 0-d (per-tensor) or [num_heads], got {tuple(scale.shape)}")


def _broadcastable(scale: torch.Tensor) -> torch.Tensor:
    # per-head scale [H] broadcasts over [..., H, D]
    return scale.view(-1, 1) if scale.dim() == 1 else scale


def _check_x(x: torch.Tensor, scale: torch.Tensor | None) -> None:
    if x.dim() < 2 and scale is not None and scale.dim() == 1:
        raise ValueError("per-head scales need x with a head dim at -2")
    check_scale(scale, x.shape[-2] if x.dim() >= 2 else 1)


@triton.jit
def round_to_e4m3(x):
    """Round float32 x (already clamped to +-448) to the nearest-even e4m3 value, in float32.

    NOTE: the Triton interpreter's float32 -> e4m3 cast mis-rounds (ties away from even, and a
    mantissa carry drops the value a whole binade: -31.92 -> -16). Rounding here first makes the
    final cast exact on every backend; on a GPU it costs a few ALU ops in a memory-bound kernel.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share the 2^-6 binade
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = quantum * 12582912.0  # 1.5 * 2^23 * quantum: adding it rounds to a quantum multiple
    rounded = (x + magic) - magic
    return tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of zero


# --------------------------------------------------------------------------- references


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_x(x, scale)
    y = x.to(torch.float32) / _broadcastable(scale)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8_ref(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if x.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8 expects {FP8_DTYPE}, got {x.dtype}")
    _check_x(x, scale)
    y = x.to(torch.float32).mul_(_broadcastable(scale))
    return y if dtype == torch.float32 else y.to(dtype)


def compute_fp8_scale(x: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """amax / 448 as float32: 0-d, or [H] over the head dim -2 when per_head."""
    if per_head:
        if x.dim() < 2:
            raise ValueError("per_head scales need x with a head dim at -2")
        dims = [d for d in range(x.dim()) if d != x.dim() - 2]
        amax = x.abs().amax(dim=dims) if dims else x.abs()
    else:
        amax = x.abs().amax()
    return (amax.to(torch.float32) / FP8_MAX).clamp_min_(MIN_SCALE)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, num_elements,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PER_HEAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # x, out: contiguous [R, H, D] flattened; element i belongs to head (i // D) % H.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_HEAD:
        scale = tl.load(scale_ptr + (offs // HEAD_DIM) % NUM_HEADS, mask=mask, other=1.0)
    else:
        scale = tl.load(scale_ptr)
    y = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, num_elements,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PER_HEAD: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_HEAD:
        scale = tl.load(scale_ptr + (offs // HEAD_DIM) % NUM_HEADS, mask=mask, other=1.0)
    else:
        scale = tl.load(scale_ptr)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


_ELEMENTWISE_BLOCK = 1024


def _launch_elementwise(kernel, x, out, scale):
    per_head = scale.dim() == 1
    num_heads, head_dim = (x.shape[-2], x.shape[-1]) if per_head else (1, 1)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
        kernel[grid](x, out, scale.contiguous(), n, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                     PER_HEAD=per_head, BLOCK=_ELEMENTWISE_BLOCK)
    return out


def quantize_fp8_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_x(x, scale)
    require_triton(x)
    x = x.contiguous()
    return _launch_elementwise(_quantize_fp8_kernel, x, torch.empty_like(x, dtype=FP8_DTYPE), scale)


def dequantize_fp8_triton(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if x.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8 expects {FP8_DTYPE}, got {x.dtype}")
    _check_x(x, scale)
    require_triton(x)
    x = x.contiguous()
    return _launch_elementwise(_dequantize_fp8_kernel, x, torch.empty_like(x, dtype=dtype), scale)
