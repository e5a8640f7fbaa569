"""Backend dispatch: device and KVBUS_KERNELS pick the launcher or the reference; Triton is
optional for `import kernels`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import activation

PUBLIC = [
    "store_kv", "paged_decode_attention", "paged_prefill_attention", "gather_pages", "scatter_pages",
    "rms_norm", "apply_rotary", "silu_and_mul", "quantize_fp8", "dequantize_fp8", "sample",
]


def test_every_contract_kernel_is_registered_with_both_paths():
    for name in PUBLIC:
        entry = kernels.KERNELS[name]
        assert callable(getattr(kernels, name))
        assert entry.reference.__name__.endswith("_ref")
        assert entry.launcher is not None and entry.launcher.__name__.endswith("_triton")


@pytest.fixture
def fresh_env(monkeypatch):
    """Make the next kernel call read KVBUS_KERNELS again, and forget it afterwards."""
    kernels.set_backend(None)
    yield monkeypatch
    monkeypatch.delenv("KVBUS_KERNELS", raising=False)
    kernels.set_backend(None)


def test_backend_follows_env_and_device(fresh_env):
    fresh_env.delenv("KVBUS_KERNELS", raising=False)
    assert kernels.backend_mode() == "auto"
    assert not kernels.use_triton(torch.zeros(1))
    for mode, expect in (("torch", False), ("triton", True)):
        fresh_env.setenv("KVBUS_KERNELS", mode)
        kernels.set_backend(None)
        assert kernels.backend_mode() == mode
        assert kernels.use_triton(torch.zeros(1)) is expect


def test_env_is_read_once(fresh_env):
    fresh_env.setenv("KVBUS_KERNELS", "torch")
    kernels.silu_and_mul(torch.zeros(2, 4))
    fresh_env.setenv("KVBUS_KERNELS", "triton")  # no effect until set_backend(None)
    assert kernels.backend_mode() == "torch"


def test_unknown_backend_fails_loudly(fresh_env):
    fresh_env.setenv("KVBUS_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVBUS_KERNELS"):
        kernels.silu_and_mul(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="KVBUS_KERNELS"):
        kernels.set_backend("gpu")


def test_forced_triton_runs_the_kernel(triton_backend, device, monkeypatch):
    calls = []
    real = activation._silu_and_mul_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(activation, "_silu_and_mul_kernel", Spy())
    kernels.silu_and_mul(torch.zeros(3, 8, device=device))
    assert len(calls) == 1
    kernels.set_backend("torch")
    kernels.silu_and_mul(torch.zeros(3, 8, device=device))
    assert len(calls) == 1


def test_import_without_triton():
    # `import kernels` must work where triton is missing; forcing Triton then says why it can't
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "y = kernels.silu_and_mul(torch.ones(2, 4))\n"
        "assert y.shape == (2, 2)\n"
        "kernels.set_backend('triton')\n"
        "try:\n"
        "    kernels.silu_and_mul(torch.ones(2, 4))\n"
        "except RuntimeError as exc:\n"
        "    assert 'not installed' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "KVBUS_KERNELS"}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_native_cpu_kernels_build_where_a_compiler_is():
    # a broken build would otherwise only show as skipped native tests and a slow engine
    import os
    import shutil

    from kernels import native

    if os.environ.get(native.ENV_ENABLE, "1") == "0" or shutil.which("g++") is None:
        pytest.skip("native kernels disabled or no C++ compiler")
    assert native.available(), native.unavailable_reason()


def test_auto_mode_runs_the_native_attention_on_cpu(monkeypatch):
    from kernels import KERNELS, attention_cpu, native, paged_decode_attention, set_backend

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    assert KERNELS["paged_decode_attention"].cpu is attention_cpu.paged_decode_attention_cpu
    calls = []
    real = native.ops().paged_attention

    class Spy:
        def paged_attention(self, *args):
            calls.append(len(args))
            return real(*args)

    monkeypatch.setattr(native, "ops", lambda: Spy())
    q = torch.randn(1, 2, 16)
    cache = torch.randn(4, 4, 1, 16)
    tables, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    set_backend("auto")
    try:
        paged_decode_attention(q, cache, cache, tables, lens, 0.25)
        assert calls, "auto mode on CPU did not reach the native op"
        calls.clear()
        set_backend("torch")  # the reference never touches it
        paged_decode_attention(q, cache, cache, tables, lens, 0.25)
        assert not calls
    finally:
        set_backend(None)
