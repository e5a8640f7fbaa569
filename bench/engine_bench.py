"""The engine against transformers `generate` (fp32, batch 1) in the same process.

    python -m bench.engine_bench            # full run (~6 min on 2 cores)
    python -m bench.engine_bench --quick    # fewer repeats, 2 of the 8 HF requests

Rows:
  single-stream decode   ISL 128, OSL 64: output tokens/s after the first token
  8 concurrent           ISL 256, OSL 64, all 8 submitted at once: output tokens/s over
                         the whole run (prefill included); HF serves them one at a time
  prefill                ISL 1024, cold cache: prompt tokens/s (1024 / TTFT)
  cached-prefix TTFT     a 1024-token prefix already in the cache + 32 new tokens,
                         against the same prompt with a cold cache
  bf16 row               the single stream again with bf16 weights and KV cache (compared
                         with HF fp32: a speed path, its tokens are not HF-exact)
  step overhead          share of engine step time spent outside the model forward (scheduling,
                         inputs, sampling, outputs)
Prompts are random token ids (ignore_eos, so every request runs to OSL). Figures on
shared 2-core machines swing 20-30% between runs; compare columns of one run only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.common import machine, table
from schemas.engine import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class HF:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def generate(self, ids: list[int], n: int) -> float:
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
        return time.perf_counter() - t


def engine_run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], list[float]]:
    """Submit every prompt at once and step to the end: (wall, first-token times, last-token times)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - t0
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    ids = [f"bench-{i}" for i in range(len(prompts))]
    return time.perf_counter() - t0, [first[i] for i in ids], [last[i] for i in ids]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 HF requests for the concurrent row")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the single-stream and TTFT rows (best kept)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16-weights row")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    from services.engine import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=args.model, dtype="float32", kv_cache_memory=1.0,
                                    num_threads=args.threads, load_tokenizer=False))
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    vocab = engine.model_config.vocab_size
    hf = None if args.no_hf else HF(engine.model_dir)
    rows = []
    # warm both up (first calls allocate)
    engine_run(engine, [random_prompt(64, 99, vocab)], 4)
    if hf:
        hf.generate(random_prompt(64, 99, vocab), 4)

    # --- single stream: ISL 128, OSL 64
    p128 = random_prompt(128, 1, vocab)
    ours = []
    for _ in range(repeats):
        engine.block_manager.evict_all_cached()
        _, first, last = engine_run(engine, [p128], 64)
        ours.append(63 / (last[0] - first[0]))
    hf_tps = None
    if hf:
        tps = []
        for _ in range(repeats):
            ttft, total = hf.generate(p128, 1), hf.generate(p128, 64)
            tps.append(63 / (total - ttft))
        hf_tps = max(tps)
    rows.append(_row("single-stream decode tok/s (ISL 128)", hf_tps, max(ours), ">= 1.0x"))

    # --- 8 concurrent: ISL 256, OSL 64
    prompts = [random_prompt(256, 10 + i, vocab) for i in range(8)]
    engine.block_manager.evict_all_cached()
    s0 = _snap(engine)
    wall, _, _ = engine_run(engine, prompts, 64)
    conc_overhead = _overhead(engine, s0)
    hf_conc = None
    if hf:
        n = 2 if args.quick else 8
        hf_wall = sum(hf.generate(p, 64) for p in prompts[:n])
        hf_conc = 64 * n / hf_wall
    rows.append(_row("8 concurrent output tok/s (ISL 256, OSL 64)", hf_conc, 8 * 64 / wall, ">= 3x"))

    # --- prefill ISL 1024 and TTFT with a cached 1024-token prefix
    prefix = random_prompt(1024, 2, vocab)
    cold_ttft, warm_ttft = [], []
    for r in range(repeats):
        engine.block_manager.evict_all_cached()
        _, first, _ = engine_run(engine, [prefix + random_prompt(32, 100 + r, vocab)], 1)
        cold_ttft.append(first[0])
        _, first, _ = engine_run(engine, [prefix + random_prompt(32, 200 + r, vocab)], 1)
        warm_ttft.append(first[0])
    prefill_ttft = []
    for _ in range(repeats):
        engine.block_manager.evict_all_cached()
        _, first, _ = engine_run(engine, [prefix], 1)
        prefill_ttft.append(first[0])
    prefill_tps = 1024 / min(prefill_ttft)
    hf_prefill = hf_ttft = None
    if hf:
        hf_ttft = min(hf.generate(prefix + random_prompt(32, 100, vocab), 1) for _ in range(repeats))
        hf_prefill = 1024 / min(hf.generate(prefix, 1) for _ in range(repeats))
    rows.append(_row("prefill tok/s (ISL 1024)", hf_prefill, prefill_tps, "report"))
    rows.append(_row("TTFT s, 1024 cached + 32 new (HF: no reuse)", hf_ttft, min(warm_ttft), "", lower=True))
    rows.append(["TTFT cached / cold (same engine)", "", f"{min(warm_ttft):.3f} / {min(cold_ttft):.3f} s",
                 f"{min(warm_ttft) / min(cold_ttft):.3f}x", "<= 0.2x"])

    # --- the same single stream with bf16 weights and KV (a speed path, not HF-exact)
    if not args.no_bf16:
        bf16 = build_engine(EngineConfig(model=args.model, dtype="bfloat16", kv_cache_memory=0.5,
                                      num_threads=args.threads, load_tokenizer=False))
        engine_run(bf16, [random_prompt(64, 99, vocab)], 4)
        tps = []
        for _ in range(repeats):
            bf16.block_manager.evict_all_cached()
            _, first, last = engine_run(bf16, [p128], 64)
            tps.append(63 / (last[0] - first[0]))
        rows.append(_row("single-stream decode tok/s, bf16 weights+KV", hf_tps, max(tps), "info"))
        del bf16

    # --- per-step overhead, single stream and 8 concurrent
    engine.block_manager.evict_all_cached()
    s0 = _snap(engine)
    engine_run(engine, [p128], 64)
    single_overhead = _overhead(engine, s0)
    rows.append(["step overhead (outside model forward)", "",
                 f"{single_overhead:.1%} (1 req), {conc_overhead:.1%} (8 req)", "", "report"])

    print(f"engine bench: {machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, fp32, page 16, "
          f"{'quick' if args.quick else f'best of {repeats}'}")
    print(table(rows, ["metric", "transformers", "kvbus engine", "ratio", "goal"]))


def _row(name, hf_value, ours, goal, lower=False):
    if hf_value is None:
        return [name, "-", f"{ours:.3f}" if lower else f"{ours:.1f}", "-", goal]
    ratio = hf_value / ours if lower else ours / hf_value
    fmt = "{:.3f}" if lower else "{:.1f}"
    return [name, fmt.format(hf_value), fmt.format(ours), f"{ratio:.2f}x" + (" faster" if lower else ""), goal]


def _snap(engine):
    st = engine.stats
    return st.step_seconds, st.forward_seconds


def _overhead(engine, before) -> float:
    step = engine.stats.step_seconds - before[0]
    fwd = engine.stats.forward_seconds - before[1]
    return 1 - fwd / step if step else 0.0


if __name__ == "__main__":
    main()
