"""Kernel test fixtures: backend selection and the gpu marker.

Triton tests run on CUDA when present, else on CPU under the Triton interpreter
(`TRITON_INTERPRET=1`, which must be set before Triton compiles the kernels, i.e. before
`kernels` is imported: set it on the command line). gpu-marked tests need CUDA.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _triton_runnable() -> str | None:
    """None if Triton kernels can run here, else the reason they cannot."""
    from kernels._triton import HAS_TRITON
    from kernels.activation import _silu_and_mul_kernel

    if not HAS_TRITON:
        return "triton is not installed"
    if HAS_CUDA:
        return None
    if type(_silu_and_mul_kernel).__name__ != "InterpretedFunction":
        return "no CUDA and the kernels were not built for the interpreter (run with TRITON_INTERPRET=1)"
    return None


@pytest.fixture
def device() -> str:
    """Where the small-shape Triton tests run: CUDA if present, else CPU (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def triton_backend():
    """Force the Triton launchers (interpreter on CPU)."""
    from kernels import set_backend

    reason = _triton_runnable()
    if reason:
        pytest.skip(reason)
    set_backend("triton")
    yield
    set_backend(None)


@pytest.fixture
def torch_backend():
    """Force the plain-torch references."""
    from kernels import set_backend

    set_backend("torch")
    yield
    set_backend(None)

