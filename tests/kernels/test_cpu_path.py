"""The CPU path: CPU flags -> which kernels run, said once at start-up; and the oneDNN kernel a
prepacked projection really runs on this CPU (read from oneDNN's own verbose log).

Tests of paths this CPU cannot run are skipped with the flag it lacks; the pure decision is
tested for every CPU kind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.cpu_path import cpu_flags, decide, missing, onednn_takes_bf16, this_cpu

ROOT = Path(__file__).resolve().parents[2]

SAPPHIRE_RAPIDS = frozenset("avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_tile amx_bf16 amx_int8".split())
ZEN4 = frozenset("avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16".split())
SKYLAKE_X = frozenset("avx2 fma avx512f avx512bw avx512vl avx512dq".split())
ZEN3 = frozenset("avx2 fma sse4_2".split())
OLD = frozenset("sse4_2 avx".split())


@pytest.mark.parametrize("flags,isa,onednn_bf16,path", [
    (SAPPHIRE_RAPIDS, "avx512+avx512_bf16", True, "amx"),
    (ZEN4, "avx512+avx512_bf16", True, "avx512_bf16"),
    (SKYLAKE_X, "avx512", True, "avx512"),
    (ZEN3, "avx2", False, "avx2"),
    (OLD, "plain", False, "plain"),
], ids=["sapphire-rapids", "zen4", "skylake-x", "zen3", "no-avx2"])
def test_each_cpu_kind_gets_its_path(flags, isa, onednn_bf16, path):
    chosen = decide(flags, native_isa=isa, native_off=None, onednn_bf16=onednn_bf16)
    assert chosen.name == path and chosen.native_isa == isa
    assert f"native kernels built for {isa}" in chosen.reason and "NOTE" not in chosen.reason
    if path == "amx":
        assert "amx_bf16 + amx_tile" in chosen.reason and "oneDNN's AMX kernels" in chosen.reason
    if path in ("avx512", "avx2", "plain"):
        assert "bfloat16 not native" in chosen.reason
    if path == "avx2":  # this session's Zen 3: oneDNN takes no bf16 weights, and the log says so
        assert "F.linear" in chosen.reason and "no avx512f" in chosen.reason


def test_without_native_kernels_the_path_is_the_torch_references():
    chosen = decide(SAPPHIRE_RAPIDS, native_isa=None, native_off="disabled by KVBUS_NATIVE=0", onednn_bf16=True)
    assert chosen.name == "torch" and chosen.native_isa is None
    assert chosen.reason.startswith("torch references: disabled by KVBUS_NATIVE=0; CPU amx")


def test_a_build_for_another_cpu_is_named():
    # a native folder shared between machines (KVBUS_NATIVE_DIR) with a build for another ISA
    chosen = decide(ZEN3, native_isa="avx512", native_off=None, onednn_bf16=False)
    assert chosen.name == "avx2" and "NOTE: the native build is avx512" in chosen.reason


def test_bf16_prefill_projections_go_to_onednn_where_it_takes_them():
    # on an AMX CPU the bf16 prefill projections must reach oneDNN (whose AMX kernels serve them);
    # where its reorder takes no bf16 weights they stay on F.linear (the reorder would raise)
    from services.engine.linear import prefill_kernel

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    amx = decide(SAPPHIRE_RAPIDS, native_isa="avx512+avx512_bf16", native_off=None, onednn_bf16=True)
    zen3 = decide(ZEN3, native_isa="avx2", native_off=None, onednn_bf16=False)
    assert prefill_kernel(torch.bfloat16, amx.onednn_bf16) == "onednn"
    assert prefill_kernel(torch.bfloat16, zen3.onednn_bf16) == "f_linear"
    assert prefill_kernel(torch.float32, zen3.onednn_bf16) == prefill_kernel(torch.float32, amx.onednn_bf16) == "onednn"
    assert prefill_kernel(torch.float16, amx.onednn_bf16) == "f_linear"


def test_this_machine_says_its_path_once(caplog):
    this_cpu.cache_clear()
    with caplog.at_level(logging.INFO, logger="kernels.cpu_path"):
        path = this_cpu()
        assert this_cpu() is path
    lines = [r.getMessage() for r in caplog.records if r.name == "kernels.cpu_path"]
    assert lines == [path.log_line()] and lines[0].startswith(f"CPU path: {path.name} (")
    flags = cpu_flags()
    assert path.onednn_bf16 == onednn_takes_bf16()
    if native.available():
        isa = native.ops().isa()
        assert path.native_isa == isa and path.name != "torch"
        # the build is -march=native: its ISA follows this CPU's flags
        want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "plain"
        assert isa.split("+")[0] == want
        assert ("+avx512_bf16" in isa) == ("avx512f" in flags and "avx512_bf16" in flags)
        assert path == decide(flags, native_isa=isa, native_off=None, onednn_bf16=path.onednn_bf16)
    else:
        assert path.name == "torch" and native.unavailable_reason() in path.reason


def _onednn_kernel(dtype: str) -> str:
    """The implementation oneDNN runs for a prepacked [96, 64] projection of 64 rows of ``dtype``."""
    code = textwrap.dedent(f"""
        import torch
        from services.engine.linear import PREFILL_ROWS, linear, prepack
        w = prepack(torch.randn(96, 64).to(torch.{dtype}), PREFILL_ROWS)
        linear(torch.randn(64, 64).to(torch.{dtype}), w)
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ONEDNN_VERBOSE": "1", "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    # onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx2,forward_inference,...
    kinds = [f.split(",") for f in res.stdout.splitlines() if ",primitive,exec,cpu," in f]
    impls = [f[6] for f in kinds if f[5] in ("inner_product", "matmul")]
    assert impls, res.stdout[-2000:]
    return impls[-1]


def test_float32_prefill_projections_run_on_onednn_for_this_cpu():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    flags = cpu_flags()
    impl = _onednn_kernel("float32")
    if "avx512f" in flags:
        assert "avx512_core" in impl, impl
    elif "avx2" in flags:
        assert "avx2" in impl, impl


@pytest.mark.skipif(bool(missing(cpu_flags(), "amx_bf16", "amx_tile")),
                    reason=f"needs {' and '.join(missing(cpu_flags(), 'amx_bf16', 'amx_tile')) or 'AMX'} (the AMX path)")
def test_bf16_prefill_projections_run_on_amx():
    assert onednn_takes_bf16()
    impl = _onednn_kernel("bfloat16")
    assert "amx" in impl, impl


@pytest.mark.skipif("avx512_bf16" not in cpu_flags() or "amx_bf16" in cpu_flags(),
                    reason="needs avx512_bf16 without AMX (the avx512_bf16 path)"
                    if "amx_bf16" in cpu_flags() else "needs avx512_bf16 (the avx512_bf16 path)")
def test_bf16_prefill_projections_run_on_avx512_bf16():
    assert onednn_takes_bf16()
    impl = _onednn_kernel("bfloat16")
    assert "avx512_core_bf16" in impl, impl


def test_bf16_weights_stay_on_f_linear_where_onednn_takes_none():
    from services.engine.linear import can_prepack, linear

    if onednn_takes_bf16():
        pytest.skip("this CPU's oneDNN takes bfloat16 weights (the F.linear fallback is for CPUs without "
                    "avx512bw/avx512vl/avx512dq and avx_ne_convert)")
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(33, 64, generator=g)
    got = linear(x.bfloat16(), w.bfloat16())  # what an unprepacked bf16 weight runs: F.linear
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.bfloat16().float() @ w.bfloat16().float().T, atol=0.05, rtol=0.02)
