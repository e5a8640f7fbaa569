"""Per-call time of every kernel at the default model's shapes (SmolLM2-135M: hidden 576,
9 q heads, 3 kv heads, head_dim 64, intermediate 1536, vocab 49152, page 16).

    python -m bench.kernels_bench [--iters 50] [--cases decode,sample]
    python -m bench.kernels_bench --cases prefill_attention --against ../kvbus-before --rounds 3

Always times the plain-torch references on CPU, and the native CPU kernels (kernels/cpu/, the
engine's CPU path where they exist, called 30 layers x every step) beside them with the ratio.
Where CUDA exists it also times the Triton launchers and the references on the GPU and prints
the ratio. Figures swing 20-30% between runs on shared machines.

``--against DIR`` measures a kernel change against the previous path: the CPU cases run in a child
process from each checkout in turn (DIR first, then this one, ``--rounds`` times; each checkout
has its own native build), and the table gives each case's native time in both and the ratio of
this checkout's to DIR's, the median of each round's own ratio with the rounds listed. The
reference's ratio, the same torch code in both, shows how far the machine's speed moved between
the two processes of a round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# NOTE: --against runs this file with another checkout's packages first on the path, so these
# imports name only what older checkouts have too.
from bench.common import machine, median, table
from kernels import KERNELS, rope_cos_sin_cache
from kernels.sampling import compute_logprobs

HIDDEN, NUM_Q, NUM_KV, HEAD_DIM, INTER, VOCAB, PAGE = 576, 9, 3, 64, 1536, 49152, 16


def _paged(device, seq_lens, dtype=torch.float32):
    pages = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages) + 8
    # engine layout [pages, layers, 2, page, Hkv, D] (2 layers here): strided per-layer caches
    pool = torch.randn(num_pages, 2, 2, PAGE, NUM_KV, HEAD_DIM, device=device).to(dtype)
    order = torch.randperm(num_pages).tolist()
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    return pool[:, 0, 0], pool[:, 0, 1], tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def cases(device):
    """name -> (kernel name or None, args) built on `device`."""
    f32 = dict(device=device, dtype=torch.float32)
    out = {}
    for t in (1, 8, 512):
        x = torch.randn(t, HIDDEN, **f32)
        out[f"rms_norm+residual T={t}"] = ("rms_norm", (x, torch.rand(HIDDEN, **f32), 1e-5, torch.randn_like(x)))
    cache = rope_cos_sin_cache(HEAD_DIM, 8192, 100000.0, device=device)
    for t in (8, 512):
        qkv = torch.randn(t, (NUM_Q + 2 * NUM_KV) * HEAD_DIM, **f32)
        q = qkv[:, : NUM_Q * HEAD_DIM].view(t, NUM_Q, HEAD_DIM)
        k = qkv[:, NUM_Q * HEAD_DIM : (NUM_Q + NUM_KV) * HEAD_DIM].view(t, NUM_KV, HEAD_DIM)
        out[f"apply_rotary T={t}"] = ("apply_rotary", (q, k, torch.randint(0, 8192, (t,), device=device), cache))
        out[f"silu_and_mul T={t}"] = ("silu_and_mul", (torch.randn(t, 2 * INTER, **f32),))
    for t in (8, 512):
        kc, vc, _, _ = _paged(device, [4096])
        kv = torch.randn(t, NUM_KV, HEAD_DIM, **f32)
        slots = torch.randperm(kc.shape[0] * PAGE, device=device)[:t]
        out[f"store_kv T={t}"] = ("store_kv", (kv, kv, kc, vc, slots))
    for batch, ctx in ((1, 128), (1, 512), (8, 512), (32, 1024)):
        lens = torch.randint(ctx // 2, ctx + 1, (batch,)).tolist() if batch > 1 else [ctx]
        kc, vc, bt, sl = _paged(device, lens)
        q = torch.randn(batch, NUM_Q, HEAD_DIM, **f32)
        out[f"decode_attention B={batch} ctx<={ctx}"] = (
            "paged_decode_attention", (q, kc, vc, bt, sl, HEAD_DIM**-0.5))
    for batch, ctx in ((4, 3000),):
        kc, vc, bt, sl = _paged(device, [ctx] * batch)
        q = torch.randn(batch, NUM_Q, HEAD_DIM, **f32)
        out[f"decode_attention B={batch} ctx={ctx}"] = (
            "paged_decode_attention", (q, kc, vc, bt, sl, HEAD_DIM**-0.5))
    for prefix, new in ((0, 512), (512, 128), (0, 1024), (3000, 500)):
        kc, vc, bt, sl = _paged(device, [prefix + new])
        q = torch.randn(new, NUM_Q, HEAD_DIM, **f32)
        cu = torch.tensor([0, new], dtype=torch.int32, device=device)
        out[f"prefill_attention prefix={prefix} new={new}"] = (
            "paged_prefill_attention", (q, kc, vc, bt, cu, sl, HEAD_DIM**-0.5))
    kc, _, _, _ = _paged(device, [4096])
    out["gather_pages N=32"] = ("gather_pages", (kc, torch.randperm(kc.shape[0], device=device)[:32]))
    # LM-like logits: Zipf(1.1) probabilities over a shuffled vocab (top-64 mass ~0.6)
    ranks = torch.stack([torch.randperm(VOCAB) for _ in range(8)]).float() + 1
    logits = (-1.1 * ranks.log() + 0.1 * torch.randn(8, VOCAB)).to(device)
    i32, i64 = dict(device=device, dtype=torch.int32), dict(device=device, dtype=torch.int64)

    def params(temperature, top_k, top_p, min_p, seed):
        return (torch.full((8,), temperature, **f32), torch.full((8,), top_k, **i32), torch.full((8,), top_p, **f32),
                torch.full((8,), min_p, **f32), torch.full((8,), seed, **i64), torch.zeros(8, **i64))

    out["sample B=8 greedy"] = ("sample", (logits, *params(0.0, 0, 1.0, 0.0, -1)))
    out["sample B=8 temperature only"] = ("sample", (logits, *params(0.8, 0, 1.0, 0.0, -1)))
    out["sample B=8 top_k=50"] = ("sample", (logits, *params(0.8, 50, 1.0, 0.0, -1)))
    out["sample B=8 top_p=0.9 seeded"] = ("sample", (logits, *params(0.8, 0, 0.9, 0.0, 1)))
    out["sample B=8 top_k=50 top_p=0.9 min_p=0.05"] = ("sample", (logits, *params(0.8, 50, 0.9, 0.05, -1)))
    out["compute_logprobs B=8 top 5"] = (None, (logits, torch.zeros(8, **i64), 5))
    return out


def native_ok(call_args) -> bool:
    """The native launcher serves these arguments (today every native kernel is attention)."""
    from kernels import attention_cpu

    return attention_cpu.can_run(*call_args[:2])


def time_call(fn, args, iters: int, device: str) -> float:
    """Median microseconds per call."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return median(samples)


