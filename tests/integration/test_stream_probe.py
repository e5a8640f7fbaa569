"""The interest probe of streamed replies (bus/core.py, "Interest probes"), checked on the in-memory bus
and on a real nats-server alike (like tests/integration/test_bus_wire.py): every test runs once per bus.

A streaming server asks its caller's inbox every ``probe_interval`` seconds whether anyone still
reads, if that caller asked for probes (``Kvbus-Probe: accept``; our bus's streams do): a caller whose
connection is gone (no responders) or who dropped the stream without closing it (answers ``gone``)
has its handler cancelled; a live caller, however slow, and a plain client that asked and never
answers are never cancelled and get every chunk in order, no probe ever shows up as a chunk, and a
client that did not ask gets none. The real engine freeing its pages when the caller goes:
tests/integration/test_stream_probe_engine.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from bus.core import NO_RESPONDERS, PROBE_TIMEOUT, SEQ_HEADER, STATUS_HEADER, STREAM_HEADER, Bus
from bus.errors import NoResponders, Timeout, Unavailable
from bus.memory import MemoryNetwork, MemoryTransport, memory_bus
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_STREAM
from bus.transport import PROBE, PROBE_ACCEPT, PROBE_HEADER
from schemas.common import EchoChunk, EchoRequest
from tests.probing import CALLER_GONE, WAIT_S, Endless, ProbeLog, open_stream, wait_until

pytestmark = pytest.mark.anyio
INTERVAL = 0.2
"""Seconds between probes of the buses a test makes (the stricter of the two old modules' 0.2 and 0.3 s)."""
PLAIN_REQUEST = b'{"data": "eA==", "count": 0}'
"""A plain client's DEBUG_STREAM request: bare JSON, as from any language (count 0 tells it from our bus's)."""


class Buses:
    """Connected buses on one network, one per simulated process, each on its own connection: the
    in-memory network or a real nats-server. Calling it makes a bus whose streams probe their callers
    every ``probe_interval`` seconds (``INTERVAL`` unless told otherwise)."""

    def __init__(self, kind: str, nats_url: str | None = None):
        self.kind = kind
        self.nats_url = nats_url
        self.network = MemoryNetwork() if kind == "memory" else None
        self.created: list[Bus] = []

    async def __call__(self, probe_interval: float = INTERVAL) -> Bus:
        if self.network is not None:
            bus = memory_bus(self.network, default_timeout=WAIT_S, probe_interval=probe_interval)
        else:  # BusConfig refuses a bad probe_interval before connecting
            bus = await connect(BusConfig(nats_url=self.nats_url, request_timeout=WAIT_S,
                                          probe_interval=probe_interval))
        self.created.append(bus)
        return bus

    async def lose_connection(self, bus: Bus) -> None:
        """The process is as good as gone: no CancelEvent, nobody subscribes to its inbox any more."""
        if self.network is not None:
            await bus.close()  # the memory transport drops every subscription at once
        else:
            await bus.transport.nc.close()  # no drain, no goodbye

    async def plain_stream(self, headers: dict[str, str]) -> tuple[list[str], list[int]]:
        """A third-party client's stream of DEBUG_STREAM on its own connection: a plain subscription on an
        exact inbox that never answers a probe, a request with only ``headers`` (none when empty). Returns
        every message's Kvbus-Stream up to the end one, and the Kvbus-Seq of those that are not probes.

        NOTE: the one part of a test that differs per network, because a plain client does: on NATS a
        nats-py connection (no kvbus code between it and the wire), on the in-memory network a bare
        MemoryTransport (the in-memory network has no other client).
        """
        if self.network is not None:
            transport = MemoryTransport(self.network)
            messages: asyncio.Queue = asyncio.Queue()
            inbox = transport.new_inbox()

            async def on_message(raw) -> None:
                await messages.put(raw)

            await transport.subscribe(inbox, on_message)

            async def send() -> None:
                await transport.publish(DEBUG_STREAM.template, PLAIN_REQUEST, headers or None, reply=inbox)

            async def next_msg() -> tuple[dict[str, str], bytes, str | None]:
                raw = await asyncio.wait_for(messages.get(), WAIT_S)
                return raw.headers or {}, raw.data, raw.reply

            close = transport.close
        else:
            import nats

            nc = await nats.connect(self.nats_url)
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)

            async def send() -> None:
                await nc.publish(DEBUG_STREAM.template, PLAIN_REQUEST, reply=inbox, headers=headers or None)

            async def next_msg() -> tuple[dict[str, str], bytes, str | None]:
                msg = await sub.next_msg(timeout=WAIT_S)
                return msg.headers or {}, msg.data, msg.reply or None

            close = nc.close
        try:
            await send()
            kinds, seqs = [], []
            while not kinds or kinds[-1] != "end":
                got_headers, data, reply = await next_msg()
                if not kinds and got_headers.get(STATUS_HEADER) == NO_RESPONDERS:  # see open_stream's NOTE
                    await send()
                    continue
                kinds.append(got_headers.get(STREAM_HEADER))
                if kinds[-1] == PROBE:
                    assert data == b"" and reply  # a request: it may be answered, and here is not
                else:
                    seqs.append(int(got_headers[SEQ_HEADER]))
            return kinds, seqs
        finally:
            await close()


