"""Native CPU decode attention over a whole model's KV: ms per step and GB/s against the read bandwidth.

    python -m bench.decode_attention_bench                        # 4 x 3000, 8 x 1000, 1 x 3000, fp32
    python -m bench.decode_attention_bench --cases 4x3000 --dtype bfloat16
    python -m bench.decode_attention_bench --against ../old-checkout --rounds 3
    python -m bench.decode_attention_bench --compare-pages --rounds 3   # huge pages against 4 KiB

A step is what the engine's decode attention does for one token of every sequence: 30 layers of
the default model's shapes (9 q heads, 3 kv heads, head_dim 64, page 16) over one pool in the
engine's layout ([pages, layers, 2, page, Hkv, D], pages handed out in a random order) and, as the
engine allocates it by default, on 4 KiB pages (``--pages huge``: on transparent huge pages, as
with ``kv_huge_pages``), each layer read once: cold, from DRAM, as in serving. ``--hot`` reads layer 0 every time instead (the
compute-bound rate, the data in cache). GB/s counts the K and V bytes read.

``--against DIR``: the same cases on another checkout's kernels (its own native build), in
alternating child processes, ``--rounds`` times each; the table gives both and the ratio of medians.
Only such same-run ratios are facts on a shared machine; absolute times swing 10-20%.
``--compare-pages``: this checkout alternately with the pool on huge pages and on 4 KiB pages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, median, read_bandwidth, table

LAYERS, PAGE, NUM_KV, NUM_Q, HEAD_DIM = 30, 16, 3, 9, 64
ROOT = Path(__file__).resolve().parent.parent  # this checkout


def step_times(batch: int, ctx: int, dtype: str, hot: bool, steps: int, pages_kind: str = "4k") -> list[float]:
    import torch

    from kernels.attention_cpu import paged_decode_attention_cpu
    from services.engine.huge_pages import huge_page_empty

    gen = torch.Generator().manual_seed(0)
    pages = -(-ctx // PAGE)
    num_pages = batch * pages + 16
    shape = (num_pages, LAYERS, 2, PAGE, NUM_KV, HEAD_DIM)
    pool = huge_page_empty(shape, getattr(torch, dtype), huge=pages_kind == "huge")  # a mapping of its own, as the engine's
    pool.copy_(torch.randn(shape, generator=gen))
    tables = torch.randperm(num_pages, generator=gen)[: batch * pages].view(batch, pages).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, NUM_Q, HEAD_DIM, generator=gen).to(pool.dtype)

    def step():
        for layer in range(LAYERS):
            li = 0 if hot else layer
            paged_decode_attention_cpu(q, pool[:, li, 0], pool[:, li, 1], tables, lens, HEAD_DIM ** -0.5)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def child(args) -> None:
    out = {}
    for case in args.cases:
        batch, ctx = (int(x) for x in case.split("x"))
        out[case] = median(step_times(batch, ctx, args.dtype, args.hot, args.steps, args.pages))
    print(json.dumps(out))


def run_in(checkout: Path, args, pages: str) -> dict[str, float]:
    # this file runs, importing the kernels (and their native build) of `checkout`
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--dtype", args.dtype, "--pages", pages,
           "--steps", str(args.steps), "--cases", *args.cases] + (["--hot"] if args.hot else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(ROOT)]))
    res = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"decode attention in {checkout} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["4x3000", "8x1000", "1x3000"], help="BATCHxCONTEXT")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--hot", action="store_true", help="read layer 0 every time (data in cache)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--pages", choices=("huge", "4k"), default="4k", help="what backs the pool")
    parser.add_argument("--against", type=Path, help="another checkout whose kernels run alternately")
    parser.add_argument("--compare-pages", action="store_true",
                        help="alternate the pool on huge pages (this) and on 4 KiB pages (against)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.against and args.compare_pages:
        parser.error("--against and --compare-pages are two different comparisons: give one")
    this, against = (("huge", "4k") if args.compare_pages else (args.pages, args.pages))
    other = ROOT if args.compare_pages else args.against
    runs: dict[str, list[dict[str, float]]] = {"this": [], "against": []}
    for r in range(args.rounds if other else 1):
        print(f"[decode-attention] round {r + 1}: this checkout, {this} pages", file=sys.stderr, flush=True)
        runs["this"].append(run_in(ROOT, args, this))
        if other:
            print(f"[decode-attention] round {r + 1}: {other}, {against} pages", file=sys.stderr, flush=True)
            runs["against"].append(run_in(other.resolve(), args, against))
    bw = read_bandwidth()
    itemsize = 4 if args.dtype == "float32" else 2
    rows = []
    for case in args.cases:
        batch, ctx = (int(x) for x in case.split("x"))
        nbytes = batch * ctx * LAYERS * 2 * NUM_KV * HEAD_DIM * itemsize
        t = median([run[case] for run in runs["this"]])
        row = [case, f"{t * 1e3:.1f}", f"{nbytes / t / 1e9:.1f}", f"{nbytes / bw * 1e3:.1f}", f"{t / (nbytes / bw):.2f}x"]
        if other:
            a = median([run[case] for run in runs["against"]])
            row += [f"{a * 1e3:.1f}", f"{t / a:.2f}x"]
        rows.append(row)
    header = ["batch x context", "step ms", "GB/s", "floor ms", "step / floor"]
    if other:
        header += ["4k pages ms" if args.compare_pages else "against ms", "this / against"]
    print(f"machine: {machine()}; read bandwidth {bw / 1e9:.1f} GB/s; {args.dtype} KV on {this} pages, "
          f"{'hot (layer 0 repeated)' if args.hot else 'cold (30 layers)'}")
    print("command: python -m bench.decode_attention_bench " + " ".join(sys.argv[1:]))
    print(table(rows, header))


if __name__ == "__main__":
    main()
