"""Paged decode and prefill/extend attention on the CPU, reading the paged cache in place.

Launchers of the native op ``kvbus_cpu.paged_attention`` (``kernels/cpu/paged_attention.cpp``,
built by ``kernels/native.py``). Same signatures, shapes and results as the torch references in
``attention_decode.py`` / ``attention_prefill.py``, which gather every sequence's pages into a
padded copy per layer per step; these touch each KV row once, where it lives.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.attention_decode import check_decode
from kernels.attention_prefill import check_prefill
from kernels.fp8 import FP8_DTYPE

_NO_CU = torch.empty(0, dtype=torch.int32)


def can_run(q: torch.Tensor, k_cache: torch.Tensor, *_args, **_kwargs) -> bool:
    """The native op serves this call: CPU, float32/bfloat16 q, float32/bfloat16/fp8 KV,
    contiguous head dimension, and the extension is built."""
    return (
        not q.is_cuda
        and q.dtype in (torch.float32, torch.bfloat16)
        and (k_cache.dtype == q.dtype or k_cache.dtype == FP8_DTYPE)
        and k_cache.stride(-1) == 1
        and q.shape[-1] <= 512
        and native.available()
    )


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _launch(q, k_cache, v_cache, block_tables, cu, seq_lens, scale, k_scale, v_scale) -> torch.Tensor:
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16 on the CPU, got {q.dtype}")
    if k_cache.dtype != FP8_DTYPE and k_cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from q dtype {q.dtype} (and is not fp8)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    if q.shape[0] == 0:
        return out
    is_fp8 = k_cache.dtype == FP8_DTYPE
    try:  # the op checks lengths and page ids itself (one pass in C++, not 5 torch ops a layer)
        native.ops().paged_attention(
            q, k_cache, v_cache, _int32(block_tables), cu, _int32(seq_lens), float(scale),
            k_scale.float().contiguous() if is_fp8 else None, v_scale.float().contiguous() if is_fp8 else None, out,
        )
    except RuntimeError as exc:
        raise native.as_value_error(exc) from None
    return out


def paged_decode_attention_cpu(
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
    return _launch(q, k_cache, v_cache, block_tables, _NO_CU, seq_lens, scale, k_scale, v_scale)


def paged_prefill_attention_cpu(
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
    return _launch(q, k_cache, v_cache, block_tables, _int32(cu_seqlens_q), seq_lens, scale, k_scale, v_scale)