@pytest.fixture(params=["memory", "nats"])
async def buses(request):
    """A factory of connected buses on the in-memory network, or on a real nats-server (``nats_url``)."""
    made = Buses("memory") if request.param == "memory" else Buses("nats", request.getfixturevalue("nats_url"))
    yield made
    for bus in made.created:
        await bus.close()


async def serve(bus: Bus, handler) -> None:
    await bus.serve(DEBUG_STREAM, handler)
    await bus.flush()  # the subscription is on the server before anyone calls


async def test_a_caller_whose_connection_closed_is_cancelled(buses, caplog):
    server, client = await buses(), await buses()
    probes = ProbeLog(server)
    handler = Endless()
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    assert first.index == 0
    with caplog.at_level(logging.INFO, logger="bus.core"):
        await buses.lose_connection(client)
        t0 = time.monotonic()
        await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
        took = time.monotonic() - t0
        await wait_until(lambda: server.num_inflight == 0, "the handler task done")
    assert "NoResponders" in probes.outcomes
    assert took < INTERVAL + PROBE_TIMEOUT + 10, took
    gone = [r for r in caplog.records if "caller is gone" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and stream.request_id in gone[0].getMessage()
    assert server.serving.is_idle  # no task, no probe, and no reason a task ended, is remembered


async def test_a_stream_dropped_without_aclose_is_cancelled_by_the_gone_answer(buses):
    server, client = await buses(), await buses()
    probes = ProbeLog(server)
    handler = Endless()
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    assert [first.index] + [(await anext(stream)).index for _ in range(2)] == [0, 1, 2]
    assert len(client._pending) == 1
    del stream  # no aclose(): no CancelEvent; only the probe can tell
    gc.collect()
    assert not client._pending  # the dropped stream's token is forgotten (it no longer gathers chunks)
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
    assert probes.outcomes[-1] == "gone" and "NoResponders" not in probes.outcomes
    await wait_until(lambda: server.num_inflight == 0, "the handler task done")
    assert not client._pending


async def test_a_live_caller_that_reads_slowly_is_not_cancelled_and_sees_no_probe(buses):
    server, client = await buses(), await buses()
    probes = ProbeLog(server)

    async def after_two_more_probes(i: int) -> None:  # each chunk outlives two probe rounds
        await wait_until(lambda: len(probes.outcomes) >= 2 * i, f"probe round {2 * i}")

    async def dawdle() -> None:  # read slowly: let probes pass between two reads
        seen = len(probes.outcomes)
        await wait_until(lambda: len(probes.outcomes) > seen, "a probe while the caller dawdles")

    handler = Endless(num_chunks=4, gate=after_two_more_probes)
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    got = [first.index]
    await dawdle()
    async with stream:
        async for chunk in stream:
            got.append(chunk.index)
            await dawdle()
    assert got == [0, 1, 2, 3]  # every chunk, in order: no probe among them, the sequence unbroken
    assert handler.is_finished and not handler.is_cancelled
    assert len(probes.outcomes) >= 8 and "alive" in probes.outcomes, probes.outcomes
    assert not CALLER_GONE & set(probes.outcomes), probes.outcomes
    await wait_until(lambda: not server.serving.num_probing, "the probe task ended with the stream")


async def test_a_client_that_did_not_ask_for_probes_gets_none(buses):
    """Nothing a client did not ask for reaches its inbox: while a stream that asked (our bus's) is
    probed three rounds, a plain client's stream beside it, on the same server, gets only its chunks."""
    server, client = await buses(), await buses()
    probes = ProbeLog(server)

    async def after_a_probe_round(i: int) -> None:  # the plain stream outlives three probe rounds
        await wait_until(lambda: len(probes.outcomes) >= i, f"probe round {i}")

    plain_handler = Endless(num_chunks=3, gate=after_a_probe_round)
    await serve(server, lambda req: plain_handler(req) if req.count == 0 else Endless()(req))
    probed, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x", count=1))  # asks for probes
    assert first.index == 0
    async with probed:
        kinds, seqs = await buses.plain_stream({})
    assert kinds == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]  # no probe among them
    assert plain_handler.is_finished and not plain_handler.is_cancelled
    assert len(probes.outcomes) >= 3 and set(probes.outcomes) <= {"alive", "Timeout"}, probes.outcomes