def time_cpu(keep, iters: int) -> dict[str, tuple[float, float | None]]:
    """case -> (reference us, native us or None) on the CPU."""
    out = {}
    for name, (kernel, call_args) in cases("cpu").items():
        if keep(name):
            fn = KERNELS[kernel].reference if kernel else compute_logprobs
            ref_us = time_call(fn, call_args, iters, "cpu")
            native = KERNELS[kernel].cpu if kernel else None
            out[name] = (ref_us, time_call(native, call_args, iters, "cpu")
                         if native is not None and native_ok(call_args) else None)
    return out


def against_report(rounds: list[tuple[dict, dict]], before: str, after: str) -> str:
    """Per case: native us in ``before`` and ``after`` (medians over rounds), after / before as the
    median of each round's own ratio (rounds listed), and the reference's after / before."""
    def ratios(i: int, name: str) -> list[float]:
        return [a[name][i] / b[name][i] for b, a in rounds
                if name in a and name in b and a[name][i] is not None and b[name][i]]

    rows = []
    for name in dict.fromkeys(n for b, a in rounds for n in (*b, *a)):
        native = ratios(1, name)
        if not native:
            continue
        rows.append([name, f"{median([b[name][1] for b, _ in rounds if b.get(name, (0, None))[1]]):.1f}",
                     f"{median([a[name][1] for _, a in rounds if a.get(name, (0, None))[1]]):.1f}",
                     f"{median(native):.3f}x ({' '.join(f'{r:.2f}' for r in native)})",
                     f"{median(ratios(0, name)):.3f}x"])
    return table(rows, ["case", f"{before} native us", f"{after} native us", f"{after} / {before}",
                        "reference, same code"])


def run_against(args, checkout: Path) -> None:
    """Alternate child processes between ``checkout`` and this one; print :func:`against_report`."""
    from bench.common import against_label  # the parent's own: a child imports the other checkout's bench

    here = Path(__file__).resolve().parents[1]
    label = against_label(checkout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--iters", str(args.iters),
           "--cases", args.cases, "--threads", str(args.threads)]
    rounds = []
    for r in range(args.rounds):
        pair = []
        for root in (checkout, here):
            # this script, that checkout's kernels (and its native build): PYTHONPATH puts it first
            res = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                                 text=True)
            if res.returncode != 0:
                sys.exit(f"kernels bench in {root} failed:\n{res.stderr[-2000:]}")
            pair.append({k: tuple(v) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()})
        rounds.append(tuple(pair))
        print(f"# round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"# kernels bench, this checkout against {label}: {machine()}, {args.rounds} rounds\n")
    print(against_report(rounds, label, "this"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names to run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--against", type=Path, help="another checkout (e.g. a git worktree of an earlier commit): "
                                                     "its CPU kernels against this one's, alternating processes")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: processes per checkout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # --against's worker: JSON out
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [s for s in args.cases.split(",") if s]
    keep = lambda name: not wanted or any(w in name for w in wanted)  # noqa: E731
    if args.against is not None:
        return run_against(args, args.against.expanduser().resolve())
    if args.child:
        print(json.dumps(time_cpu(keep, args.iters)))
        return

    print(f"# kernels bench: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    rows = [[name, f"{ref_us:.1f}", *(("", "") if nat_us is None else (f"{nat_us:.1f}", f"{ref_us / nat_us:.2f}x"))]
            for name, (ref_us, nat_us) in time_cpu(keep, args.iters).items()]
    print("CPU, plain-torch references and native kernels (median us per call)\n")
    print(table(rows, ["case", "reference us", "native us", "speedup"]))

    if torch.cuda.is_available():
        rows = []
        for name, (kernel, call_args) in cases("cuda").items():
            if not keep(name) or kernel is None:
                continue
            entry = KERNELS[kernel]
            ref_us = time_call(entry.reference, call_args, args.iters, "cuda")
            tri_us = time_call(entry.launcher, call_args, args.iters, "cuda")
            rows.append([name, f"{ref_us:.1f}", f"{tri_us:.1f}", f"{ref_us / tri_us:.2f}x"])
        print(f"\nCUDA ({torch.cuda.get_device_name()}), median us per call\n")
        print(table(rows, ["case", "torch reference us", "triton us", "speedup"]))
    else:
        print("\n(no CUDA: Triton launchers not timed)")


if __name__ == "__main__":
    main()
