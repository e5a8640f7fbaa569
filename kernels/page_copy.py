"""Copy whole pages between the paged pool and a contiguous buffer (offload, transfer, load).

Shapes:
    cache     [num_pages, *page_shape]  e.g. [num_pages, page_size, Hkv, D]; may be strided
    page_ids  [N] int64 (int32 accepted)
    buffer    [N, *page_shape]
gather_pages: buffer[i] = cache[page_ids[i]];  scatter_pages: cache[page_ids[i]] = src[i].
fp8 pages are copied bit-exactly (as bytes).
"""

from __future__ import annotations

import torch

from kernels._triton import require_triton, tl, triton
from kernels.fp8 import FP8_DTYPE


def check_pages(cache: torch.Tensor, page_ids: torch.Tensor, buf: torch.Tensor | None, name: str):
    if cache.dim() < 2:
        raise ValueError(f"cache must be [num_pages, ...], got {tuple(cache.shape)}")
    if page_ids.dim() != 1 or page_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"page_ids must be a 1-d int64 tensor, got {page_ids.dtype} {tuple(page_ids.shape)}")
    if buf is not None:
        want = (page_ids.shape[0], *cache.shape[1:])
        if tuple(buf.shape) != want:
            raise ValueError(f"{name} must be {list(want)}, got {list(buf.shape)}")
        if buf.dtype != cache.dtype:
            raise ValueError(f"{name} dtype {buf.dtype} differs from cache dtype {cache.dtype}")
        if buf.device != cache.device:
            raise ValueError(f"{name} is on {buf.device}, cache on {cache.device}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no fp8 kernel on CPU: move fp8 pages as uint8
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def gather_pages_ref(
    cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    check_pages(cache, page_ids, out, "out")
    if out is None:
        out = torch.empty((page_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    try:
        torch.index_select(_bytes(cache), 0, page_ids.long(), out=_bytes(out))
    except IndexError:
        raise ValueError(f"page_ids outside [0, {cache.shape[0]})") from None
    return out


def scatter_pages_ref(cache: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    check_pages(cache, page_ids, src, "src")
    try:
        _bytes(cache).index_copy_(0, page_ids.long(), _bytes(src))
    except (IndexError, RuntimeError):
        raise ValueError(f"page_ids outside [0, {cache.shape[0]})") from None


# --------------------------------------------------------------------------- Triton


@triton.jit
def _copy_pages_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    dim1, dim2, dim3,
    stride_s0, stride_s1, stride_s2, stride_s3,
    stride_d0, stride_d1, stride_d2, stride_d3,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid: (N pages, chunks of one page). A page is [dim1, dim2, dim3] with any strides.
    i = tl.program_id(0)
    src_page = tl.load(src_ids_ptr + i).to(tl.int64) if SRC_INDEXED else i.to(tl.int64)
    dst_page = tl.load(dst_ids_ptr + i).to(tl.int64) if DST_INDEXED else i.to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim1 * dim2 * dim3
    a = offs // (dim2 * dim3)
    b = (offs // dim3) % dim2
    c = offs % dim3
    x = tl.load(src_ptr + src_page * stride_s0 + a * stride_s1 + b * stride_s2 + c * stride_s3, mask=mask)
    tl.store(dst_ptr + dst_page * stride_d0 + a * stride_d1 + b * stride_d2 + c * stride_d3, x, mask=mask)


_COPY_BLOCK = 1024


def _as_4d(t: torch.Tensor, name: str) -> torch.Tensor:
    t = _bytes(t)
    if t.dim() > 4:
        try:
            t = t.view(t.shape[0], t.shape[1], t.shape[2], -1)  # merge trailing dims if strides allow
        except RuntimeError:
            raise ValueError(f"{name}: pages of rank > 3 need mergeable trailing dims") from None
    while t.dim() < 4:
        t = t.unsqueeze(1)
    return t


def _copy_pages(src, dst, src_ids, dst_ids):
    num_pages = (src_ids if src_ids is not None else dst_ids).shape[0]
    if num_pages == 0:
        return
    s4, d4 = _as_4d(src, "src"), _as_4d(dst, "dst")
    _, dim1, dim2, dim3 = s4.shape
    ids = src_ids if src_ids is not None else dst_ids
    grid = (num_pages, triton.cdiv(dim1 * dim2 * dim3, _COPY_BLOCK))
    _copy_pages_kernel[grid](
        s4, d4, src_ids if src_ids is not None else ids, dst_ids if dst_ids is not None else ids,
        dim1, dim2, dim3, *s4.stride(), *d4.stride(),
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None, BLOCK=_COPY_BLOCK,
    )


def _check_ids_in_bounds(cache: torch.Tensor, page_ids: torch.Tensor) -> None:
    # host tensors only (a CUDA check would sync); the interpreter would segfault
    if not page_ids.is_cuda and page_ids.numel():
        if int(page_ids.min()) < 0 or int(page_ids.max()) >= cache.shape[0]:
            raise ValueError(f"page_ids outside [0, {cache.shape[0]})")


def gather_pages_triton(
    cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    check_pages(cache, page_ids, out, "out")
    require_triton(cache)
    _check_ids_in_bounds(cache, page_ids)
    if out is None:
        out = torch.empty((page_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _copy_pages(cache, out, page_ids, None)
    return out


def scatter_pages_triton(cache: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    check_pages(cache, page_ids, src, "src")
    require_triton(cache)
    _check_ids_in_bounds(cache, page_ids)
    _copy_pages(src, cache, None, page_ids)
