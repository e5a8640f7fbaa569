"""Builders for paged-KV test cases, written with plain indexing (no code under test).

The pool mimics the engine's layout, [num_pages, layers, 2, page_size, Hkv, D], so each
per-layer k_cache / v_cache is a strided view, and pages are assigned in a shuffled order.
Slots no sequence owns hold random junk, so a kernel that reads past seq_len is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
PAD_PAGE = 1_000_000  # block-table padding: must never be dereferenced


@dataclass
class PagedCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D] float32, the values the cache holds
    values: list[torch.Tensor]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def make_paged(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    scales: str | None = None,  # fp8 only: "tensor" or "head"
    device: str = "cpu",
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    shape = (num_pages, 2, 2, page_size, num_kv_heads, head_dim)
    junk = torch.randn(shape, generator=gen)
    k_scale = v_scale = None
    if dtype == FP8:
        if scales == "head":
            k_scale = torch.rand(num_kv_heads, generator=gen) * 0.02 + 0.005
            v_scale = torch.rand(num_kv_heads, generator=gen) * 0.02 + 0.005
        else:
            k_scale, v_scale = torch.tensor(0.011), torch.tensor(0.017)
        pool = (junk / 0.01).clamp(-448, 448).to(FP8)
    else:
        pool = junk.to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # strided per-layer views

    order = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(pages_per_seq) + 2
    tables = torch.full((len(seq_lens), max_pages), PAD_PAGE, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        ids = [order.pop() for _ in range(pages_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(n)
        page_of = torch.tensor(ids, dtype=torch.long)[pos // page_size]
        for cache, x, s in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            if dtype == FP8:
                div = s.view(-1, 1) if s.dim() else s
                cache[page_of, pos % page_size] = (x / div).clamp(-448, 448).to(FP8)
            else:
                cache[page_of, pos % page_size] = x.to(dtype)
        # what the cache now holds, as float32
        kk = k_cache[page_of, pos % page_size].to(torch.float32)
        vv = v_cache[page_of, pos % page_size].to(torch.float32)
        if dtype == FP8:
            kk = kk * (k_scale.view(-1, 1) if k_scale.dim() else k_scale)
            vv = vv * (v_scale.view(-1, 1) if v_scale.dim() else v_scale)
        keys.append(kk)
        values.append(vv)
    pool = pool.to(device)  # moving the pool keeps the per-layer views strided
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PagedCase(
        pool[:, 1, 0], pool[:, 1, 1],
        tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys, values, to(k_scale), to(v_scale),
    )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor):
    """float64 causal attention on unpaged K/V: q [n, Hq, D], k/v [L, Hkv, D], q_pos [n]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    hidden = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    s = s.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
