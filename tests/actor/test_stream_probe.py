"""The interest probe of streamed replies, on the in-memory bus (bus/core.py, "Interest probes").

A streaming server asks its caller's inbox every ``probe_interval`` seconds whether anyone still
reads, if that caller asked for probes (``Kvbus-Probe: accept``; our bus's streams do): a caller whose
connection is gone (no responders) or who dropped the stream without closing it (answers ``gone``)
has its handler cancelled; a live caller, however slow, and a client that never answers are never
cancelled, no probe ever shows up as a chunk, and a client that did not ask gets none.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from bus.core import PROBE_TIMEOUT, SEQ_HEADER, STREAM_HEADER
from bus.errors import NoResponders, Unavailable
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import DEBUG_STREAM
from bus.transport import PROBE, PROBE_ACCEPT, PROBE_HEADER, header
from schemas.common import EchoChunk, EchoRequest
from tests.probing import CALLER_GONE, WAIT_S, Endless, ProbeLog, wait_until

pytestmark = pytest.mark.anyio
INTERVAL = 0.2


@pytest.fixture
async def buses():
    network = MemoryNetwork()
    server = memory_bus(network, default_timeout=WAIT_S, probe_interval=INTERVAL)
    client = memory_bus(network, default_timeout=WAIT_S, probe_interval=INTERVAL)
    yield server, client
    for bus in (server, client):
        await bus.close()


async def test_a_caller_whose_connection_closed_is_cancelled(buses, caplog):
    server, client = buses
    probes = ProbeLog(server)
    handler = Endless()
    await server.serve(DEBUG_STREAM, handler)
    stream = client.stream(DEBUG_STREAM, EchoRequest(data=b"x"))
    assert (await anext(stream)).index == 0
    with caplog.at_level(logging.INFO, logger="bus.core"):
        await client.close()  # the connection goes: no CancelEvent, nobody subscribes to the inbox
        t0 = time.monotonic()
        await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
        took = time.monotonic() - t0
        await wait_until(lambda: server.num_inflight == 0, "the handler task done")
    assert "NoResponders" in probes.outcomes
    assert took < INTERVAL + PROBE_TIMEOUT + 10, took
    gone = [r for r in caplog.records if "caller is gone" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and stream.request_id in gone[0].getMessage()
    assert server.serving.is_idle  # no task, and no reason a task ended, is remembered


async def test_a_stream_dropped_without_aclose_is_cancelled_by_the_gone_answer(buses):
    server, client = buses
    probes = ProbeLog(server)
    handler = Endless()
    await server.serve(DEBUG_STREAM, handler)
    stream = client.stream(DEBUG_STREAM, EchoRequest(data=b"x"))
    assert [(await anext(stream)).index for _ in range(2)] == [0, 1]
    assert len(client._pending) == 1
    del stream  # no aclose(): no CancelEvent; only the probe can tell
    gc.collect()
    assert not client._pending  # the dropped stream's token is forgotten (it no longer gathers chunks)
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
    assert probes.outcomes[-1] == "gone" and "NoResponders" not in probes.outcomes
    await wait_until(lambda: server.num_inflight == 0, "the handler task done")


async def test_a_live_caller_that_reads_slowly_is_not_cancelled_and_sees_no_probe(buses):
    server, client = buses
    probes = ProbeLog(server)

    async def after_two_more_probes(i: int) -> None:  # each chunk outlives two probe rounds
        await wait_until(lambda: len(probes.outcomes) >= 2 * i, f"probe round {2 * i}")

    handler = Endless(num_chunks=4, gate=after_two_more_probes)
    await server.serve(DEBUG_STREAM, handler)
    got = []
    async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x")) as chunks:
        async for chunk in chunks:
            got.append(chunk.index)
            seen = len(probes.outcomes)  # read slowly: let probes pass between two reads
            await wait_until(lambda: len(probes.outcomes) > seen, "a probe while the caller dawdles")
    assert got == [0, 1, 2, 3]  # no probe among the chunks, the sequence unbroken
    assert handler.is_finished and not handler.is_cancelled
    assert len(probes.outcomes) >= 8 and "alive" in probes.outcomes, probes.outcomes
    assert not CALLER_GONE & set(probes.outcomes), probes.outcomes
    await wait_until(lambda: not server.serving.num_probing, "the probe task ended with the stream")


async def _plain_stream(client, headers: dict[str, str], request: bytes = b'{"data": "eA==", "count": 0}'):
    """A third-party client: a plain subscription on an exact inbox that never answers a probe.
    Returns the queue its messages land in."""
    messages: asyncio.Queue = asyncio.Queue()
    inbox = client.transport.new_inbox()

    async def on_message(raw) -> None:
        await messages.put(raw)

    await client.transport.subscribe(inbox, on_message)
    await client.transport.publish(DEBUG_STREAM.template, request,
                                   {"Content-Type": "application/json", **headers}, reply=inbox)
    return messages


async def _read_to_end(messages: asyncio.Queue) -> tuple[list[str], list[int]]:
    """Every message's Kvbus-Stream up to the end one, and the Kvbus-Seq of those that are not probes."""
    kinds, seqs = [], []
    while not kinds or kinds[-1] != "end":
        raw = await asyncio.wait_for(messages.get(), WAIT_S)
        kinds.append(header(raw, STREAM_HEADER))
        if kinds[-1] != PROBE:
            seqs.append(int(header(raw, SEQ_HEADER)))
        else:
            assert raw.data == b"" and raw.reply  # a request: it may be answered, and here is not
    return kinds, seqs


