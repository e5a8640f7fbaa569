"""The KV transfer layer in one process: nats backend on the in-memory bus, shm for real."""

from __future__ import annotations

import asyncio
import zlib

import msgspec
import pytest
import torch

from bus import errors
from bus.codec import Encoding, decode, encode
from bus.memory import MemoryNetwork, MemoryTransport, memory_bus
from bus.core import Bus
from bus.subjects import KV_CHUNK, WORKER_HEARTBEAT
from schemas.transfer import KVChunkEvent, TransferDescriptor, TransferTarget
from schemas.worker import WorkerHeartbeatEvent, WorkerLoad
from services.liveness import WorkerLiveness
from services.plugins import Registry
from services.transfer import (
    KVReceiver,
    KVSender,
    TransferCorrupted,
    TransferOptions,
    TransferTimeout,
    available_backends,
    choose_backend,
    register_backend,
)
from services.transfer import base
from services.transfer import shm as shm_backend
from services.transfer.payload import checksum
from tests.waiting import wait_for
from services.transfer.nats import HEADROOM_BYTES, _Assembly

pytestmark = pytest.mark.anyio

HOST = "host-a"
SMALL_CHUNKS = TransferOptions(max_chunk_bytes=1024)


def kv(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul(4).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
async def pair():
    network = MemoryNetwork()
    sender_bus, receiver_bus = memory_bus(network), memory_bus(network)
    receiver = await KVReceiver.open(receiver_bus, "decode-0", HOST, "auto", options=SMALL_CHUNKS)
    sender = KVSender(sender_bus, "prefill-0", HOST, options=TransferOptions(reap_after=0.3))
    yield sender, receiver, sender_bus
    await sender.close(grace=0)
    await receiver.close()
    await sender_bus.close()
    await receiver_bus.close()


CASES = [
    ((3, 2, 2, 5, 3, 7), torch.float32),
    ((2, 3, 2, 16, 3, 64), torch.bfloat16),
    ((5, 1, 2, 7, 1, 9), torch.float8_e4m3fn),
    ((1, 1, 2, 1, 1, 1), torch.float16),
    ((0, 30, 2, 16, 3, 64), torch.float32),
]


@pytest.mark.parametrize("backend", ["nats", "shm"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: str(c))
async def test_round_trip_is_bit_exact(pair, backend, shape, dtype):
    sender, receiver, _ = pair
    tensor = kv(shape, dtype)
    target = receiver.expect("t1", sender_host_id=HOST, sender_backends=["shm", "nats"]) if backend == "shm" \
        else receiver.expect("t1")
    assert target.backend == backend and target.receiver_id == "decode-0"
    descriptor = await sender.send(target, tensor, scales=[0.5] if dtype == torch.float8_e4m3fn else ())
    assert descriptor.num_bytes == tensor.numel() * tensor.element_size()
    if backend == "nats" and tensor.numel():
        assert descriptor.num_chunks == -(-descriptor.num_bytes // 1024)
    out = await receiver.receive(descriptor, timeout=5)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert raw(out) == raw(tensor)
    assert receiver.num_expected == 0
    if backend == "shm" and tensor.numel():
        assert not shm_backend.segment_exists(descriptor.shm_name)
        sender.backend("shm").reap()
        assert sender.backend("shm").num_segments == 0


async def test_non_contiguous_tensor_is_sent_in_logical_order(pair):
    sender, receiver, _ = pair
    tensor = kv((4, 2, 2, 3, 2, 5), torch.float32).transpose(0, 3)
    out = await receiver.receive(await sender.send(receiver.expect("t"), tensor), timeout=5)
    assert torch.equal(out, tensor)


async def test_concurrent_transfers_do_not_mix(pair):
    sender, receiver, _ = pair
    tensors = [kv((3, 2, 2, 4, 2, 8), torch.float32, seed=i) for i in range(4)]
    targets = [receiver.expect(f"t{i}") for i in range(4)]
    descriptors = await asyncio.gather(*(sender.send(tg, t) for tg, t in zip(targets, tensors)))
    outs = await asyncio.gather(*(receiver.receive(d, timeout=5) for d in reversed(descriptors)))
    for out, tensor in zip(reversed(outs), tensors):
        assert torch.equal(out, tensor)


def tamper(bus: Bus, change):
    """Make ``bus`` pass every KVChunkEvent through ``change`` (None: drop it)."""
    publish = bus.publish

    async def patched(subject, message, **kw):
        if subject is KV_CHUNK:
            message = change(message)
            if message is None:
                return
        await publish(subject, message, **kw)

    bus.publish = patched


async def test_corrupted_chunk_raises_and_cleans_up(pair):
    sender, receiver, sender_bus = pair

    def flip(chunk: KVChunkEvent):
        if chunk.index != 1:
            return chunk
        data = bytearray(chunk.data)
        data[7] ^= 0xFF
        return msgspec.structs.replace(chunk, data=bytes(data))

    tamper(sender_bus, flip)
    descriptor = await sender.send(receiver.expect("t"), kv((4, 2, 2, 4, 2, 8), torch.float32))
    with pytest.raises(TransferCorrupted) as info:
        await receiver.receive(descriptor, timeout=5)
    assert isinstance(info.value, errors.Unavailable) and "chunk 1" in str(info.value)
    assert receiver.num_expected == 0 and receiver._receivers["nats"].num_pending == 0


async def test_wrong_total_checksum_or_size_raises(pair):
    sender, receiver, _ = pair
    descriptor = await sender.send(receiver.expect("t"), kv((2, 2, 2, 4, 2, 8), torch.float32))
    with pytest.raises(TransferCorrupted):
        await receiver.receive(msgspec.structs.replace(descriptor, checksum=descriptor.checksum ^ 1), timeout=5)
    descriptor = await sender.send(receiver.expect("u"), kv((2, 2, 2, 4, 2, 8), torch.float32))
    with pytest.raises(errors.InvalidArgument):  # shape and size disagree
        await receiver.receive(msgspec.structs.replace(descriptor, shape=[3, 2, 2, 4, 2, 8]), timeout=5)
    assert receiver.num_expected == 0 and receiver._receivers["nats"].num_pending == 0


async def test_missing_chunk_times_out_and_cleans_up(pair):
    sender, receiver, sender_bus = pair
    tamper(sender_bus, lambda chunk: None if chunk.index == 2 else chunk)
    descriptor = await sender.send(receiver.expect("t"), kv((4, 2, 2, 4, 2, 8), torch.float32))
    with pytest.raises(TransferTimeout) as info:
        await receiver.receive(descriptor, timeout=0.2)
    assert isinstance(info.value, errors.Timeout) and "3/4 chunks" in str(info.value)
    assert receiver.num_expected == 0 and receiver._receivers["nats"].num_pending == 0
    # a chunk arriving late is dropped, not kept
    await sender_bus.transport.publish(KV_CHUNK.format(worker_id="decode-0", transfer_id="t"),
                                       msgspec.msgpack.encode(KVChunkEvent(
                                           transfer_id="t", index=2, num_chunks=4, data=b"x",
                                           checksum=zlib.crc32(b"x"))))
    for _ in range(200):
        if receiver._receivers["nats"].num_dropped_chunks:
            break
        await asyncio.sleep(0.01)
    assert receiver._receivers["nats"].num_dropped_chunks == 1
    assert receiver._receivers["nats"].num_pending == 0


async def test_cancel_wakes_a_waiting_receive_and_drops_late_chunks(pair):
    sender, receiver, sender_bus = pair
    target = receiver.expect("t")
    descriptor = TransferDescriptor(transfer_id="t", backend="nats", shape=[4], dtype="float32",
                                    num_bytes=16, checksum=0, num_chunks=1)
    waiting = asyncio.create_task(receiver.receive(descriptor, timeout=5))
    await asyncio.sleep(0.05)
    receiver.cancel("t")
    with pytest.raises(errors.Cancelled):
        await waiting
    await sender.send(target, torch.zeros(4))
    await asyncio.sleep(0.05)
    assert receiver._receivers["nats"].num_pending == 0
    with pytest.raises(errors.InvalidArgument, match="not expected"):
        await receiver.receive(descriptor, timeout=1)


async def test_shm_corrupted_segment_raises_and_is_unlinked(pair):
    sender, receiver, _ = pair
    target = receiver.expect("t", sender_host_id=HOST)
    descriptor = await sender.send(target, kv((3, 2, 2, 4, 2, 8), torch.float32))
    mapping = shm_backend._attach(descriptor.shm_name)
    mapping[100] ^= 0xFF
    mapping.close()
    with pytest.raises(TransferCorrupted):
        await receiver.receive(descriptor, timeout=5)
    assert not shm_backend.segment_exists(descriptor.shm_name)


async def test_shm_cancelled_transfer_is_unlinked_on_a_late_descriptor(pair):
    sender, receiver, _ = pair
    target = receiver.expect("t", sender_host_id=HOST)
    receiver.cancel("t")
    descriptor = await sender.send(target, kv((3, 2, 2, 4, 2, 8), torch.float32))
    with pytest.raises(errors.InvalidArgument):
        await receiver.receive(descriptor, timeout=5)
    assert not shm_backend.segment_exists(descriptor.shm_name)


async def test_shm_sender_reaps_unclaimed_segments(pair):
    sender, receiver, _ = pair
    descriptor = await sender.send(receiver.expect("t", sender_host_id=HOST), kv((2, 1, 2, 4, 1, 8), torch.float32))
    assert shm_backend.segment_exists(descriptor.shm_name)
    for _ in range(100):
        if sender.backend("shm").num_segments == 0:
            break
        await asyncio.sleep(0.05)
    assert not shm_backend.segment_exists(descriptor.shm_name)
    with pytest.raises(errors.Unavailable, match="gone"):
        await receiver.receive(descriptor, timeout=5)


async def test_shm_sender_close_releases_segments(pair):
    sender, receiver, _ = pair
    descriptor = await sender.send(receiver.expect("t", sender_host_id=HOST), kv((2, 1, 2, 4, 1, 8), torch.float32))
    await sender.close(grace=0.05)
    assert not shm_backend.segment_exists(descriptor.shm_name)
    assert sender.backend("shm").num_segments == 0


async def test_shm_refuses_a_target_on_another_host(pair):
    sender, receiver, _ = pair
    target = msgspec.structs.replace(receiver.expect("t", sender_host_id=HOST), host_id="host-b")
    with pytest.raises(errors.InvalidArgument, match="host"):
        await sender.send(target, torch.zeros(4))


async def test_bad_ids_and_duplicate_expect_are_invalid(pair):
    _, receiver, _ = pair
    with pytest.raises(errors.InvalidArgument):
        receiver.expect("a.b")
    receiver.expect("t")
    with pytest.raises(errors.InvalidArgument, match="already"):
        receiver.expect("t")


class LimitedTransport(MemoryTransport):
    """A memory transport that, like nats-server, refuses messages over max_payload."""

    max_payload = 64 * 1024

    async def publish(self, subject, data, headers=None, reply=None):
        size = len(data) + sum(len(k) + len(v) + 4 for k, v in (headers or {}).items())
        if size > self.max_payload:
            raise AssertionError(f"{size} B over max_payload")
        await super().publish(subject, data, headers, reply)


async def test_chunks_stay_under_the_servers_max_payload():
    network = MemoryNetwork()
    sender_bus, receiver_bus = Bus(LimitedTransport(network)), memory_bus(network)
    receiver = await KVReceiver.open(receiver_bus, "decode-0", HOST, "nats")
    sender = KVSender(sender_bus, "prefill-0", HOST)
    tensor = kv((8, 4, 2, 16, 2, 16), torch.float32)  # 512 KiB
    descriptor = await sender.send(receiver.expect("t"), tensor)
    assert descriptor.num_chunks == -(-descriptor.num_bytes // (64 * 1024 - HEADROOM_BYTES))
    assert torch.equal(await receiver.receive(descriptor, timeout=5), tensor)
    await receiver.close()


def test_choose_backend():
    both = ["shm", "nats"]
    assert choose_backend("auto", "h", "h", both, both) == "shm"
    assert choose_backend("auto", "h2", "h", both, both) == "nats"
    assert choose_backend("auto", None, "h", both, both) == "nats"
    assert choose_backend("auto", "h", "h", ["nats"], both) == "nats"
    assert choose_backend("nats", "h", "h", both, both) == "nats"
    assert choose_backend("shm", None, "h", both, both) == "shm"
    with pytest.raises(errors.InvalidArgument):
        choose_backend("shm", "h2", "h", both, both)
    with pytest.raises(errors.InvalidArgument):
        choose_backend("shm", "h", "h", ["nats"], both)
    with pytest.raises(errors.InvalidArgument):
        choose_backend("auto", "h", "h", ["shm"], ["nats"])
    with pytest.raises(errors.InvalidArgument):
        choose_backend("rdma", "h", "h", both, both)


async def test_forced_backend_limits_what_the_receiver_listens_on():
    bus = memory_bus(MemoryNetwork())
    receiver = await KVReceiver.open(bus, "decode-0", HOST, "shm")
    assert receiver.backends == ("shm",)
    assert receiver.expect("t").backend == "shm"
    await receiver.close()
    with pytest.raises(errors.InvalidArgument):
        await KVReceiver.open(bus, "decode-0", HOST, "shm", backends=["nats"])


def test_subject_wildcard_fixes_some_fields():
    assert KV_CHUNK.wildcard(worker_id="decode-0") == "kvbus.v1.kv.decode-0.*"
    assert KV_CHUNK.wildcard() == "kvbus.v1.kv.*.*"
    with pytest.raises(ValueError):
        KV_CHUNK.wildcard(worker_id="a.b")


def chunks_of(data: bytes, size: int, tid: str = "t") -> list[KVChunkEvent]:
    pieces = [data[i:i + size] for i in range(0, len(data), size)]
    return [KVChunkEvent(transfer_id=tid, index=i, num_chunks=len(pieces), data=p, checksum=zlib.crc32(p))
            for i, p in enumerate(pieces)]


def test_assembly_places_chunks_arriving_in_any_order():
    data = bytes(range(256)) * 41  # 10496 B: 10 chunks of 1024 and one of 256
    for order in (lambda c: c, lambda c: c[::-1], lambda c: c[-1:] + c[3:-1] + c[:3]):
        asm = _Assembly()
        for chunk in order(chunks_of(data, 1024)):
            asm.add(chunk, max_chunk_bytes=1024)
        assert asm.done.is_set() and asm.num_bytes == len(data)
        assert asm.result().numpy().tobytes() == data


def test_assembly_rejects_uneven_duplicate_or_foreign_chunks():
    good = chunks_of(bytes(4000), 1024)
    short = chunks_of(bytes(1000), 1000)[0]
    for bad in (
        msgspec.structs.replace(short, index=1, num_chunks=4),  # a middle chunk of another size
        good[0],  # a duplicate
        msgspec.structs.replace(good[1], num_chunks=5),  # another chunk count
        msgspec.structs.replace(good[1], index=4),  # out of range
    ):
        asm = _Assembly()
        asm.add(good[0], max_chunk_bytes=1024)
        with pytest.raises(TransferCorrupted):
            asm.add(bad, max_chunk_bytes=1024)
    with pytest.raises(TransferCorrupted):  # bigger than the receiver asked for
        _Assembly().add(good[0], max_chunk_bytes=512)


async def test_shm_segments_are_owner_only_and_not_guessable(pair):
    """Another user cannot open a segment; a name tells nothing about another transfer's segment; a
    receiver never maps a segment that is not its own transfer's, and a claimed one cannot be read again."""
    import os
    import stat

    sender, receiver, _ = pair
    old_umask = os.umask(0)  # the widest umask: the mode must not come from it
    try:
        d1 = await sender.send(receiver.expect("t1", sender_host_id=HOST), kv((2, 1, 2, 4, 1, 8), torch.float32))
        d2 = await sender.send(receiver.expect("t2", sender_host_id=HOST), kv((2, 1, 2, 4, 1, 8), torch.float32, 1))
    finally:
        os.umask(old_umask)
    for d in (d1, d2):
        assert stat.S_IMODE(os.stat(f"/dev/shm/{d.shm_name}").st_mode) == 0o600
    # Same sender, consecutive transfers: the names share only prefix, sender, instance and transfer id.
    prefix = f"{shm_backend.SEGMENT_PREFIX}prefill-0-{sender.backend('shm').instance}-"
    nonce1, nonce2 = (d.shm_name[len(prefix):].rsplit("-", 1)[0] for d in (d1, d2))
    assert len(nonce1) == len(nonce2) == 32 and nonce1 != nonce2
    # A descriptor for t2 that names t1's segment is refused without touching it.
    forged = msgspec.structs.replace(d2, shm_name=d1.shm_name)
    with pytest.raises(errors.InvalidArgument, match="bad segment name"):
        await receiver.receive(forged, timeout=5)
    assert shm_backend.segment_exists(d1.shm_name)
    assert torch.equal(await receiver.receive(d1, timeout=5), kv((2, 1, 2, 4, 1, 8), torch.float32))
    assert not shm_backend.segment_exists(d1.shm_name)  # claimed: the name opens nothing any more
    with pytest.raises(FileNotFoundError):
        shm_backend._attach(d1.shm_name)
    with pytest.raises(errors.InvalidArgument, match="not expected"):  # the forged descriptor ended t2
        await receiver.receive(d2, timeout=5)


# ---- the registry: a third backend plugs in with one register line --------------------------------

LOOP_MAILBOX: dict[str, torch.Tensor] = {}


class LoopSender(base.SenderBackend):
    """A third backend for these tests: the payload handed over inside this process."""

    name = "loop"

    async def send(self, target, payload):
        data = payload.cpu().clone()
        LOOP_MAILBOX[target.transfer_id] = data
        return base.Sent(checksum=checksum(data), num_chunks=1)


class LoopReceiver(base.ReceiverBackend):
    name = "loop"

    async def receive(self, descriptor, timeout):
        if descriptor.transfer_id not in LOOP_MAILBOX:
            raise errors.Unavailable(f"transfer {descriptor.transfer_id} was never sent")
        return LOOP_MAILBOX.pop(descriptor.transfer_id)

    def discard(self, descriptor_or_id):
        LOOP_MAILBOX.pop(descriptor_or_id if isinstance(descriptor_or_id, str) else descriptor_or_id.transfer_id, None)


LOOP = base.Backend("loop", LoopSender, LoopReceiver, needs_same_host=True, auto_rank=5)


@pytest.fixture
def with_loop_backend(monkeypatch):
    """The built-in registry plus ``loop``, registered as a third party would (undone afterwards)."""
    registry = Registry("transfer backend", {"shm": "services.transfer.shm:BACKEND",
                                             "nats": "services.transfer.nats:BACKEND"})
    monkeypatch.setattr(base, "BACKENDS", registry)
    register_backend("loop", LOOP, doc="in-process hand-over (tests)")
    yield
    LOOP_MAILBOX.clear()


async def test_a_registered_backend_is_chosen_sent_received_and_decoded(with_loop_backend):
    assert base.transfer_choices() == ("auto", "loop", "nats", "shm")
    assert "loop" in base.available_backends()
    assert choose_backend("auto", "h", "h", ["loop", "nats"], ["loop", "nats", "shm"]) == "loop"
    assert choose_backend("auto", "h2", "h", ["loop", "nats"], ["loop", "nats"]) == "nats"  # loop needs one host
    with pytest.raises(errors.InvalidArgument, match="loop transfer needs one host"):
        choose_backend("loop", "h2", "h", ["loop"], ["loop"])
    bus = memory_bus(MemoryNetwork())
    receiver = await KVReceiver.open(bus, "decode-0", HOST, "loop")
    sender = KVSender(bus, "prefill-0", HOST)
    try:
        target = receiver.expect("t1", sender_host_id=HOST, sender_backends=sender.backends)
        assert target.backend == "loop"
        tensor = kv((2, 3, 2, 4, 1, 8), torch.bfloat16)
        descriptor = await sender.send(target, tensor)
        # a peer decodes both halves off the wire (the schema types the backend as a plain string)
        for encoding in (Encoding.JSON, Encoding.MSGPACK):
            assert decode(encode(target, encoding), TransferTarget, encoding) == target
            assert decode(encode(descriptor, encoding), TransferDescriptor, encoding) == descriptor
        out = await receiver.receive(descriptor, timeout=5)
        assert raw(out) == raw(tensor) and out.dtype == torch.bfloat16
        with pytest.raises(errors.InvalidArgument, match="loop target"):
            await sender.send(msgspec.structs.replace(receiver.expect("t2"), host_id="elsewhere"), tensor)
    finally:
        await sender.close(grace=0)
        await receiver.close()
        await bus.close()
    with pytest.raises(errors.InvalidArgument, match="must be one of auto, loop, nats, shm"):
        await KVReceiver.open(bus, "decode-0", HOST, "rdma")


async def test_the_receiver_offers_a_sender_only_the_backends_its_heartbeat_advertises():
    """The decode worker's choice (DecodeActor._remote_prefill): the prefill worker's advertised
    backends, heard by WorkerLiveness from its heartbeats; none heard yet: any registered one."""
    network = MemoryNetwork()
    worker_bus, listener_bus = memory_bus(network), memory_bus(network)
    liveness = WorkerLiveness(3.0)
    await liveness.start(listener_bus)
    receiver = await KVReceiver.open(listener_bus, "decode-0", HOST, "auto")
    try:
        assert liveness.transfer_backends("prefill-0") is None
        assert receiver.expect("t0", sender_host_id=HOST,
                               sender_backends=liveness.transfer_backends("prefill-0")).backend == "shm"
        beat = WorkerHeartbeatEvent(worker_id="prefill-0", role="prefill", host_id=HOST, load=WorkerLoad(),
                                    transfer_backends=["nats"])  # e.g. a host without POSIX shared memory
        await worker_bus.publish(WORKER_HEARTBEAT, beat)
        await wait_for(lambda: liveness.transfer_backends("prefill-0") is not None, what="heartbeat heard")
        assert liveness.transfer_backends("prefill-0") == ("nats",)
        assert receiver.expect("t1", sender_host_id=HOST,
                               sender_backends=liveness.transfer_backends("prefill-0")).backend == "nats"
        assert set(available_backends()) == {"shm", "nats"}  # what this process's workers advertise
    finally:
        await receiver.close()
        await liveness.stop()
        await worker_bus.close()
        await listener_bus.close()
