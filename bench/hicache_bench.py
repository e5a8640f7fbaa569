"""HiCache: a multi-turn agent workload with L1 only, L1+L2 and no prefix cache, in one process.

    python -m bench.hicache_bench                 # full run: 8 users x 6 rounds (~4 min on 2 cores)
    python -m bench.hicache_bench --quick         # 3 users x 3 rounds, tiny turns (< 1 min): a check only
    python -m bench.hicache_bench --concurrent 3  # 3 conversations in flight at once (~4 min)

Workload: every user resends its whole history each round (previous prompt + answer + a new
message of --turn-tokens random tokens); users take turns (u0 r0, u1 r0, ..., u0 r1, ...). L1 is
sized to about two users' final history, so by the time a user comes back its pages left L1.
The kv_store core runs in this process (LocalLink), on the real shared-memory arena.

The modes run side by side, one engine each: every turn goes to all of them, one after the
other, in an order that rotates from turn to turn, and the decode-step comparison alternates steps
between its two engines. So a swing of the machine's speed (10-20% over minutes on the dev VM)
falls on every mode alike and the ratios are of work done at the same time.

Rows:
  TTFT p50, rounds >= 2      per mode; ratios L1+L2 / L1 only (goal <= 0.3) and / no prefix cache,
                             and L1+L2 / "l1+l2 pages" (its own L2, tails off: whole pages only,
                             the path before tails; block_manager.py)
  --compare-prefault         a fifth mode, "l1+l2 lazy": L2's memory neither committed by the store nor
                             mapped by the engine ahead (the path before prefault), and L1+L2 / it
  per round                  TTFT p50 per mode and round, the L1+L2 / L1 ratio, and the ratio of the
                             arithmetic the two turns do (the model's FLOPs for the rows each computes,
                             projections and attention): the ratio the tier would reach if a short
                             turn ran at the long recompute's FLOP rate, the floor of this workload
  hit rate                   cached prompt tokens / prompt tokens, and the part loaded from L2
  load-back vs prefill       seconds per token loaded back vs per token prefilled (goal >= 20x cheaper)
  decode step, write-back    mean decode step with write_through copies running vs no tier (goal <= 1.05x)
  1P1D bytes per turn        measured by python -m bench.disagg_turns_bench

--concurrent C: several agents at once. The same turns in the same order, but C of them in flight:
the next is added as soon as one finishes. L1 holds about C + 1 users' final KV (the C running and
one more). Loads of 8 pages or more now go to the copy thread while the other turns step, and
write-backs run beside batched forwards. Turns cannot be interleaved across engines here, so L1 only
and L1+L2 run one after the other, A B B A, each run on a fresh engine (and store). Rows: TTFT p50 of
rounds >= 2 per mode (a turn that arrives while others prefill waits for their step: TTFT counts
the batching too), the wall time of each run and their ratio, hit rates, the copy thread's loads.
Both modes must generate the same tokens in every run, or the bench fails.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from bench.common import machine, percentile, table
from schemas.engine import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_engine(model, kv_gb: float, hooks=None, prefix: bool = True, max_running: int = 8, tails: bool = True):
    from services.engine import EngineConfig, build_engine

    cfg = EngineConfig(model=model, kv_cache_memory=kv_gb, load_tokenizer=False, enable_prefix_caching=prefix,
                       max_running_requests=max_running, reuse_tail_pages=tails)
    return build_engine(cfg, tier_hooks=hooks)


def l1_size(args, page_bytes: int, users_worth: int) -> float:
    """GB of L1 holding about ``users_worth`` users' final KV."""
    final_len = args.rounds * (args.turn_tokens + args.max_tokens)
    return users_worth * (final_len // 16 + 2) * page_bytes / 1024**3


def make_tier(size_gb: float, owner: str, *, prefault: bool = True, write_policy: str = "write_back"):
    """An in-process kv_store core (the real shared-memory arena) and an engine's client for it."""
    from services.kv_store.client import HostTierClient
    from services.kv_store.config import KVStoreConfig
    from services.kv_store.links import LocalLink
    from services.kv_store.store import StoreCore

    core = StoreCore(KVStoreConfig(hicache_size=max(size_gb, 0.01), memory_reserve=0.5, hicache_prefault=prefault))
    return core, HostTierClient(LocalLink(core), owner=owner, write_policy=write_policy, prefault=prefault)


def wait_prefaulted(*tiers) -> None:
    """Join the tiers' prefault threads (started when an engine binds its client): the workload
    starts once L2 is committed and mapped, as a long-running one is, and nothing is timed beside them."""
    for core, client in tiers:
        for thread in (core.prefault_thread, client.prefault_thread):
            if thread is not None:
                thread.join()


def ttft(engine, prompt: list[int], max_tokens: int, rid: str) -> tuple[float, list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first, out, cached = None, [], (0, 0)
    while engine.has_unfinished():
        for o in engine.step():
            if first is None and o.new_token_ids:
                first = time.perf_counter() - t0
            out += o.new_token_ids
            if o.finished:
                cached = (o.usage.cached_tokens_device, o.usage.cached_tokens_host)
    return first, out, cached


def turn_flops(cfg, prompt_tokens: int, cached_tokens: int) -> float:
    """The model's arithmetic for a turn that computes ``prompt_tokens - cached_tokens`` rows over
    ``cached_tokens`` cached ones: every projection of every computed row, each row's attention
    over the keys before it (Q.K and P.V), and the last row's LM head."""
    n, h, d = prompt_tokens - cached_tokens, cfg.hidden_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    pairs = n * cached_tokens + n * (n + 1) / 2
    return 2 * n * per_layer * cfg.num_layers + 4 * pairs * cfg.num_heads * d * cfg.num_layers + 2 * h * cfg.vocab_size


def messages(vocab: int, users: int, rounds: int, turn: int, seed: int = 0) -> list[list[list[int]]]:
    """``[round][user]``: each turn's new message, random tokens drawn in turn order."""
    rng = random.Random(seed)
    return [[[rng.randrange(100, vocab - 100) for _ in range(turn)] for _ in range(users)] for _ in range(rounds)]


def agent_workload(engines: dict, users: int, rounds: int, turn: int, max_tokens: int, seed: int = 0) -> dict:
    """Every turn on every engine, in a rotating order; rows per engine name."""
    vocab = next(iter(engines.values())).model_config.vocab_size
    new = messages(vocab, users, rounds, turn, seed)
    names = list(engines)
    history = {name: [[] for _ in range(users)] for name in names}
    rows = {name: [] for name in names}  # (round, ttft, prompt tokens, cached tokens, of which from the host tier)
    k = 0
    for r in range(rounds):
        for u in range(users):
            message = new[r][u]
            for name in names[k % len(names):] + names[: k % len(names)]:
                h = history[name][u]
                h += message
                t, out, cached = ttft(engines[name], h, max_tokens, f"u{u}r{r}")
                rows[name].append((r, t, len(h), sum(cached), cached[1]))
                h += out
            k += 1
    return rows


def concurrent_workload(engine, new: list[list[list[int]]], concurrency: int, max_tokens: int):
    """The turns in the same order (u0 r0, u1 r0, ..., u0 r1, ...) on one engine, ``concurrency``
    of them in flight: the next is added as soon as one finishes (its user's turn before it has
    finished, as concurrency <= users). Returns the rows (round, ttft, prompt tokens, cached
    tokens, of which from the host tier), the wall seconds and every user's final history."""
    rounds, users = len(new), len(new[0])
    assert 1 <= concurrency <= users
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(users)]
    order = [(u, r) for r in range(rounds) for u in range(users)]
    in_flight: dict[str, dict] = {}
    rows, i = [], 0
    t_start = time.perf_counter()
    while i < len(order) or in_flight:
        while len(in_flight) < concurrency and i < len(order):
            u, r = order[i]
            i += 1
            prompt = history[u] + new[r][u]
            in_flight[f"u{u}r{r}"] = dict(u=u, r=r, prompt=prompt, t0=time.perf_counter(), ttft=None, out=[])
            engine.add_request(f"u{u}r{r}", prompt, params)
        for o in engine.step():
            turn = in_flight[o.request_id]
            if turn["ttft"] is None and o.new_token_ids:
                turn["ttft"] = time.perf_counter() - turn["t0"]
            turn["out"] += o.new_token_ids
            if o.finished:
                history[turn["u"]] = turn["prompt"] + turn["out"]
                rows.append((turn["r"], turn["ttft"], len(turn["prompt"]),
                             o.usage.cached_tokens_device + o.usage.cached_tokens_host, o.usage.cached_tokens_host))
                del in_flight[o.request_id]
    return rows, time.perf_counter() - t_start, history


def run_concurrent(args, model: str, vocab: int, page_bytes: int) -> None:
    """``--concurrent C``: L1 only and L1+L2 one after the other (a fresh engine and store each
    run), twice in the order A B B A, C conversations in flight at once."""
    c = args.concurrent
    l1_gb = l1_size(args, page_bytes, 1 + c)  # the C running plus one user's KV
    print(machine())
    print(f"{args.users} users x {args.rounds} rounds, {args.turn_tokens} new tokens a turn, {c} turns in flight, "
          f"L1 {l1_gb * 1024:.1f} MB")
    new = messages(vocab, args.users, args.rounds, args.turn_tokens)
    rows = {"l1": [], "l1+l2": []}
    walls = {"l1": [], "l1+l2": []}
    finals, loads = {}, []
    for mode in ("l1", "l1+l2", "l1+l2", "l1"):
        core, client = make_tier(l1_gb * args.users, "bench") if mode == "l1+l2" else (None, None)
        engine = make_engine(model, l1_gb, client)
        if core is not None:
            wait_prefaulted((core, client))
        got, wall, history = concurrent_workload(engine, new, c, args.max_tokens)
        if mode == "l1+l2":
            bm = engine.block_manager
            loads.append((bm.num_async_loads, bm.num_load_timeouts, client.stats["written_sync"],
                          client.stats["written_back"]))
            core.close()
        rows[mode] += got
        walls[mode].append(wall)
        assert finals.setdefault(mode, history) == history, f"{mode}: two runs of the same workload differ"
        del engine
    assert finals["l1"] == finals["l1+l2"], "L1 only and L1+L2 generated different tokens"
    later = {m: [r for r in rs if r[0] >= 1] for m, rs in rows.items()}
    p50 = {m: percentile([r[1] for r in rs], 50) for m, rs in later.items()}
    print(table([[m, f"{p50[m] * 1e3:.1f}", " / ".join(f"{w:.1f}" for w in walls[m]),
                  f"{sum(r[3] - r[4] for r in later[m]) / sum(r[2] for r in later[m]):.0%}",
                  f"{sum(r[4] for r in later[m]) / sum(r[2] for r in later[m]):.0%}"] for m in rows],
                ["mode", "TTFT p50 rounds>=2 (ms)", "wall s (runs)", "prompt tokens hit in L1", "hit in L2"]))
    print(f"TTFT p50 ratio L1+L2 / L1 only: {p50['l1+l2'] / p50['l1']:.3f}; "
          f"wall ratio: {sum(walls['l1+l2']) / sum(walls['l1']):.3f}")
    print("L1+L2 runs: " + "; ".join(f"{a} loads on the copy thread ({t} given up), {s} of {w} write-backs on the "
                                     f"engine thread (the pool ran dry)" for a, t, s, w in loads))
    print("every turn generated the same tokens in both modes and both runs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compare-prefault", action="store_true",
                    help='add a mode "l1+l2 lazy": L1+L2 with its arena neither committed nor mapped ahead')
    ap.add_argument("--concurrent", type=int, default=0, metavar="C",
                    help="instead: C turns in flight at once, L1 only and L1+L2 run one after the other (A B B A)")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.turn_tokens, args.max_tokens = 3, 3, 48, 4
    if not 0 <= args.concurrent <= args.users:
        ap.error(f"--concurrent must be between 1 and --users ({args.users})")
    from services.engine.kv_pool import kv_bytes_per_page
    from services.engine.model_config import ModelConfig
    from services.models import resolve_model

    model = str(resolve_model(args.model))
    mc = ModelConfig.from_dir(model)
    page_bytes = kv_bytes_per_page(mc, 16, torch.float32)
    if args.concurrent:
        run_concurrent(args, model, mc.vocab_size, page_bytes)
        return
    l1_gb = l1_size(args, page_bytes, 2)  # about two users' final KV
    print(machine())
    print(f"{args.users} users x {args.rounds} rounds, {args.turn_tokens} new tokens a turn, L1 {l1_gb * 1024:.1f} MB")

    tiered = ("l1+l2", "l1+l2 pages") + (("l1+l2 lazy",) if args.compare_prefault else ())
    tiers = {mode: make_tier(l1_gb * args.users, "bench", prefault=mode != "l1+l2 lazy") for mode in tiered}
    cores = {mode: core for mode, (core, _) in tiers.items()}
    clients = {mode: client for mode, (_, client) in tiers.items()}
    # "l1+l2 pages": the path before tails (whole pages only), for the tails' own ratio;
    # "l1+l2 lazy": L2's memory neither committed nor mapped ahead (the path before prefault)
    engines = {mode: make_engine(model, l1_gb, clients.get(mode), prefix=mode != "none", tails=mode != "l1+l2 pages")
               for mode in ("none", "l1", *tiered)}
    wait_prefaulted(*tiers.values())
    all_rows = agent_workload(engines, args.users, args.rounds, args.turn_tokens, args.max_tokens)
    results = {}
    for mode, rows in all_rows.items():
        later = [r for r in rows if r[0] >= 1]
        results[mode] = dict(
            p50=percentile([r[1] for r in later], 50),
            hit=sum(r[3] for r in later) / max(1, sum(r[2] for r in later)),
            hit_host=sum(r[4] for r in later) / max(1, sum(r[2] for r in later)),
            stats=dict(clients[mode].stats) if mode in clients else {},
            prefill_per_token=sum(r[1] for r in rows) / sum(r[2] - r[3] for r in rows),
        )
    cfg = engines["l1"].model_config
    round_rows = []
    for r in range(1, args.rounds):
        p50 = {m: percentile([row[1] for row in rows if row[0] == r], 50) for m, rows in all_rows.items()}
        work = {m: percentile([turn_flops(cfg, row[2], row[3]) for row in all_rows[m] if row[0] == r], 50)
                for m in ("l1", "l1+l2")}
        round_rows.append([str(r + 1), str(next(row[2] for row in all_rows["l1"] if row[0] == r)),
                           *(f"{p50[m] * 1e3:.1f}" for m in all_rows),
                           f"{p50['l1+l2'] / p50['l1']:.3f}", f"{work['l1+l2'] / work['l1']:.3f}"])
    later = {m: [row for row in rows if row[0] >= 1] for m, rows in all_rows.items()}
    rate = {m: sum(turn_flops(cfg, row[2], row[3]) for row in later[m]) / sum(row[1] for row in later[m])
            for m in ("l1", "l1+l2")}
    tails = engines["l1+l2"].block_manager.num_tail_hits, engines["l1+l2"].block_manager.num_tail_loads
    for core in cores.values():
        core.close()
    del engines
    l2 = results["l1+l2"]["stats"]
    loaded_tokens = sum(r[4] for r in all_rows["l1+l2"])  # (a tail page holds fewer than 16)
    print(table([[m, f"{r['p50'] * 1e3:.1f}", f"{r['hit'] - r['hit_host']:.0%}", f"{r['hit_host']:.0%}"]
                 for m, r in results.items()],
                ["mode", "TTFT p50 rounds>=2 (ms)", "prompt tokens hit in L1", "hit in L2/L3"]))
    print(f"TTFT ratio L1+L2 / L1 only: {results['l1+l2']['p50'] / results['l1']['p50']:.3f} (goal <= 0.3)")
    print(f"TTFT ratio L1+L2 / no prefix cache: {results['l1+l2']['p50'] / results['none']['p50']:.2f}")
    print(f"TTFT ratio L1+L2 / L1+L2 whole pages only (the path before tails): "
          f"{results['l1+l2']['p50'] / results['l1+l2 pages']['p50']:.3f}; tails reused from L1 {tails[0]}, "
          f"loaded from L2 {tails[1]}")
    print("per round (round 1 has no history; the ratio rows are p50 over the round's users):")
    print(table(round_rows, ["round", "prompt tokens", *(f"{m} ms" for m in all_rows), "L1+L2 / L1 TTFT",
                             "L1+L2 / L1 FLOPs"]))
    work = {m: percentile([turn_flops(cfg, row[2], row[3]) for row in later[m]], 50) for m in ("l1", "l1+l2")}
    print(f"FLOPs p50 of rounds >= 2, L1+L2 / L1 only: {work['l1+l2'] / work['l1']:.3f} "
          "(the TTFT ratio at equal FLOP rates)")
    print(f"FLOP rate over rounds >= 2: L1 only {rate['l1'] / 1e9:.0f} GFLOP/s, L1+L2 {rate['l1+l2'] / 1e9:.0f} "
          f"GFLOP/s ({rate['l1+l2'] / rate['l1']:.2f}x: a short turn's larger share of attention, load-back "
          f"and the per-step costs)")
    if "l1+l2 lazy" in results:
        print(f"TTFT ratio L1+L2 / L1+L2 with L2 neither committed nor mapped ahead: "
              f"{results['l1+l2']['p50'] / results['l1+l2 lazy']['p50']:.3f}")
    print(f"L1+L2 run: loaded back {loaded_tokens} tokens, written back {l2.get('written_back', 0)} pages "
          f"({l2.get('written_sync', 0)} at eviction), dropped {l2.get('dropped', 0)}")
    if loaded_tokens:
        lb = l2["load_back_seconds"] / loaded_tokens
        pf = results["none"]["prefill_per_token"]
        print(f"load-back {lb * 1e6:.1f} us/token vs prefill {pf * 1e6:.1f} us/token: {pf / lb:.0f}x cheaper (goal >= 20x)")

    # Decode steps with write-back copies running (write_through: a copy for every new page) vs no
    # tier, the two engines stepping in turn.
    core, client = make_tier(0.05 if args.quick else 0.5, "bench-decode", write_policy="write_through")
    engines = {"none": make_engine(model, l1_gb * 2), "write-back": make_engine(model, l1_gb * 2, client)}
    wait_prefaulted((core, client))
    n = 8 if args.quick else 64
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    times = {mode: [] for mode in engines}
    for mode, engine in engines.items():
        rng = random.Random(1)
        for i in range(4):
            engine.add_request(f"d{i}", [rng.randrange(100, 20000) for _ in range(40)], params)
    while any(e.has_unfinished() for e in engines.values()):
        for mode, engine in engines.items():
            if engine.has_unfinished():
                t = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - t)
    steps = {mode: percentile(ts[2:], 50) for mode, ts in times.items()}
    core.close()
    print(f"decode step p50: {steps['none'] * 1e3:.1f} ms without a tier, {steps['write-back'] * 1e3:.1f} ms with "
          f"write-through copies: {steps['write-back'] / steps['none']:.3f}x (goal <= 1.05x)")
    print("1P1D KV bytes per turn: python -m bench.disagg_turns_bench")


if __name__ == "__main__":
    main()
