"""Tokenizer service throughput over NATS vs calling the tokenizer in-process.

    python -m bench.tokenizer_bench [--texts 2000] [--replicas 1]

Starts a private nats-server and ``--replicas`` tokenizer service processes,
then encodes the same texts (about 40-300 tokens each) with 1 and 32 concurrent
callers. Baselines in the same run: the transformers fast tokenizer called
in-process one text at a time (what a caller would do without the service),
and in-process batches of 32.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, nats_server, table
from bus.nats_transport import BusConfig, connect
from bus.subjects import TOKENIZER_ENCODE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.tokenizer import EncodeRequest

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over lazy dogs while kvbus serves tokens across NATS subjects "
         "disaggregated prefill decode cache pages héllo wörld 你好 🤖").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 200))) for _ in range(n)]


async def wait_ready(bus, worker_ids: list[str]) -> None:
    pending = set(worker_ids)
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for wid in list(pending):
            try:
                if (await bus.request(WORKER_HEALTH, HealthRequest(), timeout=0.5, role="tokenizer",
                                      worker_id=wid)).ready:
                    pending.discard(wid)
            except Exception:
                pass
        await asyncio.sleep(0.2)
    if pending:
        raise SystemExit(f"tokenizer replicas not ready: {pending}")


async def service_throughput(bus, texts: list[str], concurrency: int) -> tuple[float, int]:
    queue = list(texts)
    num_tokens = 0

    async def caller():
        nonlocal num_tokens
        while queue:
            text = queue.pop()
            reply = await bus.request(TOKENIZER_ENCODE, EncodeRequest(text=text))
            num_tokens += len(reply.ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return time.perf_counter() - t0, num_tokens


def inprocess_throughput(tokenizer, texts: list[str], batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    num_tokens = 0
    for i in range(0, len(texts), batch):
        num_tokens += sum(len(ids) for ids in tokenizer(texts[i:i + batch])["input_ids"])
    return time.perf_counter() - t0, num_tokens


async def run(args) -> str:
    from services.models import resolve_model
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    texts = make_texts(args.texts)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    inprocess_throughput(tokenizer, texts[:100], 1)  # warm-up
    base_t, base_n = inprocess_throughput(tokenizer, texts, 1)
    batch_t, _ = inprocess_throughput(tokenizer, texts, 32)
    base_rate = base_n / base_t
    rows = [["in-process, one text per call", "1", f"{base_rate:,.0f}", "1.00"],
            ["in-process, batches of 32", "-", f"{base_n / batch_t:,.0f}", f"{base_t / batch_t:.2f}"]]
    with nats_server() as url:
        ids = [f"tok-bench-{i}" for i in range(args.replicas)]
        procs = [subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "tokenizer", "--worker-id", wid,
                                   "--nats-url", url, "--model", str(model_dir), "--log-level", "WARNING"],
                                  cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}) for wid in ids]
        bus = await connect(BusConfig(nats_url=url))
        try:
            await wait_ready(bus, ids)
            await service_throughput(bus, texts[:200], 8)  # warm-up
            for concurrency in (1, 32):
                elapsed, n = await service_throughput(bus, texts, concurrency)
                assert n == base_n
                rate = n / elapsed
                rows.append([f"service over NATS, {args.replicas} replica(s)", str(concurrency), f"{rate:,.0f}",
                             f"{rate / base_rate:.2f}"])
        finally:
            await bus.close()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    return "\n".join([
        f"machine: {machine()}; {len(texts)} texts, {base_n} tokens",
        table(rows, ["path", "concurrent callers", "tokens/s", "vs in-process one-by-one"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--model", default=None)
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
