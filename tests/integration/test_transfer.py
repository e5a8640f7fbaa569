"""KV transfer between real processes over a real nats-server: shm and nats backends.

The sender is ``transfer_peer.py`` in a subprocess; the receiver runs here. Both
sides build the same tensor from a seed, so the bytes can be compared exactly.
"""

from __future__ import annotations

import asyncio
import glob
import secrets
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from bus import errors
from bus.nats_transport import BusConfig, connect
from schemas.transfer import TransferDescriptor, TransferTarget
from services.transfer import KVReceiver, TransferTimeout

sys.path.insert(0, str(Path(__file__).parent))
from transfer_peer import make_tensor  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).parent / "transfer_peer.py"
HOST = "host-test"
CASES = [([3, 30, 2, 16, 3, 64], "float32"), ([5, 7, 2, 16, 3, 64], "bfloat16"),
         ([2, 3, 2, 5, 1, 9], "float8_e4m3fn")]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class Peer:
    """The sender process."""

    def __init__(self, proc: asyncio.subprocess.Process, worker_id: str):
        self.proc = proc
        self.worker_id = worker_id

    @classmethod
    async def start(cls, nats_url: str, *extra: str) -> "Peer":
        worker_id = f"prefill-{secrets.token_hex(4)}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(PEER), nats_url, worker_id, HOST, *extra, cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line == b"ready\n", line + await proc.stderr.read()
        return cls(proc, worker_id)

    async def send(self, target: TransferTarget, shape: list[int], dtype: str, seed: int = 0) -> TransferDescriptor:
        job = {"target": msgspec.to_builtins(target), "shape": shape, "dtype": dtype, "seed": seed}
        self.proc.stdin.write(msgspec.json.encode(job) + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert line, await self.proc.stderr.read()
        return msgspec.json.decode(line, type=TransferDescriptor)

    async def finish(self) -> str:
        """Close its input, wait for it (and its resource tracker) to exit; returns its stderr."""
        self.proc.stdin.close()
        _, stderr = await asyncio.wait_for(self.proc.communicate(), 60)
        assert self.proc.returncode == 0, stderr.decode()
        return stderr.decode()

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """Kill it if it still runs (a failed test) and reap it."""
        self.kill()
        await self.proc.communicate()

    def segments(self) -> list[str]:
        return glob.glob(f"/dev/shm/kvbus-{self.worker_id}-*")


@pytest.fixture
async def receiver_bus(nats_url):
    bus = await connect(BusConfig(nats_url=nats_url))
    yield bus
    await bus.close()


async def wait_until(predicate, timeout: float) -> bool:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("backend", ["shm", "nats"])
async def test_payload_crosses_processes_bit_exact_and_leaves_nothing(nats_url, receiver_bus, backend):
    receiver = await KVReceiver.open(receiver_bus, f"decode-{backend}", HOST, backend)
    peer = await Peer.start(nats_url)
    try:
        for i, (shape, dtype) in enumerate(CASES):
            descriptor = await peer.send(receiver.expect(f"t{i}", sender_host_id=HOST), shape, dtype, seed=i)
            assert descriptor.backend == backend
            out = await receiver.receive(descriptor, timeout=10)
            assert out.dtype == getattr(torch, dtype) and out.shape == tuple(shape)
            assert raw(out) == raw(make_tensor(shape, dtype, i))
        stderr = await peer.finish()
    finally:
        await peer.stop()
        await receiver.close()
    assert peer.segments() == []
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr


async def test_payload_over_the_servers_max_payload_arrives_in_chunks(nats_url, receiver_bus):
    assert receiver_bus.max_payload == 1 << 20  # nats-server's default
    receiver = await KVReceiver.open(receiver_bus, "decode-big", HOST, "nats")
    peer = await Peer.start(nats_url)
    shape = [32, 8, 2, 16, 4, 64]  # float32: 8 MiB
    try:
        descriptor = await peer.send(receiver.expect("big"), shape, "float32", seed=7)
        assert descriptor.num_bytes == 8 << 20 and descriptor.num_chunks == 9
        out = await receiver.receive(descriptor, timeout=30)
        assert raw(out) == raw(make_tensor(shape, "float32", 7))
        await peer.finish()
    finally:
        await peer.stop()
        await receiver.close()


async def test_missing_chunk_times_out_then_the_receiver_still_works(nats_url, receiver_bus):
    receiver = await KVReceiver.open(receiver_bus, "decode-lossy", HOST, "nats")
    peer = await Peer.start(nats_url, "--drop-chunk", "1")
    nats_half = receiver._receivers["nats"]
    try:
        descriptor = await peer.send(receiver.expect("lost"), [8, 8, 2, 16, 4, 64], "float32")  # 4 chunks
        with pytest.raises(TransferTimeout):
            await receiver.receive(descriptor, timeout=0.5)
        assert receiver.num_expected == 0 and nats_half.num_pending == 0
        # a one-chunk payload loses nothing: the same receiver takes it
        descriptor = await peer.send(receiver.expect("next"), [1, 2, 2, 4, 1, 8], "float32", seed=3)
        out = await receiver.receive(descriptor, timeout=10)
        assert raw(out) == raw(make_tensor([1, 2, 2, 4, 1, 8], "float32", 3))
        await peer.finish()
    finally:
        await peer.stop()
        await receiver.close()


async def test_unclaimed_segments_are_reaped_by_their_sender(nats_url, receiver_bus):
    receiver = await KVReceiver.open(receiver_bus, "decode-late", HOST, "shm")
    peer = await Peer.start(nats_url, "--reap-after", "0.5")
    try:
        # one transfer the receiver gave up on (its request timed out), one it comes too late for
        abandoned = await peer.send(receiver.expect("gave-up"), [4, 30, 2, 16, 3, 64], "float32")
        receiver.cancel("gave-up")
        descriptor = await peer.send(receiver.expect("late"), [4, 30, 2, 16, 3, 64], "float32")
        assert sorted(peer.segments()) == sorted(f"/dev/shm/{d.shm_name}" for d in (abandoned, descriptor))
        assert await wait_until(lambda: not peer.segments(), 10), "the sender never reaped its segments"
        with pytest.raises(errors.Unavailable, match="gone"):  # the receiver came too late
            await receiver.receive(descriptor, timeout=5)
        stderr = await peer.finish()
    finally:
        await peer.stop()
        await receiver.close()
    assert "no receiver claimed it" in stderr
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr


async def test_a_killed_senders_segments_are_unlinked_by_its_resource_tracker(nats_url, receiver_bus):
    receiver = await KVReceiver.open(receiver_bus, "decode-crash", HOST, "shm")
    peer = await Peer.start(nats_url)
    try:
        await peer.send(receiver.expect("orphan"), [2, 30, 2, 16, 3, 64], "float32")
        assert len(peer.segments()) == 1
        peer.kill()
        await peer.proc.wait()
        assert await wait_until(lambda: not peer.segments(), 10)
    finally:
        await peer.stop()
        await receiver.close()
