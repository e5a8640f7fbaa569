"""bench/peer_bench.py's runs per dtype and speculation, and their like-for-like ratios."""

from __future__ import annotations

import argparse

from bench.peer_bench import KvbusServer, VLLMServer, baseline, parse_name, ratio_pairs, variant_names


def test_every_system_runs_in_each_dtype_and_kvbus_with_and_without_speculation():
    assert variant_names("vllm", ["float32", "bfloat16"], ["on", "off"]) == ["vllm:fp32", "vllm:bf16"]
    assert variant_names("kvbus-1p1d", ["float32", "bfloat16"], ["on", "off"]) == [
        "kvbus-1p1d:fp32", "kvbus-1p1d:fp32:nospec", "kvbus-1p1d:bf16", "kvbus-1p1d:bf16:nospec"]
    assert variant_names("kvbus-aggregated", ["bfloat16"], ["off"]) == ["kvbus-aggregated:bf16:nospec"]
    assert parse_name("kvbus-1p1d:bf16:nospec@abc1234") == ("kvbus-1p1d", "bfloat16", False, "@abc1234")
    assert parse_name("kvbus-aggregated:fp32") == ("kvbus-aggregated", "float32", True, "")
    assert parse_name("vllm") == ("vllm", "float32", True, "")


def test_each_run_reads_against_vllm_in_its_own_dtype():
    names = ["vllm:fp32", "vllm:bf16", "kvbus-aggregated:fp32", "kvbus-aggregated:fp32:nospec",
             "kvbus-aggregated:bf16", "kvbus-aggregated:bf16:nospec"]
    assert baseline(names, "bfloat16") == "vllm:bf16" and baseline(names, "float32") == "vllm:fp32"
    assert ratio_pairs(names) == [  # vLLM's bf16 run is itself a baseline
        ("kvbus-aggregated:fp32", "vllm:fp32"), ("kvbus-aggregated:fp32:nospec", "vllm:fp32"),
        ("kvbus-aggregated:bf16", "vllm:bf16"), ("kvbus-aggregated:bf16:nospec", "vllm:bf16")]
    # without vLLM: the first run of the same dtype
    assert ratio_pairs(["kvbus-1p1d:fp32", "kvbus-1p1d:bf16", "kvbus-1p1d:bf16:nospec"]) == [
        ("kvbus-1p1d:bf16:nospec", "kvbus-1p1d:bf16")]


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"kv_cache_gb": 1.0, "start_timeout": 60.0, "kvbus_args": "", "against": None,
                                 "vllm_args": "", "threads_bind": "0-1", "vllm_preload": False, **kw})


def test_the_servers_are_started_with_the_runs_dtype_and_speculation(tmp_path):
    argv = KvbusServer("kvbus-aggregated:bf16:nospec", tmp_path, _args(), tmp_path).system.argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--speculative") + 1] == "off"
    argv = KvbusServer("kvbus-1p1d:fp32", tmp_path, _args(), tmp_path).system.argv
    assert argv[argv.index("--dtype") + 1] == "float32" and "--speculative" not in argv  # kvbus up's default
    vllm = VLLMServer(tmp_path / "python", tmp_path, _args(), tmp_path, "vllm:bf16")
    assert vllm.argv[vllm.argv.index("--dtype") + 1] == "bfloat16" and vllm.log_path.name == "vllm:bf16.log"
