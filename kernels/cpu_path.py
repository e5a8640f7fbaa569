"""Which path the CPU kernels take on this machine, and why: decided once, said in one log line.

The CPU's flags (``/proc/cpuinfo``) and what was built decide it (docs/kernel-api.md, "CPU paths"):

=================  ==========================================================================
path               when, and what runs
=================  ==========================================================================
``amx``            ``amx_bf16`` + ``amx_tile``: bfloat16 projections of prefill and extend on
                   oneDNN's AMX kernels (weights prepacked, QKV and gate/up fused); attention
                   and the small ops on the native AVX-512 build; bfloat16 decode GEMMs with
                   ``vdpbf16ps`` where the CPU has ``avx512_bf16`` too
``avx512_bf16``    ``avx512_bf16``: bfloat16 projections on oneDNN (its avx512_bf16 kernels),
                   the native AVX-512 build with bf16 dot products for decode GEMMs
``avx512``         ``avx512f``: the native AVX-512 build; bfloat16 is not native (converted)
``avx2``           ``avx2`` + ``fma``: the native build's AVX2 + FMA attention and packed GEMM
``plain``          none of those: the native build's plain loops
``torch``          no native kernels (``KVBUS_NATIVE=0``, ``KVBUS_KERNELS`` other than auto, a
                   build that failed): the torch references, whatever the flags
=================  ==========================================================================

bfloat16 is native on the first two (``--dtype auto`` serves it there: services/engine/dtypes.py).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from functools import lru_cache

log = logging.getLogger(__name__)

PATHS = ("amx", "avx512_bf16", "avx512", "avx2", "plain", "torch")


def cpu_flags() -> frozenset[str]:
    """This CPU's flags (/proc/cpuinfo), as the native build's key reads them."""
    from kernels import native

    return frozenset(native._cpu_flags().split())


def missing(flags: frozenset[str], *needed: str) -> list[str]:
    """The flags of ``needed`` this CPU lacks (for skip reasons and log lines)."""
    return [f for f in needed if f not in flags]


@dataclass(frozen=True)
class CpuPath:
    name: str
    """One of PATHS."""
    reason: str
    """Why, in one line: the flags that decided it and what runs."""
    onednn_bf16: bool
    """torch's oneDNN takes bfloat16 weights (prepacked bf16 projections; it needs avx512bw/vl/dq
    or avx_ne_convert): bf16 prefill projections go through oneDNN, with AMX where present."""
    native_isa: str | None
    """What the native build was compiled for (kvbus_cpu::isa()), None when it is not in use."""

    def log_line(self) -> str:
        return f"CPU path: {self.name} ({self.reason})"


def decide(flags: frozenset[str], *, native_isa: str | None, native_off: str | None, onednn_bf16: bool) -> CpuPath:
    """The path for a CPU with ``flags``, given what was built: ``native_isa`` is the native
    build's ``isa()`` (None: not in use, ``native_off`` says why). Pure: tests give it any CPU."""
    if "amx_bf16" in flags and "amx_tile" in flags:
        name = "amx"
        why = "amx_bf16 + amx_tile: bfloat16 prefill/extend projections on oneDNN's AMX kernels"
    elif "avx512_bf16" in flags:
        name, why = "avx512_bf16", "avx512_bf16: bfloat16 projections on oneDNN's avx512_bf16 kernels"
    elif "avx512f" in flags:
        name, why = "avx512", "avx512f, no amx_bf16 or avx512_bf16: bfloat16 not native"
    elif "avx2" in flags and "fma" in flags:
        name, why = "avx2", "avx2 + fma, no avx512f, no amx_bf16 or avx512_bf16: bfloat16 not native"
    else:
        lacking = missing(flags, "avx2", "fma")
        name, why = "plain", f"no {' or '.join(lacking) or 'avx2'}: plain loops, bfloat16 not native"
    if name in ("amx", "avx512_bf16") and not onednn_bf16:
        why += " (but this torch's oneDNN takes no bfloat16 weights: F.linear serves them)"
    elif name not in ("amx", "avx512_bf16"):
        why += "; bfloat16 projections on " + ("oneDNN" if onednn_bf16 else
                                                 "F.linear (oneDNN bf16 needs avx512bw+vl+dq or avx_ne_convert)")
    if native_isa is None:
        return CpuPath("torch", f"torch references: {native_off}; CPU {name}: {why}", onednn_bf16, None)
    built = native_isa.split("+")[0]
    if built != {"amx": "avx512", "avx512_bf16": "avx512"}.get(name, name):
        why += f"; NOTE: the native build is {native_isa}"  # a build made elsewhere (KVBUS_NATIVE_DIR shared)
    return CpuPath(name, f"{why}; native kernels built for {native_isa}", onednn_bf16, native_isa)


def onednn_takes_bf16() -> bool:
    """Whether torch's oneDNN can prepack and multiply bfloat16 weights on this CPU."""
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@lru_cache(maxsize=1)
def this_cpu() -> CpuPath:
    """This machine's path (the native build is loaded or built to know it), logged once."""
    from kernels import native
    from kernels._dispatch import backend_mode

    mode = backend_mode()
    ops = native.ops() if mode == "auto" else None
    off = native.unavailable_reason() if mode == "auto" else f"KVBUS_KERNELS={mode}"
    path = decide(cpu_flags(), native_isa=ops.isa() if ops is not None else None, native_off=off,
                  onednn_bf16=onednn_takes_bf16())
    log.info("%s", path.log_line())
    return path


DECIDING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def machine_summary() -> str:
    """The CPU's model and which of the deciding flags it has, for benchmark notes."""
    flags = cpu_flags()
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    has = [f for f in DECIDING_FLAGS if f in flags]
    lacks = [f for f in DECIDING_FLAGS if f not in flags]
    return f"{model}; has {' '.join(has) or 'none'}; lacks {' '.join(lacks) or 'none'}"
