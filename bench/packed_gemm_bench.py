"""The packed decode GEMM alone: all 121 projections of SmolLM2-135M, per row count.

    python -m bench.packed_gemm_bench                # 1, 2, 4, 6, 8, 10, 12, 16 rows (~1 min on 2 cores)
    python -m bench.packed_gemm_bench --rows 1 8 --reps 15
    python -m bench.packed_gemm_bench --rows 8 12 16 32 48 --onednn   # and oneDNN prepacked beside it
    python -m bench.packed_gemm_bench --dtype bfloat16 --onednn       # bf16 weights (vdpbf16ps)
    python -m bench.packed_gemm_bench --rows 1 8 --compare-pages      # and the weights on 4 KiB pages

Times one pass over every projection a decode step runs (30 layers x qkv, o, gate_up, down, and
the lm_head) with ``kvbus_cpu::packed_gemm``, the weights on huge pages in one mapping as the engine
holds them (services/engine/huge_pages.py; ``--compare-pages``: also on 4 KiB pages, the two passes
alternating), best of ``--reps``, and reports the weights' read rate
and the ratio to the bandwidth floor (the weights' bytes, 538 MB in float32 and half that in
bfloat16, over the read bandwidth measured in the same run). To compare two kernel builds, run it on each (the native build is keyed by the kernel
sources, so ``git stash`` of a kernel change reuses the cached earlier build) one after the other.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, read_bandwidth, table

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 10, 12, 16])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--onednn", action="store_true",
                    help="also time oneDNN with prepacked weights (what prefill and, before 2026-12-01, decode steps "
                         "of more than 12 rows used)")
    ap.add_argument("--compare-pages", action="store_true", help="also time the weights on 4 KiB pages")
    args = ap.parse_args()
    from kernels import native
    from services.engine.huge_pages import onto_huge_pages
    from services.engine.linear import PREFILL_ROWS, pack_columns, prepack

    if not native.available():
        raise SystemExit(f"native kernels: {native.unavailable_reason()}")
    ops = native.ops()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not ops.has_bf16_dot():
        raise SystemExit("this CPU (or build) has no avx512_bf16: bf16 decode runs on oneDNN")
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=g).to(dtype) for n, k in SHAPES]
    small_pages = [pack_columns(w) for w in plain]
    weights = onto_huge_pages(small_pages)
    dense = [prepack(w, PREFILL_ROWS) for w in plain] if args.onednn else []
    nbytes = sum(n * k * dtype.itemsize for n, k in SHAPES)
    bw = read_bandwidth(reps=3)
    floor = nbytes / bw
    print(machine())
    print(f"{args.dtype}: read bandwidth {bw / 1e9:.1f} GB/s; weights {nbytes / 1e6:.0f} MB; floor {floor * 1e3:.1f} ms")
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (576, 1536)}
        ys = [torch.empty(m, n, dtype=dtype) for n, _ in SHAPES]

        def packed_pass(ws=weights):
            for (n, k), w, y in zip(SHAPES, ws, ys):
                ops.packed_gemm(xs[k], w, None, y)

        def onednn_pass():
            for (n, k), w in zip(SHAPES, dense):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        if args.compare_pages:  # alternating, so both see the same phase of the machine
            best = small = float("inf")
            for _ in range(args.reps):
                best = min(best, best_of(packed_pass, 1))
                small = min(small, best_of(lambda: packed_pass(small_pages), 1))
        else:
            best = best_of(packed_pass, args.reps)
        row = [str(m), f"{best * 1e3:.1f}", f"{nbytes / best / 1e9:.1f}", f"{best / floor:.2f}x"]
        if args.compare_pages:
            row += [f"{small * 1e3:.1f}", f"{best / small:.2f}x"]
        if args.onednn:
            other = best_of(onednn_pass, args.reps)
            row += [f"{other * 1e3:.1f}", f"{best / other:.2f}x"]
        rows.append(row)
    head = ["rows", "all projections ms", "weights GB/s", "time / floor"]
    head += ["4 KiB pages ms", "huge / 4 KiB"] if args.compare_pages else []
    print(table(rows, head + (["oneDNN prepacked ms", "packed / oneDNN"] if args.onednn else [])))


def best_of(fn, reps: int) -> float:
    fn()  # first touch
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    main()
