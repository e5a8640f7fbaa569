"""Soak: thousands of mixed requests against `kvbus up`; memory of every service must stay flat.

    python -m bench.soak                                       # 2,000 requests, 8 at a time (long: ~1 h on 2 cores)
    python -m bench.soak --requests 50 --concurrency 4 --max-tokens 8   # tiny check, about a minute

The mix (seeded): streamed and whole completions over HTTP, streams the client cancels after a
few chunks, and long prompts (300-400 words). The RSS of every process `kvbus up` started is
sampled every ``--sample-every`` seconds; the table gives each service's RSS after warm-up
(the first 10% of requests), at the end, and the growth (flat: under 5%), split into private
memory (heap, tensors) and file-backed pages (shared libraries, mapped files); then throughput
per tenth of the run (steady: no falling trend) and the outcomes by kind and status. Exits 1
when a service grew 5% or more, or any request failed with a status other than 200/429/503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

from bench.common import machine, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KINDS = ("whole", "streamed", "cancelled", "long")
WORDS = "river mountain city history science music garden ocean machine language quiet bright".split()


def plan(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.choices(KINDS, weights=(4, 4, 1, 1))[0]
        words = rng.randint(300, 400) if kind == "long" else rng.randint(5, 40)
        out.append((kind, f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))))
    return out


async def one(http, kind: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kind in ("whole", "long"):
        r = await http.post("/v1/completions", json=body)
        return str(r.status_code)
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return str(r.status_code)
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if '"error"' in line:
                    return "stream-error"
                seen += 1
                if kind == "cancelled" and seen == 2:
                    return "cancelled"  # leaving the block closes the connection mid-stream
    return "200"


def rss_of(pids: dict[str, int]) -> dict[str, int]:
    """Resident bytes per service: ``name`` -> RSS, ``name:file`` -> the file-backed part of it
    (shared libraries' code and data, mapped files: pages the kernel can drop and read again),
    ``name:anon`` -> the private rest (heap, tensors: what a leak grows)."""
    out = {}
    for name, pid in pids.items():
        fields = {}
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                        key, value = line.split(":", 1)
                        fields[key] = int(value.split()[0]) * 1024
        except OSError:
            pass
        out[name] = fields.get("VmRSS", 0)
        out[name + ":file"] = fields.get("RssFile", 0) + fields.get("RssShmem", 0)
        out[name + ":anon"] = fields.get("RssAnon", 0)
    return out


def service_pids(root_pid: int) -> dict[str, int]:
    import psutil

    out = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        cmd = child.cmdline()
        if "--worker-id" in cmd:
            out[cmd[cmd.index("--worker-id") + 1]] = child.pid
        elif cmd and cmd[0].endswith("nats-server"):
            out["nats-server"] = child.pid
    return out


async def soak(system, args) -> int:
    import httpx

    requests = plan(args.requests, args.seed)
    pids = service_pids(system.proc.pid)
    samples: list[tuple[int, dict[str, int]]] = []  # (requests done, rss by service)
    done_at: list[float] = []
    outcomes: dict[tuple[str, str], int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def client(http) -> None:
        while not queue.empty():
            kind, prompt = queue.get_nowait()
            try:
                status = await one(http, kind, prompt, args.max_tokens)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            outcomes[(kind, status)] = outcomes.get((kind, status), 0) + 1
            done_at.append(time.monotonic())

    async def sampler() -> None:
        while True:
            samples.append((len(done_at), rss_of(pids)))
            await asyncio.sleep(args.sample_every)

    t0 = time.monotonic()
    sampling = asyncio.create_task(sampler())
    async with httpx.AsyncClient(base_url=system.http_url, timeout=args.deadline) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    sampling.cancel()
    samples.append((len(done_at), rss_of(pids)))
    wall = time.monotonic() - t0

    warm = max(1, args.requests // 10)
    after_warmup = next(rss for n, rss in samples if n >= warm)
    end = samples[-1][1]
    rows, grew = [], False
    for name in sorted(pids):
        growth = (end[name] - after_warmup[name]) / max(after_warmup[name], 1) * 100
        grew |= growth >= 5.0
        parts = [f"{(end[f'{name}:{k}'] - after_warmup[f'{name}:{k}']) / 2**20:+.0f}" for k in ("anon", "file")]
        rows.append([name, f"{after_warmup[name] / 2**20:.0f}", f"{end[name] / 2**20:.0f}", f"{growth:+.1f}%", *parts])
    print(table(rows, ["service", f"RSS MiB after {warm} requests", "RSS MiB at the end", "growth",
                       "of it private MiB", "of it file-backed MiB"]))
    # the path, to tell a plateau (a high-water mark reached) from a steady climb (a leak)
    marks = [warm * k for k in range(1, 11)]
    path = [next((rss for n, rss in samples if n >= m), end) for m in marks]
    print(f"\nRSS MiB every {warm} requests: " + "; ".join(
        f"{name} " + " ".join(f"{p[name] / 2**20:.0f}" for p in path) for name in sorted(pids)
        if abs(end[name] - after_warmup[name]) >= 0.02 * after_warmup[name]) or "(no service moved 2% or more)")

    tenths = []
    for k in range(10):
        lo, hi = t0 + wall * k / 10, t0 + wall * (k + 1) / 10
        tenths.append(sum(1 for t in done_at if lo <= t < hi) / (wall / 10))
    print("\nthroughput per tenth of the run (requests/s): " + ", ".join(f"{x:.2f}" for x in tenths))
    print(f"second half / first half: {sum(tenths[5:]) / max(sum(tenths[:5]), 1e-9):.2f}")
    print()
    print(table([[k, s, str(n)] for (k, s), n in sorted(outcomes.items())], ["kind", "status", "requests"]))
    print(f"\n{len(done_at)} requests in {wall:.0f}s ({len(done_at) / wall:.2f}/s)")
    bad = sum(n for (k, s), n in outcomes.items() if s not in ("200", "429", "503", "cancelled"))
    return 1 if grew or bad else 0


def main() -> int:
    from services.local_system import LocalSystem

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--sample-every", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--up-args", default="--aggregated", help="arguments for kvbus up")
    args = parser.parse_args()
    print(f"# soak: {args.requests} requests, {args.concurrency} at a time, max_tokens {args.max_tokens}, "
          f"kvbus up {args.up_args}; {machine()}")
    with LocalSystem(*args.up_args.split(), "--quiet") as system:
        return asyncio.run(soak(system, args))


if __name__ == "__main__":
    raise SystemExit(main())
