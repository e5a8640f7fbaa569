"""KV transfer throughput between two processes: shm and nats backends vs a plain memcpy.

    python -m bench.transfer_bench [--pages 64] [--repeats 7]

The payload is the prompt KV of the default model (SmolLM2-135M: 30 layers,
3 KV heads, head_dim 64, page 16, float32): ``--pages 64`` is a 1024-token
prompt, ``[64, 30, 2, 16, 3, 64]``, 47.2 MB. A sender process (this module with
``--sender``) holds the tensor; this process is the receiver. One transfer is
timed from handing the target to the sender until ``receive`` returns the
verified tensor (both checksums, every copy). The memcpy rows copy the same
bytes inside this process in the same run. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
import statistics
import sys
import time
import zlib

import msgspec
import torch

from bench.common import machine, nats_server, table
from bus.nats_transport import BusConfig, connect
from schemas.transfer import TransferDescriptor, TransferTarget
from services.transfer import KVReceiver, KVSender

SHAPE = [30, 2, 16, 3, 64]  # per page: layers, K/V, page size, KV heads, head dim


def payload(num_pages: int) -> torch.Tensor:
    return torch.randn([num_pages, *SHAPE], generator=torch.Generator().manual_seed(0))


async def run_sender(nats_url: str, worker_id: str, host_id: str, num_pages: int) -> None:
    """The sender process: one line in (a target), one line out (send seconds, descriptor)."""
    bus = await connect(BusConfig(nats_url=nats_url))
    sender = KVSender(bus, worker_id, host_id)
    tensor = payload(num_pages)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        target = msgspec.json.decode(line, type=TransferTarget)
        t0 = time.perf_counter()
        descriptor = await sender.send(target, tensor)
        elapsed = time.perf_counter() - t0
        print(msgspec.json.encode([elapsed, descriptor]).decode(), flush=True)
    await sender.close()
    await bus.close()


def time_copy(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def time_transfers(nats_url: str, backend: str, num_pages: int, repeats: int,
                         host_id: str) -> tuple[float, float, float]:
    """Median seconds: end to end, sender's send, receiver's receive."""
    bus = await connect(BusConfig(nats_url=nats_url))
    receiver = await KVReceiver.open(bus, f"bench-decode-{backend}", host_id, backend)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.transfer_bench", "--sender", nats_url, f"bench-prefill-{backend}",
        host_id, "--pages", str(num_pages), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    expected = payload(num_pages)
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 120) == b"ready\n"
        totals, sends, receives = [], [], []
        for i in range(repeats + 1):  # the first is a warm-up
            target = receiver.expect(f"b{i}-{secrets.token_hex(2)}", sender_host_id=host_id)
            t0 = time.perf_counter()
            proc.stdin.write(msgspec.json.encode(target) + b"\n")
            await proc.stdin.drain()
            sent, raw = msgspec.json.decode(await proc.stdout.readline())
            descriptor = msgspec.convert(raw, TransferDescriptor)
            t1 = time.perf_counter()
            tensor = await receiver.receive(descriptor, timeout=60)
            t2 = time.perf_counter()
            if i == 0:
                assert torch.equal(tensor, expected), "payload differs"
                continue
            totals.append(t2 - t0)
            sends.append(sent)
            receives.append(t2 - t1)
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await receiver.close()
        await bus.close()
    return statistics.median(totals), statistics.median(sends), statistics.median(receives)


async def run(args) -> str:
    tensor = payload(args.pages)
    num_bytes = tensor.numel() * tensor.element_size()
    data = tensor.numpy().tobytes()
    into = torch.empty_like(tensor)
    repeats = max(args.repeats, 21)  # cheap, and noisy on a shared machine
    baselines = {
        "memcpy: torch clone (new buffer)": time_copy(lambda: tensor.clone(), repeats),
        "memcpy: copy_ into a warm buffer": time_copy(lambda: into.copy_(tensor), repeats),
        "memcpy: bytearray(bytes)": time_copy(lambda: bytearray(data), repeats),
        "zlib.crc32, one pass": time_copy(lambda: zlib.crc32(data), repeats),
    }
    memcpy = baselines["memcpy: torch clone (new buffer)"]
    rows = [[name, f"{s * 1e3:.1f}", "", "", f"{num_bytes / s / 1e6:,.0f}", f"{memcpy / s:.2f}"]
            for name, s in baselines.items()]
    host_id = socket.gethostname()
    with nats_server() as url:
        for backend in ("shm", "nats"):
            total, send, receive = await time_transfers(url, backend, args.pages, args.repeats, host_id)
            rows.append([f"{backend}: 2 processes, end to end", f"{total * 1e3:.1f}", f"{send * 1e3:.1f}",
                         f"{receive * 1e3:.1f}", f"{num_bytes / total / 1e6:,.0f}", f"{memcpy / total:.2f}"])
    return "\n".join([
        f"machine: {machine()}, torch threads {torch.get_num_threads()}",
        f"payload: [{args.pages}, {', '.join(map(str, SHAPE))}] float32 = {num_bytes / 1e6:.1f} MB "
        f"(a {args.pages * 16}-token prompt of SmolLM2-135M); median of {args.repeats}",
        "",
        table(rows, ["path", "ms", "send ms", "receive ms", "MB/s", "speed vs clone"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sender", nargs=3, metavar=("NATS_URL", "WORKER_ID", "HOST_ID"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        asyncio.run(run_sender(*args.sender, args.pages))
    else:
        print(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