async def test_a_client_that_did_not_ask_for_probes_gets_none(buses):
    """Nothing a client did not ask for reaches its inbox: while a stream that asked (our bus's) is
    probed three rounds, a plain client's stream beside it, on the same server, gets only its chunks."""
    server, client = buses
    probes = ProbeLog(server)

    async def after_a_probe_round(i: int) -> None:  # the plain stream outlives three probe rounds
        await wait_until(lambda: len(probes.outcomes) >= i, f"probe round {i}")

    plain_handler = Endless(num_chunks=3, gate=after_a_probe_round)
    await server.serve(DEBUG_STREAM, lambda req: plain_handler(req) if req.count == 0 else Endless()(req))
    async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x", count=1)) as probed:  # asks for probes
        assert (await anext(probed)).index == 0
        kinds, seqs = await _read_to_end(await _plain_stream(client, {}))
    assert kinds == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]  # no probe among them
    assert plain_handler.is_finished and not plain_handler.is_cancelled
    assert len(probes.outcomes) >= 3 and set(probes.outcomes) <= {"alive", "Timeout"}, probes.outcomes


async def test_a_client_that_asked_but_never_answers_gets_every_chunk_and_is_never_cancelled(buses):
    """Kvbus-Probe: accept, then silence: probes arrive between the chunks, and silence means alive."""
    server, client = buses
    probes = ProbeLog(server)

    async def after_a_probe_timed_out(i: int) -> None:
        await wait_until(lambda: probes.outcomes.count("Timeout") >= i, f"probe timeout #{i}")

    handler = Endless(num_chunks=3, gate=after_a_probe_timed_out)
    await server.serve(DEBUG_STREAM, handler)
    kinds, seqs = await _read_to_end(await _plain_stream(client, {PROBE_HEADER: PROBE_ACCEPT}))
    assert kinds.count(PROBE) >= 3
    assert [k for k in kinds if k != PROBE] == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]
    assert handler.is_finished and not handler.is_cancelled
    assert "NoResponders" not in probes.outcomes and "gone" not in probes.outcomes


async def test_probes_never_reach_a_bus_caller_as_chunks(buses):
    server, client = buses
    probes = ProbeLog(server)
    handler = Endless()  # a chunk every 10 ms, many between two probes
    await server.serve(DEBUG_STREAM, handler)
    got = []
    async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x")) as chunks:
        async for chunk in chunks:
            assert isinstance(chunk, EchoChunk) and chunk.data == b"x"
            got.append(chunk.index)
            if probes.outcomes.count("alive") >= 5:
                break
    assert got == list(range(len(got))) and "alive" in probes.outcomes
    assert not CALLER_GONE & set(probes.outcomes), probes.outcomes
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled by the CancelEvent")


async def test_a_caller_that_only_looked_gone_learns_at_once(buses):
    """A probe that lands while the caller reconnects finds no responders: the stream is cancelled, and
    its last word, unavailable, reaches the caller once it is back, instead of a stall."""
    server, client = buses

    async def in_the_reconnect_gap(subject, data, headers, timeout):
        raise NoResponders("nobody is listening (a reconnect's gap)")

    server.transport.request = in_the_reconnect_gap
    handler = Endless()
    await server.serve(DEBUG_STREAM, handler)
    got = []
    with pytest.raises(Unavailable, match="looked gone"):
        async with client.stream(DEBUG_STREAM, EchoRequest()) as chunks:
            async for chunk in chunks:
                got.append(chunk.index)
    assert handler.is_cancelled and got == list(range(len(got)))


async def test_probing_off_and_bad_intervals():
    network = MemoryNetwork()
    server = memory_bus(network, probe_interval=0)
    client = memory_bus(network)
    probes = ProbeLog(server)
    await server.serve(DEBUG_STREAM, Endless(num_chunks=3))
    async with client.stream(DEBUG_STREAM, EchoRequest()) as chunks:
        assert [c.index async for c in chunks] == [0, 1, 2]
    assert probes.outcomes == [] and not server.serving.num_probing
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="probe_interval"):
            memory_bus(network, probe_interval=bad)
    await server.close()
    await client.close()
