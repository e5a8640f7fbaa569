"""The streamed replies' interest probe: what it costs live streams, and how fast a gone caller's stream stops.

    python -m bench.stream_probe_bench [--streams 32] [--seconds 10] [--rounds 2] [--trials 10]

Cost: ``--streams`` concurrent streams on a real nats-server (loopback), each a chunk every 20 ms
(a decode cadence) for ``--seconds``, served by one bus with probing off (probe_interval 0: the
previous path) and on (``--interval``), alternately, ``--rounds`` times each. Reports the process's
CPU seconds per 1000 chunks (servers and callers share the process) and the gap between two chunks
as the callers see it (p50/p99: a probe must never delay a chunk), with on/off ratios.

Detection: ``--trials`` callers each read one chunk of an endless stream and close their NATS
connection (no CancelEvent); seconds until the server's handler is cancelled. Without the probe
such a handler runs until its own end (max_tokens, the context limit, or a deadline).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import machine, median, nats_server, percentile, table
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_STREAM
from schemas.common import EchoChunk, EchoRequest

CADENCE_S = 0.02


async def paced(req: EchoRequest):
    for i in range(req.count):
        yield EchoChunk(index=i, data=req.data)
        await asyncio.sleep(CADENCE_S)


async def one_cost_run(url: str, interval: float, streams: int, seconds: float) -> tuple[float, list[float], int]:
    """(CPU seconds, chunk gaps in ms, chunks) for ``streams`` paced streams served with ``interval``."""
    server = await connect(BusConfig(nats_url=url, probe_interval=interval, request_timeout=60))
    client = await connect(BusConfig(nats_url=url, request_timeout=60))
    await server.serve(DEBUG_STREAM, paced)
    await server.flush()
    await asyncio.sleep(0.05)  # nats-server may answer "no responders" for a moment after a new SUB
    gaps: list[float] = []
    count = max(int(seconds / CADENCE_S), 2)

    async def one() -> int:
        n, last = 0, None
        async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x" * 100, count=count)) as chunks:
            async for _ in chunks:
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last, n = now, n + 1
        return n

    cpu0 = time.process_time()
    num_chunks = sum(await asyncio.gather(*(one() for _ in range(streams))))
    cpu = time.process_time() - cpu0
    await client.close()
    await server.close()
    return cpu, gaps, num_chunks


async def detection(url: str, interval: float, trials: int) -> list[float]:
    """Seconds from a caller's connection closing to its handler's cancellation, per trial."""
    server = await connect(BusConfig(nats_url=url, probe_interval=interval, request_timeout=60))
    cancelled: asyncio.Queue[float] = asyncio.Queue()

    async def endless(req: EchoRequest):
        try:
            i = 0
            while True:
                yield EchoChunk(index=i)
                i += 1
                await asyncio.sleep(CADENCE_S)
        except asyncio.CancelledError:
            cancelled.put_nowait(time.perf_counter())
            raise

    await server.serve(DEBUG_STREAM, endless)
    await server.flush()
    await asyncio.sleep(0.05)
    took = []
    for _ in range(trials):
        client = await connect(BusConfig(nats_url=url, request_timeout=60))
        stream = client.stream(DEBUG_STREAM, EchoRequest())
        await anext(stream)
        await client.transport.nc.close()
        t0 = time.perf_counter()
        took.append(await asyncio.wait_for(cancelled.get(), interval + 30) - t0)
        del stream
    await server.close()
    return took


async def run(args) -> str:
    rows = []
    with nats_server() as url:
        results: dict[str, list[tuple[float, list[float], int]]] = {"off": [], "on": []}
        for _ in range(args.rounds):  # alternate, so drift of a shared machine hits both alike
            for name, interval in (("off", 0.0), ("on", args.interval)):
                results[name].append(await one_cost_run(url, interval, args.streams, args.seconds))
        summary = {}
        for name, runs in results.items():
            cpu = sum(r[0] for r in runs)
            chunks = sum(r[2] for r in runs)
            gaps = [g for r in runs for g in r[1]]
            summary[name] = (cpu / chunks * 1000, percentile(gaps, 50), percentile(gaps, 99))
            label = "probing off (previous path)" if name == "off" else f"probing every {args.interval:g} s"
            rows.append([label, str(chunks), f"{summary[name][0]:.3f}", f"{summary[name][1]:.1f}",
                         f"{summary[name][2]:.1f}"])
        on, off = summary["on"], summary["off"]
        rows.append(["ratio on/off", "", f"{on[0] / off[0]:.2f}x", f"{on[1] / off[1]:.2f}x", f"{on[2] / off[2]:.2f}x"])
        took = await detection(url, args.interval, args.trials)
    return "\n".join([
        f"machine: {machine()}",
        "",
        f"{args.streams} concurrent streams, a 100 B chunk every {CADENCE_S * 1e3:g} ms for {args.seconds:g} s, "
        f"{args.rounds} rounds each (alternating)",
        table(rows, ["server", "chunks", "CPU s / 1000 chunks", "gap p50 ms", "gap p99 ms"]),
        "",
        f"caller's connection closed mid-stream, {args.trials} trials, probe_interval {args.interval:g} s "
        f"(bound: interval + 0.5 s probe timeout)",
        table([[f"{median(took):.2f}", f"{max(took):.2f}", f"{min(took):.2f}"]],
              ["median s to cancel", "max s", "min s"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--interval", type=float, default=1.0, help="probe_interval of the probing runs")
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
