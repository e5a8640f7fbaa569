"""The engine's configuration: one frozen dataclass, checked on construction.

Every field has a simple type and an attribute docstring, so the service CLI
(``services.config.add_arguments``) and ``KVBUS_*`` environment variables are
generated from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.config import ConfigError, plugin
from services.engine.load_back import ASYNC_LOAD_MIN_PAGES, LOAD_TIMEOUT_S

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Local Hugging Face model folder; None serves the default SmolLM2-135M-Instruct."""

    device: str = "cpu"
    """Torch device: cpu (torch reference kernels) or cuda / cuda:N (Triton kernels)."""

    dtype: str = "auto"
    """Weights and activations: auto (bfloat16 where the device computes it natively: a CPU with
    amx_bf16 or avx512_bf16, a CUDA device with bf16; else float32; services/engine/dtypes.py),
    float32, bfloat16 or float16."""

    kv_cache_dtype: str = "auto"
    """KV cache element type: auto (= dtype), float32, bfloat16, float16 or fp8_e4m3."""

    kv_fp8_scale: float = 1.0
    """fp8_e4m3 KV caches only: per-tensor scale (stored = k / scale), same for every layer."""

    kv_cache_memory: float | None = None
    """KV pool size in GB; None sizes it from mem_fraction."""

    mem_fraction: float | None = None
    """Share of the memory free after loading weights given to the KV pool (CPU: MemAvailable); None: 0.25 on cpu, 0.85 on cuda."""

    kv_prefault: bool = False
    """CPU: map every page of the KV pool when the engine starts (~0.2 s a GB on the 2-core dev
    VM; the whole pool's RAM is committed then), so that no step waits on the kernel for a page it
    writes the first time. Off by default: served single-stream decode measured 1.11x slower with
    it on the dev VM (docs/engine.md, "Pages"). False: pages are mapped as first written, and an
    idle pool costs no RAM."""

    kv_huge_pages: bool = False
    """CPU: back the KV pool with transparent huge pages. Decode attention reads its K and V in
    0.69-0.82x the time on them (2-core dev VM), but there a huge page mapped the first time costs
    ~5 ms (2.5 s a GB, against 0.2 s for 4 KiB pages: the VM's balloon hands freed memory back to
    its host), paid as requests first write them (the agentic replay ran 1.05x slower), or with
    ``kv_prefault`` at start. Worth it on a host where a fresh huge page costs what zeroing it does."""

    page_size: int = 16
    """Tokens per KV page: the unit of allocation, prefix caching, tiering and transfer."""

    max_model_len: int | None = None
    """Longest prompt plus output; None: the model's limit."""

    max_running_requests: int = 64
    """Most requests admitted (holding KV pages) at once; the rest wait."""

    max_prefill_tokens: int = 2048
    """Most prompt tokens computed in one step, over all requests."""

    chunked_prefill_size: int = 2048
    """Most prompt tokens of one request computed in one step; 0 computes a prompt in one step.
    The default equals max_prefill_tokens, so the budget goes to waiting prompts first come, first
    served (the oldest finishes first, as in vLLM's scheduler) rather than 512 tokens to each."""

    enable_mixed_batches: bool = True
    """Run decode tokens and prefill chunks in the same forward pass (else prefill steps pause decoding)."""

    enable_prefix_caching: bool = True
    """Reuse the KV pages of earlier requests that share a prompt prefix."""

    reuse_tail_pages: bool = True
    """Prefix caching to the token: keep the computed part of a finished request's last, partial
    page (a tail) and reuse it when a later prompt continues that request (the next chat turn)."""

    async_load_min_pages: int = ASYNC_LOAD_MIN_PAGES
    """With a lower cache tier (HiCache): fewest pages of a prefix hit loaded on the copy thread while
    other requests keep stepping; a shorter run is copied at admission, on the engine thread."""

    load_back_timeout: float = LOAD_TIMEOUT_S
    """With a lower cache tier: seconds a load on the copy thread may take before its request computes
    those pages instead (the late copy's pages are freed when it lands; nothing it brings is used)."""

    cache_salt: str = ""
    """Salt of the chained page hashes (model / tenant namespace); peers sharing pages must agree."""

    prepack_weights: bool = True
    """CPU, float32/bfloat16: reorder projection weights for oneDNN once at load (faster decode; float32 differs from F.linear in the last bits)."""

    num_threads: int = 0
    """CPU threads for torch; 0 uses every core."""

    core_lease: str = ""
    """PATH:SLOT of a lease file shared with the other engines of this host: steps take turns, each with every core (kvbus up sets it on small hosts; "" off)."""

    seed: int = 0
    """Seed of the RNG used by requests that bring no seed of their own."""

    load_tokenizer: bool = True
    """Load the model's tokenizer for text prompts, streamed text and stop strings."""

    speculative_method: str | None = plugin("services.draft.base:DRAFTERS", None)
    """Speculative decoding's drafter, by name (services.draft.base.DRAFTERS: ngram, prompt lookup;
    model, a small draft model); None: off."""

    speculative_greedy_only: bool = False
    """With speculative_method: draft only for greedy requests (temperature 0), whose output is the
    same token for token with or without speculation; sampled requests then decode plainly, so a
    seeded request's output never depends on whether speculation ran (it pauses under load)."""

    num_speculative_tokens: int = 4
    """Most tokens drafted per sequence and step; adaptive k drafts fewer when acceptance is low."""

    draft_model: str | None = None
    """speculative_method=model: local HF folder of a small model sharing the target's tokenizer."""

    ngram_min: int = 2
    """speculative_method=ngram: shortest context tail looked up in the request's tokens."""

    ngram_max: int = 4
    """speculative_method=ngram: longest context tail looked up in the request's tokens."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ConfigError(f"EngineConfig.{field}: {why}, got {getattr(self, field)!r}")

        if not (self.device == "cpu" or self.device.split(":")[0] == "cuda"):
            bad("device", "must be cpu, cuda or cuda:N")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if not self.kv_fp8_scale > 0:
            bad("kv_fp8_scale", "must be > 0")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            bad("kv_cache_memory", "must be > 0 GB")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            bad("mem_fraction", "must be in (0, 1]")
        if not 1 <= self.page_size <= 1024:
            bad("page_size", "must be in [1, 1024]")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.max_running_requests < 1:
            bad("max_running_requests", "must be >= 1")
        if self.max_prefill_tokens < 1:
            bad("max_prefill_tokens", "must be >= 1")
        if self.async_load_min_pages < 1:
            bad("async_load_min_pages", "must be >= 1")
        if not self.load_back_timeout > 0:
            bad("load_back_timeout", "must be > 0 s")
        if self.chunked_prefill_size < 0:
            bad("chunked_prefill_size", "must be >= 0 (0 = no chunking)")
        if self.num_threads < 0:
            bad("num_threads", "must be >= 0")
        if self.core_lease:
            from services.engine.core_lease import parse_spec

            try:
                parse_spec(self.core_lease)
            except ValueError as e:
                bad("core_lease", str(e))
        if not 1 <= self.num_speculative_tokens <= 16:
            bad("num_speculative_tokens", "must be in [1, 16]")
        from services.draft.base import speculative_method_problem  # the drafter registry says

        problem = speculative_method_problem(self)
        if problem is not None:
            bad(*problem)

    @property
    def effective_mem_fraction(self) -> float:
        if self.mem_fraction is not None:
            return self.mem_fraction
        return 0.25 if self.device == "cpu" else 0.85

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
