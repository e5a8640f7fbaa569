"""Native CPU launchers of the small per-layer ops: store-KV, rotary, RMSNorm, SiLU-and-mul.

The ops live in ``kernels/cpu/layer_ops.cpp`` (built by ``kernels/native.py``); each launcher has
its reference's signature and results (``paged_store.store_kv_ref``, ``rotary.apply_rotary_ref``,
``norm.rms_norm_ref``, ``activation.silu_and_mul_ref``) and a ``*_ok`` predicate saying when it serves a call: CPU,
float32 (bfloat16 too for store-KV, which copies, or rounds float32 rows into bfloat16 caches as
``.to()`` does), contiguous head dimension, extension built.
Everything else (fp8 caches, other dtypes) takes the reference. Float results may differ from the
references' in the last bit (fused arithmetic, the kernels' own exp).
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.activation import check_silu_and_mul
from kernels.norm import check_rms_norm
from kernels.paged_store import check_store_kv
from kernels.rotary import check_rotary


def store_kv_ok(k, v, k_cache, v_cache, *_args, **_kwargs) -> bool:
    return (
        not k.is_cuda
        and k.dtype in (torch.float32, torch.bfloat16) and k.dtype == v.dtype
        and k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, torch.bfloat16)
        and k.dim() == 3 and k.stride(-1) == 1 and v.stride(-1) == 1
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and native.available()
    )


def store_kv_cpu(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    try:
        native.ops().store_kv(k, v, k_cache, v_cache, slot_mapping.long())
    except RuntimeError as exc:
        raise native.as_value_error(exc) from None


def rotary_ok(q, k, positions, cos_sin_cache) -> bool:
    return (
        not q.is_cuda
        and q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
        and native.available()
    )


def apply_rotary_cpu(q, k, positions, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    check_rotary(q, k, positions, cos_sin_cache)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    if q.shape[0]:
        try:
            native.ops().rotary(q, k, positions.long(), cos_sin_cache.contiguous(), q_out, k_out)
        except RuntimeError as exc:
            raise native.as_value_error(exc) from None
    return q_out, k_out


def silu_and_mul_ok(x) -> bool:
    return not x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1 and native.available()


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    if x.shape[0]:
        native.ops().silu_and_mul(x, out)
    return out


def rms_norm_ok(x, weight, eps, residual=None) -> bool:
    return (
        not x.is_cuda
        and x.dtype == weight.dtype == torch.float32
        and x.dim() == 2 and x.stride(-1) == 1
        and (residual is None or (residual.dim() == 2 and residual.stride(-1) == 1))
        and native.available()
    )


def rms_norm_cpu(x, weight, eps, residual=None):
    check_rms_norm(x, weight, residual)
    y = torch.empty(x.shape, dtype=x.dtype)
    s = torch.empty(x.shape, dtype=x.dtype) if residual is not None else y
    if x.shape[0]:
        native.ops().rms_norm(x, weight.contiguous(), residual, float(eps), y, s)
    return y if residual is None else (y, s)
