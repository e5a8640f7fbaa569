"""Overload: many concurrent HTTP clients against one small engine; every request must be answered.

    python -m bench.overload                                   # 200 clients vs --max-running-requests 16
    python -m bench.overload --clients 20 --max-running 2 --max-tokens 8 --compare   # tiny check, < 1 min

Starts `kvbus up --aggregated` (services.local_system), fires ``--clients`` completions at
once (each with a client-side deadline ``--deadline`` seconds), and reports what each got:
200, or 429/503 with a Retry-After header, and how long it took; "silent" counts requests that
hit the client's deadline with no answer (must be 0). After the run it checks every engine
worker for leaked KV pages. With ``--compare`` the same load runs a second time against the
previous admission (count bound only: --max-queue-wait huge, --max-queue 1000, as before the
expected-wait bound) and the table shows both with ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from bench.common import machine, percentile, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def fire(http_url: str, clients: int, max_tokens: int, deadline: float) -> list[tuple[str, float, bool]]:
    import httpx

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, float, bool]:
        t0 = time.monotonic()
        try:
            r = await http.post("/v1/completions", json={"prompt": f"Request {i}: tell me a story about rivers.",
                                                         "max_tokens": max_tokens, "temperature": 0,
                                                         "ignore_eos": True})
            return str(r.status_code), time.monotonic() - t0, "retry-after" in r.headers
        except httpx.TimeoutException:
            return "silent", time.monotonic() - t0, False

    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    async with httpx.AsyncClient(base_url=http_url, timeout=deadline, limits=limits) as http:
        return list(await asyncio.gather(*(one(http, i) for i in range(clients))))


async def leaked_pages(nats_url: str) -> int:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import WORKER_HEALTH
    from schemas.common import HealthRequest

    bus = await connect(BusConfig(nats_url=nats_url))
    try:
        for _ in range(100):  # wait (on the condition) for aborted work to settle
            d = (await bus.request(WORKER_HEALTH, HealthRequest(), role="worker", worker_id="worker-0")).detail
            leaked = int(d["total_pages"]) - int(d["free_pages"])
            if leaked == 0 and d["running"] == "0" and d["waiting"] == "0":
                return 0
            await asyncio.sleep(0.2)
        return leaked
    finally:
        await bus.close()


def run(label: str, engine_args: str, args) -> dict:
    from services.local_system import LocalSystem

    with LocalSystem("--aggregated", "--engine-args", engine_args, "--quiet") as system:
        t0 = time.monotonic()
        results = asyncio.run(fire(system.http_url, args.clients, args.max_tokens, args.deadline))
        wall = time.monotonic() - t0
        leaked = asyncio.run(leaked_pages(system.nats_url))
    by_status: dict[str, list[float]] = {}
    for status, took, _ in results:
        by_status.setdefault(status, []).append(took)
    refused = [r for r in results if r[0] in ("429", "503")]
    return {"label": label, "by_status": by_status, "wall": wall, "leaked": leaked,
            "refused_with_retry_after": sum(1 for r in refused if r[2]), "num_refused": len(refused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--deadline", type=float, default=120.0, help="client-side seconds per request")
    parser.add_argument("--max-queue-wait", type=float, default=30.0)
    parser.add_argument("--compare", action="store_true", help="also run the count-bound-only admission")
    args = parser.parse_args()
    print(f"# overload: {args.clients} clients, max_tokens {args.max_tokens}, --max-running-requests "
          f"{args.max_running}, client deadline {args.deadline:g}s; {machine()}")
    runs = [run("expected-wait admission",
                f"--max-running-requests {args.max_running} --max-queue-wait {args.max_queue_wait}", args)]
    if args.compare:
        runs.append(run("count bound only (before)",
                        f"--max-running-requests {args.max_running} --max-queue 1000 --max-queue-wait 1e9", args))
    rows = []
    for r in runs:
        for status, times in sorted(r["by_status"].items()):
            rows.append([r["label"], status, str(len(times)), f"{percentile(times, 50):.2f}",
                         f"{percentile(times, 99):.2f}", f"{max(times):.2f}"])
        rows.append([r["label"], "refused with Retry-After", f"{r['refused_with_retry_after']}/{r['num_refused']}",
                     "", "", ""])
        rows.append([r["label"], "pages leaked", str(r["leaked"]), "", "", f"wall {r['wall']:.1f}s"])
    print(table(rows, ["admission", "status", "requests", "p50 s", "p99 s", "max s"]))
    if len(runs) == 2:
        silent = [len(r["by_status"].get("silent", [])) for r in runs]
        ok = [len(r["by_status"].get("200", [])) for r in runs]
        print(f"\nsilent timeouts: {silent[0]} vs {silent[1]} before; 200s: {ok[0]} vs {ok[1]} before "
              f"(ratio {ok[0] / max(ok[1], 1):.2f}); wall {runs[0]['wall'] / max(runs[1]['wall'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
