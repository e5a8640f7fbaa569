"""A KV sender in its own process, driven over stdin/stdout by tests/integration/test_transfer.py.

    python tests/integration/transfer_peer.py NATS_URL WORKER_ID HOST_ID [--reap-after S] [--drop-chunk I]

Prints ``ready``, then for each stdin line ``{"target": TransferTarget, "shape": [...],
"dtype": "float32", "seed": 0}`` sends that tensor (see ``make_tensor``) and prints
the descriptor as one JSON line. On end of input it closes the sender (waiting
``--grace`` s for receivers to claim their segments) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402
import torch  # noqa: E402

from bus.nats_transport import BusConfig, connect  # noqa: E402
from bus.subjects import KV_CHUNK  # noqa: E402
from schemas.transfer import TransferTarget  # noqa: E402
from services.transfer import KVSender, TransferOptions  # noqa: E402


def make_tensor(shape: list[int], dtype: str, seed: int) -> torch.Tensor:
    """The same tensor in every process for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul(4).to(getattr(torch, dtype))


async def main(args) -> None:
    bus = await connect(BusConfig(nats_url=args.nats_url))
    if args.drop_chunk is not None:  # lose one chunk on the way, like a broken network would
        publish = bus.publish

        async def lossy(subject, message, **kw):
            if subject is KV_CHUNK and message.index == args.drop_chunk:
                return
            await publish(subject, message, **kw)

        bus.publish = lossy
    sender = KVSender(bus, args.worker_id, args.host_id, options=TransferOptions(reap_after=args.reap_after))
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = msgspec.json.decode(line)
        target = msgspec.convert(job["target"], TransferTarget)
        descriptor = await sender.send(target, make_tensor(job["shape"], job["dtype"], job["seed"]))
        print(msgspec.json.encode(descriptor).decode(), flush=True)
    await sender.close(grace=args.grace)
    await bus.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("nats_url")
    parser.add_argument("worker_id")
    parser.add_argument("host_id")
    parser.add_argument("--reap-after", type=float, default=120.0)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--drop-chunk", type=int, default=None)
    asyncio.run(main(parser.parse_args()))
