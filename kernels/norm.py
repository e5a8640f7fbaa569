"""RMSNorm with optional fused residual add (HF Llama semantics).

Shapes:
    x, residual   [T, H]   (any leading dims are flattened)
    weight        [H]
    y             [T, H], dtype of x
y = weight * (s * rsqrt(mean(s^2) + eps)).to(x.dtype) with s = x (+ residual) in float32.
With residual, returns (y, x + residual); the sum is taken in x's dtype, as HF does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton


def check_rms_norm(x, weight, residual) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [H={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x: {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    check_rms_norm(x, weight, residual)
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        xf = x.to(torch.float32)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        y = weight * y.to(x.dtype)
        y = y.to(x.dtype)
    return y if residual is None else (y, x)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, residual_out_ptr,
    stride_x, stride_r, stride_y, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per row (the whole hidden dim fits one block).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the sum is rounded to x's dtype first, like the HF residual stream.
        # NOTE: add in float32: the interpreter's bf16 arithmetic is wrong (same result on GPU).
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    check_rms_norm(x, weight, residual)
    require_triton(x)
    hidden = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty_like(y)
        ro2 = res_out.view(-1, hidden)
    else:
        r2 = ro2 = x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y2, ro2,
            x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=triton.next_power_of_2(hidden),
        )
    return y if residual is None else (y, res_out)
