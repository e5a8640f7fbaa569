"""Bus round trip and streaming throughput: real NATS vs in-memory bus vs a plain in-process call.

    python -m bench.bus_bench [--requests 2000] [--chunks 20000]

Round trip: one caller, sequential requests to the echo handler, p50/p99 in
microseconds at 100 B and 64 KiB payloads. The in-process baseline awaits the
same handler directly (no encoding, no transport). Streaming: one streamed
request of N chunks of 100 B, messages/s as seen by the caller.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import machine, nats_server, percentile, table
from bus.memory import MemoryNetwork, memory_bus
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_ECHO, DEBUG_STREAM
from schemas.common import EchoChunk, EchoReply, EchoRequest

RAW_ECHO = DEBUG_ECHO.template + "_raw"  # outside the table on purpose: no kvbus layer at all


async def echo(req: EchoRequest) -> EchoReply:
    return EchoReply(data=req.data)


async def stream(req: EchoRequest):
    for i in range(req.count):
        yield EchoChunk(index=i, data=req.data)


async def time_calls(call, n: int) -> list[float]:
    for _ in range(min(200, n)):  # warm-up
        await call()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


async def run(args) -> str:
    rows = []
    stream_rows = []
    with nats_server() as url:
        nats_server_bus = await connect(BusConfig(nats_url=url))
        nats_client = await connect(BusConfig(nats_url=url))
        network = MemoryNetwork()
        mem_server, mem_client = memory_bus(network), memory_bus(network)
        for bus in (nats_server_bus, mem_server):
            await bus.serve(DEBUG_ECHO, echo)
            await bus.serve(DEBUG_STREAM, stream)
        async def raw_echo(msg):
            await msg.respond(msg.data)

        await nats_server_bus.transport.nc.subscribe(RAW_ECHO, cb=raw_echo)
        await nats_server_bus.transport.flush()
        for size in (100, 64 * 1024):
            req = EchoRequest(data=b"x" * size)
            base = await time_calls(lambda: echo(req), args.requests)
            results = {"in-process call": base}
            results["in-memory bus"] = await time_calls(lambda: mem_client.request(DEBUG_ECHO, req), args.requests)
            results["NATS (loopback)"] = await time_calls(lambda: nats_client.request(DEBUG_ECHO, req), args.requests)
            # Raw nats-py request to a raw echo subscriber: the floor our bus layer sits on.
            raw_nc = nats_client.transport.nc
            results["raw nats-py (no kvbus layer)"] = await time_calls(
                lambda: raw_nc.request(RAW_ECHO, req.data, timeout=5), args.requests)
            p50_base = percentile(base, 50)
            for name, samples in results.items():
                p50, p99 = percentile(samples, 50), percentile(samples, 99)
                rows.append([f"{size} B", name, f"{p50:.1f}", f"{p99:.1f}", f"{p50 / p50_base:.0f}x"])
        for name, client in (("in-memory bus", mem_client), ("NATS (loopback)", nats_client)):
            req = EchoRequest(data=b"x" * 100, count=args.chunks)
            t0 = time.perf_counter()
            async with client.stream(DEBUG_STREAM, req) as chunks:
                n = sum([1 async for _ in chunks])
            elapsed = time.perf_counter() - t0
            assert n == args.chunks
            stream_rows.append([name, str(n), f"{n / elapsed:,.0f}"])
        for bus in (nats_server_bus, nats_client, mem_server, mem_client):
            await bus.close()
    return "\n".join([
        f"machine: {machine()}",
        "",
        "request-reply round trip (one caller, sequential), microseconds",
        table(rows, ["payload", "path", "p50 us", "p99 us", "p50 vs in-process"]),
        "",
        "streamed reply: one request, 100 B chunks",
        table(stream_rows, ["path", "chunks", "chunks/s"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=20000)
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
