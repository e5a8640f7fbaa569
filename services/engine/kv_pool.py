"""The paged KV pool: one tensor for all layers, sized from a memory budget.

Layout: ``[num_pages, num_layers, 2, page_size, Hkv, D]``, page-major, so one
page of every layer (what the cache tiers and the transfer layer move) is a
single contiguous block. Each layer's ``k_cache``/``v_cache`` is a strided
``[num_pages, page_size, Hkv, D]`` view, as docs/kernel-api.md allows.
"""

from __future__ import annotations

import os

import torch

from services.engine.huge_pages import huge_page_empty, populate
from services.engine.model_config import ModelConfig

GB = 1024**3


def kv_bytes_per_page(mc: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return mc.num_layers * 2 * page_size * mc.num_kv_heads * mc.head_dim * itemsize


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the pool now: CUDA free memory, or MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class KVPool:
    def __init__(
        self,
        mc: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        fp8_scale: float = 1.0,
        prefault: bool = False,
        huge_pages: bool = False,
    ):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        # NOTE: uninitialized. On CPU untouched pages cost no RAM until first written, unless
        # ``prefault`` maps them all now (EngineConfig.kv_prefault).
        shape = (num_pages, mc.num_layers, 2, page_size, mc.num_kv_heads, mc.head_dim)
        if device.type == "cpu":  # EngineConfig.kv_huge_pages says when huge pages pay (huge_pages.py)
            self.data = huge_page_empty(shape, dtype, huge=huge_pages)
            if prefault:
                populate(self.data)
        else:
            self.data = torch.empty(shape, dtype=dtype, device=device)
        self.k_caches = [self.data[:, layer, 0] for layer in range(mc.num_layers)]
        self.v_caches = [self.data[:, layer, 1] for layer in range(mc.num_layers)]
        self.is_fp8 = dtype == torch.float8_e4m3fn
        scale = torch.tensor(fp8_scale, dtype=torch.float32, device=device) if self.is_fp8 else None
        self.k_scale = self.v_scale = scale

    def copy_rows(self, src: int, dst: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` rows (tokens) of page ``src`` into page ``dst``, every layer, K and V
        (the block manager's tail reuse, ``tails.py``)."""
        self.data[dst, :, :, :num_rows] = self.data[src, :, :, :num_rows]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @classmethod
    def pages_for_budget(
        cls, mc: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device,
        memory_gb: float | None, mem_fraction: float,
    ) -> int:
        budget = memory_gb * GB if memory_gb is not None else free_memory_bytes(device) * mem_fraction
        return int(budget // kv_bytes_per_page(mc, page_size, dtype))
