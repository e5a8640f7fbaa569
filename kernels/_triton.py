"""Guarded Triton import shared by every kernel file.

`import kernels` must work where Triton is missing (CPU-only installs). Kernel files do
`from kernels._triton import HAS_TRITON, tl, triton`; without Triton, `triton.jit` is a no-op
decorator and `tl.constexpr` a placeholder, so the module still imports and the `@triton.jit`
functions simply can never be launched (launchers call `require_triton` first).
"""

from __future__ import annotations

import os

import torch

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    class _LanguageStub:
        constexpr = object()

    triton = _TritonStub()
    tl = _LanguageStub()


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton(*tensors: torch.Tensor) -> None:
    """Fail with a clear message when a Triton launch cannot work here."""
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed: install the 'triton' extra, or set KVBUS_KERNELS=torch"
        )
    for t in tensors:
        if t is not None and not t.is_cuda and not is_interpreter():
            raise RuntimeError(
                "Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                "(tests) or KVBUS_KERNELS=torch / unset it (references)"
            )

