"""``--dtype auto``: bfloat16 where the device computes it natively, float32 elsewhere.

A CPU computes bfloat16 natively when it has AMX (``amx_bf16``: Intel Sapphire Rapids and later)
or AVX-512 bf16 dot products (``avx512_bf16``: Cooper Lake, AMD Zen 4 and later); there oneDNN
runs bfloat16 projections on those units at 2-7x the float32 rate, and the KV cache is half the
bytes. Elsewhere (AVX2, or AVX-512 without bf16) every bfloat16 product is converted to float32
first, so bfloat16 only adds work: auto serves float32 (docs/benchmarks.md measures the cost).
A CUDA device serves bfloat16 where it supports it. The checkpoint's own dtype does not decide.

vLLM's CPU backend (0.32) resolves its ``auto`` otherwise: a float32 checkpoint runs in bfloat16
on every x86 CPU, native or not; peer benchmarks therefore pin both servers' dtypes.

Light on purpose (no torch import for a CPU): ``kvbus up`` prints the choice before it starts any
engine, and the engine logs the same decision.
"""

from __future__ import annotations

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""Either one in /proc/cpuinfo makes bfloat16 native on a CPU."""


def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none). kernels/native.py reads
    the same line for its build key; this copy keeps ``kvbus up`` free of torch."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(requested: str, device: str = "cpu", *, flags: frozenset[str] | None = None,
                  cuda_bf16: bool | None = None) -> tuple[str, str]:
    """(dtype, why) for ``requested`` (a name of config.DTYPES) on ``device``. ``flags`` and
    ``cuda_bf16`` default to this machine's (tests pass other machines')."""
    if requested != "auto":
        return requested, "--dtype " + requested
    if device.split(":")[0] == "cuda":
        if cuda_bf16 is None:
            import torch

            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ("bfloat16", "auto: the CUDA device supports bfloat16") if cuda_bf16 else \
            ("float32", "auto: the CUDA device has no bfloat16")
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return "bfloat16", f"auto: the CPU computes bfloat16 natively ({', '.join(have)})"
    return "float32", "auto: the CPU has neither amx_bf16 nor avx512_bf16, so bfloat16 is not native here"