async def test_a_client_that_asked_but_never_answers_gets_every_chunk_and_is_never_cancelled(buses):
    """Kvbus-Probe: accept, then silence: probes arrive between the chunks, and silence means alive."""
    server = await buses()
    probes = ProbeLog(server)

    async def after_a_probe_timed_out(i: int) -> None:
        await wait_until(lambda: probes.outcomes.count("Timeout") >= i, f"probe timeout #{i}")

    handler = Endless(num_chunks=3, gate=after_a_probe_timed_out)
    await serve(server, handler)
    kinds, seqs = await buses.plain_stream({PROBE_HEADER: PROBE_ACCEPT})
    assert kinds.count(PROBE) >= 3
    assert [k for k in kinds if k != PROBE] == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]
    assert handler.is_finished and not handler.is_cancelled
    assert "NoResponders" not in probes.outcomes and "gone" not in probes.outcomes


async def test_probes_never_reach_a_bus_caller_as_chunks(buses):
    server, client = await buses(), await buses()
    probes = ProbeLog(server)
    handler = Endless()  # a chunk every 10 ms, many between two probes
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    got, chunk = [], first
    async with stream:
        while True:
            assert isinstance(chunk, EchoChunk) and chunk.data == b"x"
            got.append(chunk.index)
            if probes.outcomes.count("alive") >= 5:
                break
            chunk = await anext(stream)
    assert got == list(range(len(got))) and "alive" in probes.outcomes
    assert not CALLER_GONE & set(probes.outcomes), probes.outcomes
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled by the CancelEvent")


async def test_a_caller_that_only_looked_gone_learns_at_once(buses):
    """A probe that lands while the caller reconnects finds no responders: the stream is cancelled, and
    its last word, unavailable, reaches the caller once it is back, instead of a stall."""
    server, client = await buses(), await buses()

    async def in_the_reconnect_gap(subject, data, headers, timeout):
        raise NoResponders("nobody is listening (a reconnect's gap)")

    server.transport.request = in_the_reconnect_gap
    handler = Endless()
    await serve(server, handler)
    got = []
    with pytest.raises(Unavailable, match="looked gone"):
        stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest())
        got.append(first.index)
        async with stream:
            async for chunk in stream:
                got.append(chunk.index)
    assert handler.is_cancelled and got == list(range(len(got)))


async def test_probing_off_and_bad_intervals(buses):
    server, client = await buses(probe_interval=0), await buses()
    probes = ProbeLog(server)
    await serve(server, Endless(num_chunks=3))
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest())
    async with stream:
        assert [first.index] + [c.index async for c in stream] == [0, 1, 2]
    assert probes.outcomes == [] and not server.serving.num_probing
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="probe_interval"):
            await buses(probe_interval=bad)


async def test_transport_request_tells_no_responders_from_silence(buses):
    """The probe's one transport method: a reply, NoResponders, or Timeout."""
    server, client = await buses(), await buses()
    subject = server.transport.new_inbox()
    silent = server.transport.new_inbox()

    async def answer(raw) -> None:
        await server.transport.publish(raw.reply, raw.data[::-1], {STREAM_HEADER: "alive"})

    async def ignore(raw) -> None:
        return None

    await server.transport.subscribe(subject, answer)
    await server.transport.subscribe(silent, ignore)
    await server.transport.flush()
    deadline = time.monotonic() + WAIT_S
    while True:  # see open_stream's NOTE: wait until the subscriptions are visible
        try:
            reply = await client.transport.request(subject, b"abc", {STREAM_HEADER: PROBE}, 5.0)
            break
        except NoResponders:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    assert reply.data == b"cba" and reply.headers[STREAM_HEADER] == "alive"
    with pytest.raises(NoResponders):
        await client.transport.request(subject + ".nobody", b"", None, 5.0)
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        await client.transport.request(silent, b"", None, 0.3)
    assert time.monotonic() - t0 >= 0.25  # it waited (the loop may fire a hair early)
    if buses.network is not None:  # only the in-memory network shows its subscriptions
        await server.close()
        await client.close()
        assert not buses.network.subscriptions  # the request's own inbox was let go
