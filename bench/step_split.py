"""Where a decode step's time goes, against the machine's memory-bandwidth floor.

    python -m bench.step_split                 # native CPU kernels, then the previous path, ~3 min
    python -m bench.step_split --no-baseline   # only the current path
    python -m bench.step_split --stack-vs-loop # the native decode stack against the per-op loop, ~1 min
    python -m bench.step_split --dtype bfloat16 --no-baseline   # bf16 weights and KV

For each batch (1 x 128, 8 x 256 and 4 x 3000 tokens of context) the in-process engine (fp32 unless
``--dtype bfloat16``, SmolLM2-135M) runs decode steps under torch's profiler; op times are grouped into weights (the
projections: kvbus_cpu::packed_gemm, oneDNN, MKL), attention (kvbus_cpu::paged_attention, or the
reference's gather/mask/bmm ops) and the rest. The floor is the bytes a step must read (every
weight once, plus the context's K and V once) over the read bandwidth measured here (a 1 GiB
sum on every core). The previous path is the same engine with ``KVBUS_NATIVE=0`` (oneDNN weights,
torch reference attention), run in a child process so the two never share a process.

``--stack-vs-loop``: the same engine and batches, decode steps alternating between the native
decode stack (every layer in one ``kvbus_cpu::decode_layers`` call) and the per-op loop it
replaced (8 rounds of 6 steps each way; medians), in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import read_bandwidth

CASES = [(1, 128), (8, 256), (4, 3000)]
WEIGHT_OPS = ("packed_gemm", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear")
NATIVE_ATTENTION = "kvbus_cpu::paged_attention"
ATTENTION_OPS = ("aten::index_select", "aten::masked_fill_", "aten::bmm", "aten::_softmax",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::copy_")


def measure(steps: int, dtype: str = "float32") -> dict:
    import torch
    from torch.profiler import profile

    from services.engine import EngineConfig, build_engine

    eng = build_engine(EngineConfig(kv_cache_memory=2.0, load_tokenizer=False, dtype=dtype))
    mc = eng.model_config
    itemsize = eng.kv_pool.data.dtype.itemsize
    weight_bytes = projection_bytes(mc, eng.model.w.embed.dtype.itemsize)
    kv_bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * itemsize
    gen = torch.Generator().manual_seed(0)
    out = {"bandwidth": read_bandwidth(), "weight_bytes": weight_bytes, "cases": []}
    for batch, ctx in CASES:
        ids = start_decoding(eng, batch, ctx, gen)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        with profile() as prof:
            for _ in range(5):
                eng.step()
        groups = {"weights": 0.0, "attention": 0.0}
        events = prof.key_averages()
        # the native op when it ran; else the reference's gather/mask/matmul ops (which also
        # count the embedding's index_select: a few hundred microseconds a step)
        attention_ops = (NATIVE_ATTENTION,) if any(NATIVE_ATTENTION in ev.key for ev in events) else ATTENTION_OPS
        for ev in events:
            t = ev.self_cpu_time_total / 5 / 1e6
            if any(k in ev.key for k in WEIGHT_OPS):
                groups["weights"] += t
            elif any(k in ev.key for k in attention_ops):
                groups["attention"] += t
        step = sorted(times)[len(times) // 2]
        groups["rest"] = max(0.0, step - groups["weights"] - groups["attention"])
        floor = (weight_bytes + batch * ctx * kv_bytes_per_token) / out["bandwidth"]
        out["cases"].append({"batch": batch, "context": ctx, "step_s": step, **groups, "floor_s": floor})
        for rid in ids:
            eng.abort(rid)
        eng.step()
    return out


def start_decoding(eng, batch: int, ctx: int, gen) -> list[str]:
    """``batch`` requests of ``ctx`` random prompt tokens, prefilled and a few steps into decoding."""
    import torch

    from schemas.engine import SamplingParams

    ids = [f"{batch}x{ctx}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(100, eng.model_config.vocab_size - 100, (ctx,), generator=gen).tolist()
        eng.add_request(rid, prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    while eng._mailbox or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng._seqs.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    return ids


def stack_vs_loop(rounds: int = 8, steps: int = 6) -> None:
    import statistics

    import torch

    from bench.common import machine, table
    from services.engine import EngineConfig, build_engine

    eng = build_engine(EngineConfig(kv_cache_memory=2.0, load_tokenizer=False))
    stack = eng.model.decode_stack()
    if stack is None:
        raise SystemExit("the native decode stack cannot serve this engine (native kernels not built?)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, ctx in CASES:
        ids = start_decoding(eng, batch, ctx, gen)
        medians = {True: [], False: []}
        for _ in range(rounds):
            for use_stack in (True, False):
                eng.model._stack = stack if use_stack else None
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - t0)
                medians[use_stack].append(statistics.median(times))
        eng.model._stack = stack
        a, b = statistics.median(medians[True]), statistics.median(medians[False])
        rows.append([f"{batch} x {ctx}", f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{a / b:.2f}x"])
        for rid in ids:
            eng.abort(rid)
        eng.step()
    print(f"machine: {machine()}")
    print(table(rows, ["batch x context", "stack step ms", "loop step ms", "stack / loop"]))


def projection_bytes(mc, itemsize: int = 4) -> int:
    """Bytes of every projection a decode step reads (qkv, o, gate_up, down, lm_head)."""
    h, d, i = mc.hidden_size, mc.head_dim, mc.intermediate_size
    per_layer = (mc.num_heads + 2 * mc.num_kv_heads) * d * h + h * mc.num_heads * d + 3 * i * h
    return itemsize * (mc.num_layers * per_layer + mc.vocab_size * h)


def child(baseline: bool, steps: int, dtype: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if baseline:
        env["KVBUS_NATIVE"] = "0"
    res = subprocess.run([sys.executable, "-m", "bench.step_split", "--child", "--steps", str(steps), "--dtype", dtype],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV cache (the engine's --dtype)")
    parser.add_argument("--stack-vs-loop", action="store_true",
                        help="the native decode stack against the per-op loop, alternating in one process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stack_vs_loop:
        stack_vs_loop()
        return
    if args.child:
        print(json.dumps(measure(args.steps, args.dtype)))
        return
    from bench.common import machine, table

    print(f"machine: {machine()}", flush=True)
    runs = {"native": child(False, args.steps, args.dtype)}
    if not args.no_baseline:
        runs["previous (KVBUS_NATIVE=0)"] = child(True, args.steps, args.dtype)
    native = runs["native"]
    print(f"{args.dtype}: read bandwidth {native['bandwidth'] / 1e9:.1f} GB/s; weights {native['weight_bytes'] / 1e6:.0f} MB")
    rows = []
    for i, case in enumerate(native["cases"]):
        label = f"{case['batch']} x {case['context']}"
        ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
        row = [label, ms(case["step_s"]), ms(case["weights"]), ms(case["attention"]), ms(case["rest"]),
               ms(case["floor_s"]), f"{case['step_s'] / case['floor_s']:.2f}x"]
        if len(runs) > 1:
            prev = runs["previous (KVBUS_NATIVE=0)"]["cases"][i]
            row += [ms(prev["step_s"]), f"{case['step_s'] / prev['step_s']:.2f}x"]
        rows.append(row)
    header = ["batch x context", "step ms", "weights ms", "attention ms", "rest ms", "floor ms", "step / floor"]
    if len(runs) > 1:
        header += ["previous step ms", "native / previous"]
    print(table(rows, header))


if __name__ == "__main__":
    main()
