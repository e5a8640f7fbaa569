"""Fuzz every public surface with many inputs and print the table (docs/reliability.md).

    python -m bench.fuzz                       # 10,000 inputs per surface (the documented figure)
    python -m bench.fuzz --examples 50         # a quick check
    python -m bench.fuzz --only "http POST"    # surfaces whose name contains this

The real services (tokenizer, router, an aggregated worker with the real engine, the gateway
with its HTTP port) run on the in-memory bus (tests/fuzzing.py); hypothesis draws
structure-aware inputs (valid-ish requests built from the schemas, any JSON value, garbage
bytes, oversized prompts). Unlike the CI test it does not stop at the first failure: it
counts every outcome (ok: a valid reply; refused: a typed error; crash: ``internal``, HTTP
500, an unparseable answer or a dead service; hang: no answer within --hang-timeout),
prints the first few crash and hang details, checks that every service still answers and
no KV page or request leaked, and exits 1 if anything crashed, hung or leaked.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _runner(surface, system, http, counts, failures, args):
    """One surface's hypothesis run: counts every outcome instead of stopping at the first failure."""
    from hypothesis import HealthCheck, given, seed, settings

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(surface.inputs)
    def one(raw):
        outcome, detail = surface.send(system, http, raw)
        counts[outcome] += 1
        if outcome in ("crash", "hang") and len(failures) < 20:
            failures.append(f"{surface.name}: {outcome}: {detail}\n    input: {raw!r}")

    return one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=10_000, help="inputs per surface")
    parser.add_argument("--only", default="", help="run the surfaces whose name contains this")
    parser.add_argument("--hang-timeout", type=float, default=60.0, help="seconds an answer may take")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same inputs for the same seed)")
    parser.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2-135M)")
    args = parser.parse_args(argv)

    import httpx

    from services.models import ensure_model, resolve_model
    from tests.fuzzing import SURFACES, FuzzSystem, tally

    model_dir = resolve_model(args.model) if args.model else ensure_model()
    surfaces = [s for s in SURFACES if args.only in s.name]
    system = FuzzSystem(model_dir, hang_timeout=args.hang_timeout).start()
    rows, failures = [], []
    try:
        with httpx.Client(base_url=system.http_url) as http:
            for surface in surfaces:
                counts = tally()
                t0 = time.monotonic()
                one = _runner(surface, system, http, counts, failures, args)
                one()
                seconds = time.monotonic() - t0
                rows.append((surface.name, sum(counts.values()), counts["ok"], counts["refused"], counts["crash"],
                             counts["hang"], seconds))
                print(f"{surface.name}: {dict(counts)} in {seconds:.0f}s", file=sys.stderr, flush=True)
        dead = system.alive()
        leaks = system.leaks()
    finally:
        system.stop()

    print(f"\nFuzzing, {args.examples} inputs asked per surface (hypothesis seed {args.seed}); the real services on the "
          "in-memory bus\n")
    print("| surface | inputs | valid replies | typed errors | crashes | hangs | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, ok, refused, crash, hang, seconds in rows:
        print(f"| {name} | {n} | {ok} | {refused} | {crash} | {hang} | {seconds:.0f} |")
    print(f"\nservices not answering health afterwards: {dead or 'none'}")
    print(f"leaks afterwards (engine requests, KV pages, gateway requests): {leaks or 'none'}")
    for failure in failures:
        print(failure)
    bad = any(r[4] or r[5] for r in rows) or dead or leaks
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
