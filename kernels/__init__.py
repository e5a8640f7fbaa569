"""Compute kernels shared by every engine service (contract: docs/kernel-api.md).

Each entry point dispatches on the device of its first tensor argument: CUDA -> the Triton
launcher, CPU -> the native CPU kernel where there is one (``kernels/cpu/``, built by
``kernels/native.py``), else the plain-torch reference.
`KVBUS_KERNELS=triton|torch|auto` overrides the choice (see kernels/_dispatch.py).
"""

from __future__ import annotations

from kernels import activation, attention_cpu, attention_decode, attention_prefill, fp8, norm, page_copy, paged_store
from kernels import layer_ops_cpu, rotary, sampling
from kernels._dispatch import KERNELS, backend_mode, register, set_backend, use_triton
from kernels._triton import HAS_TRITON
from kernels.fp8 import FP8_DTYPE, FP8_MAX, compute_fp8_scale
from kernels.rotary import rope_cos_sin_cache
from kernels.sampling import compute_logprobs, filter_logits, mix_seed


store_kv = register(
    "store_kv", paged_store.store_kv_ref, paged_store.store_kv_triton,
    cpu=layer_ops_cpu.store_kv_cpu, cpu_ok=layer_ops_cpu.store_kv_ok,
)
paged_decode_attention = register(
    "paged_decode_attention",
    attention_decode.paged_decode_attention_ref,
    attention_decode.paged_decode_attention_triton,
    cpu=attention_cpu.paged_decode_attention_cpu,
    cpu_ok=attention_cpu.can_run,
)
paged_prefill_attention = register(
    "paged_prefill_attention",
    attention_prefill.paged_prefill_attention_ref,
    attention_prefill.paged_prefill_attention_triton,
    cpu=attention_cpu.paged_prefill_attention_cpu,
    cpu_ok=attention_cpu.can_run,
)
gather_pages = register("gather_pages", page_copy.gather_pages_ref, page_copy.gather_pages_triton)
scatter_pages = register("scatter_pages", page_copy.scatter_pages_ref, page_copy.scatter_pages_triton)
rms_norm = register(
    "rms_norm", norm.rms_norm_ref, norm.rms_norm_triton,
    cpu=layer_ops_cpu.rms_norm_cpu, cpu_ok=layer_ops_cpu.rms_norm_ok,
)
apply_rotary = register(
    "apply_rotary", rotary.apply_rotary_ref, rotary.apply_rotary_triton,
    cpu=layer_ops_cpu.apply_rotary_cpu, cpu_ok=layer_ops_cpu.rotary_ok,
)
silu_and_mul = register(
    "silu_and_mul", activation.silu_and_mul_ref, activation.silu_and_mul_triton,
    cpu=layer_ops_cpu.silu_and_mul_cpu, cpu_ok=layer_ops_cpu.silu_and_mul_ok,
)
quantize_fp8 = register("quantize_fp8", fp8.quantize_fp8_ref, fp8.quantize_fp8_triton)
dequantize_fp8 = register("dequantize_fp8", fp8.dequantize_fp8_ref, fp8.dequantize_fp8_triton)
sample = register("sample", sampling.sample_ref, sampling.sample_triton)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "HAS_TRITON",
    "KERNELS",
    "apply_rotary",
    "backend_mode",
    "compute_fp8_scale",
    "compute_logprobs",
    "dequantize_fp8",
    "filter_logits",
    "gather_pages",
    "mix_seed",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_fp8",
    "rms_norm",
    "rope_cos_sin_cache",
    "sample",
    "scatter_pages",
    "set_backend",
    "silu_and_mul",
    "store_kv",
    "use_triton",
]
