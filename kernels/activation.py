"""SiLU-and-mul (the SwiGLU gate of Llama MLPs).

Shapes:
    x    [T, 2d]  (gate | up, as produced by a fused gate_up projection)
    out  [T, d] = silu(x[:, :d]) * x[:, d:], dtype of x
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import require_triton, tl, triton


def check_silu_and_mul(x: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, 2d] with an even last dim, got {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul(x)
    d = x.shape[-1] // 2
    out = F.silu(x[..., :d])
    return out.mul_(x[..., d:])


# --------------------------------------------------------------------------- Triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d,
    BLOCK: tl.constexpr,
):
    # grid: (rows, chunks of d)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul(x)
    require_triton(x)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block
        )
    return out
