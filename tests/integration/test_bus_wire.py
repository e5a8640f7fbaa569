"""The bus contract, checked on the in-memory bus and on a real nats-server alike."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus import errors
from bus.codec import CONTENT_TYPE_HEADER
from bus.core import REQUEST_ID_HEADER, Bus
from bus.memory import MemoryNetwork, memory_bus
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_ECHO, DEBUG_STREAM, HEALTH
from schemas.common import EchoChunk, EchoReply, EchoRequest, HealthReply, HealthRequest

pytestmark = pytest.mark.anyio

ERRORS = {
    b"invalid_argument": errors.InvalidArgument,
    b"not_found": errors.NotFound,
    b"overloaded": errors.Overloaded,
    b"cancelled": errors.Cancelled,
    b"timeout": errors.Timeout,
    b"unavailable": errors.Unavailable,
    b"internal": errors.Internal,
}


@pytest.fixture(params=["memory", "nats"])
async def make_bus(request):
    """A factory of connected buses (one per simulated process) on one network."""
    created: list[Bus] = []
    if request.param == "memory":
        network = MemoryNetwork()

        async def make() -> Bus:
            bus = memory_bus(network, default_timeout=5.0)
            created.append(bus)
            return bus
    else:
        url = request.getfixturevalue("nats_url")

        async def make() -> Bus:
            bus = await connect(BusConfig(nats_url=url, request_timeout=5.0))
            created.append(bus)
            return bus

    yield make
    for bus in created:
        await bus.close()


async def echo(req: EchoRequest) -> EchoReply:
    if req.data in ERRORS:
        raise ERRORS[req.data](f"asked for {req.data.decode()}")
    if req.data == b"crash":
        raise ZeroDivisionError("handler bug")
    return EchoReply(data=req.data)


async def stream(req: EchoRequest):
    for i in range(req.count):
        if req.data == b"stall" and i == 2:
            await asyncio.sleep(30)
        yield EchoChunk(index=i, data=req.data)


async def settle(bus: Bus) -> None:
    await bus.transport.flush()
    await asyncio.sleep(0.02)


async def test_request_reply_roundtrip(make_bus):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    payload = bytes(range(256)) * 256  # 64 KiB, binary
    assert (await client.request(DEBUG_ECHO, EchoRequest(data=payload))).data == payload


@pytest.mark.parametrize("code", sorted(ERRORS))
async def test_every_error_code_crosses_the_wire(make_bus, code):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    with pytest.raises(ERRORS[code]) as info:
        await client.request(DEBUG_ECHO, EchoRequest(data=code))
    assert info.value.code.value == code.decode()
    assert info.value.message == f"asked for {code.decode()}"


async def test_handler_exception_answers_internal_and_service_survives(make_bus):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    with pytest.raises(errors.Internal) as info:
        await client.request(DEBUG_ECHO, EchoRequest(data=b"crash"), headers={REQUEST_ID_HEADER: "req-42"})
    assert "req-42" in info.value.message
    assert "ZeroDivision" not in info.value.message  # no repr(exc) on the wire
    assert (await client.request(DEBUG_ECHO, EchoRequest(data=b"ok"))).data == b"ok"


async def test_malformed_payload_is_invalid_argument(make_bus):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    replies: asyncio.Queue = asyncio.Queue()
    inbox = client.transport.new_inbox()

    async def on_reply(raw):
        await replies.put(raw)

    await client.transport.subscribe(inbox, on_reply)
    await settle(client)
    for body, ctype in [(b"{not json", "application/json"), (b'{"data": 5}', "application/json"),
                        (b"\xc1", "application/msgpack"), (b"{}", "text/plain")]:
        await client.transport.publish(DEBUG_ECHO.template, body, {CONTENT_TYPE_HEADER: ctype}, reply=inbox)
        raw = await asyncio.wait_for(replies.get(), 5)
        assert raw.headers["Kvbus-Error-Code"] == "invalid_argument", body
    assert (await client.request(DEBUG_ECHO, EchoRequest(data=b"still up"))).data == b"still up"


async def test_json_from_any_language_without_headers(make_bus):
    """A client that sends bare JSON (no headers at all) still gets a JSON reply."""
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    replies: asyncio.Queue = asyncio.Queue()
    inbox = client.transport.new_inbox()

    async def on_reply(raw):
        await replies.put(raw)

    await client.transport.subscribe(inbox, on_reply)
    await settle(client)
    await client.transport.publish(DEBUG_ECHO.template, b'{"data": "aGk="}', None, reply=inbox)
    raw = await asyncio.wait_for(replies.get(), 5)
    assert msgspec.json.decode(raw.data) == {"data": "aGk="}


async def test_no_responders_is_unavailable(make_bus):
    client = await make_bus()
    with pytest.raises(errors.Unavailable):
        await client.request(DEBUG_ECHO, EchoRequest(data=b"x"), timeout=2)


async def test_request_timeout(make_bus):
    server, client = await make_bus(), await make_bus()

    async def slow(req):
        await asyncio.sleep(5)
        return EchoReply()

    await server.serve(DEBUG_ECHO, slow)
    await settle(server)
    with pytest.raises(errors.Timeout):
        await client.request(DEBUG_ECHO, EchoRequest(), timeout=0.3)


async def test_stream_order_and_end(make_bus):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_STREAM, stream)
    await settle(server)
    async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x", count=500)) as chunks:
        got = [c.index async for c in chunks]
    assert got == list(range(500))
    async with client.stream(DEBUG_STREAM, EchoRequest(data=b"x", count=0)) as chunks:
        assert [c async for c in chunks] == []


async def test_stream_stall_times_out_and_cancels_server_side(make_bus):
    server, client = await make_bus(), await make_bus()
    cancelled = asyncio.Event()

    async def stalling(req: EchoRequest):
        try:
            yield EchoChunk(index=0)
            await asyncio.sleep(30)
            yield EchoChunk(index=1)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await server.serve(DEBUG_STREAM, stalling)
    await settle(server)
    got = []
    with pytest.raises(errors.Timeout):
        async with client.stream(DEBUG_STREAM, EchoRequest(count=2), timeout=0.5) as chunks:
            async for chunk in chunks:
                got.append(chunk.index)
    assert got == [0]
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_stream_error_mid_way(make_bus):
    server, client = await make_bus(), await make_bus()

    async def failing(req: EchoRequest):
        yield EchoChunk(index=0)
        raise errors.Overloaded("out of pages")

    await server.serve(DEBUG_STREAM, failing)
    await settle(server)
    got = []
    with pytest.raises(errors.Overloaded, match="out of pages"):
        async with client.stream(DEBUG_STREAM, EchoRequest(count=3)) as chunks:
            async for chunk in chunks:
                got.append(chunk.index)
    assert got == [0]


async def test_client_leaving_a_stream_cancels_the_handler(make_bus):
    server, client = await make_bus(), await make_bus()
    cancelled = asyncio.Event()

    async def endless(req: EchoRequest):
        try:
            i = 0
            while True:
                yield EchoChunk(index=i)
                i += 1
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await server.serve(DEBUG_STREAM, endless)
    await settle(server)
    async with client.stream(DEBUG_STREAM, EchoRequest()) as chunks:
        async for chunk in chunks:
            if chunk.index == 3:
                break
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_a_cancel_that_lands_with_a_chunk_still_cancels_the_reader(make_bus):
    """Python 3.11's asyncio.wait_for returns the result when a cancel lands in the tick the result
    does, and the cancel is lost: a gateway told to stop as a worker's chunk came in streamed on."""
    server, client = await make_bus(), await make_bus()

    async def stalling(req: EchoRequest):
        yield EchoChunk(index=0)
        await asyncio.sleep(30)

    await server.serve(DEBUG_STREAM, stalling)
    await settle(server)
    async with client.stream(DEBUG_STREAM, EchoRequest(count=2)) as chunks:
        assert (await anext(chunks)).index == 0
        reader = asyncio.create_task(anext(chunks))
        while not chunks._queue._getters:  # until the reader waits on the stream (one loop tick)
            await asyncio.sleep(0)
        chunks.abort(errors.Unavailable("comes in the tick the cancel does"))
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader


async def test_a_cancel_that_lands_with_the_reply_still_cancels_the_caller(make_bus):
    server, client = await make_bus(), await make_bus()
    await server.serve(DEBUG_ECHO, echo)
    await settle(server)
    calls: list[asyncio.Task] = []
    deliver = client._on_reply  # bound by the first request: every reply of this bus comes through it

    async def deliver_then_cancel(raw):
        await deliver(raw)
        calls[-1].cancel()  # in the tick the reply landed in, before the caller runs again

    client._on_reply = deliver_then_cancel
    calls.append(asyncio.create_task(client.request(DEBUG_ECHO, EchoRequest(data=b"x"))))
    with pytest.raises(asyncio.CancelledError):
        await calls[-1]


async def test_queue_group_shares_load(make_bus):
    client = await make_bus()
    counts: Counter = Counter()
    for name in ("a", "b", "c"):
        bus = await make_bus()

        async def handler(req: EchoRequest, name=name) -> EchoReply:
            counts[name] += 1
            return EchoReply(data=name.encode())

        await bus.serve(DEBUG_ECHO, handler)
        await settle(bus)
    await asyncio.gather(*(client.request(DEBUG_ECHO, EchoRequest()) for _ in range(300)))
    assert sum(counts.values()) == 300  # each request handled exactly once
    assert len(counts) == 3 and min(counts.values()) >= 30, counts


async def test_no_queue_group_every_replica_answers(make_bus):
    """Health has no queue group: a broadcast reaches every replica."""
    client = await make_bus()
    seen: list[str] = []
    for wid in ("w1", "w2"):
        bus = await make_bus()

        async def health(req: HealthRequest, wid=wid) -> HealthReply:
            seen.append(wid)
            return HealthReply(role="tokenizer", worker_id=wid, ready=True, version="0", uptime_s=0)

        await bus.serve(HEALTH, health, queue=False, role="tokenizer")
        await settle(bus)
    reply = await client.request(HEALTH, HealthRequest(), role="tokenizer")
    assert reply.worker_id in ("w1", "w2")
    for _ in range(200):  # the other replica's answer may still be on its way
        if len(seen) == 2:
            break
        await asyncio.sleep(0.02)
    assert sorted(seen) == ["w1", "w2"]


async def test_trace_context_survives_two_hops(make_bus):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    import bus.tracing as tracing_module

    original = tracing_module._tracer
    tracing_module._tracer = tracer  # the provider is local to this test
    try:
        front, back, client = await make_bus(), await make_bus(), await make_bus()

        async def back_handler(req: HealthRequest) -> HealthReply:
            return HealthReply(role="back", worker_id="b", ready=True, version="0", uptime_s=0)

        async def front_handler(req: EchoRequest) -> EchoReply:
            reply = await front.request(HEALTH, HealthRequest(), role="back")  # hop 2
            return EchoReply(data=reply.role.encode())

        await back.serve(HEALTH, back_handler, queue=False, role="back")
        await front.serve(DEBUG_ECHO, front_handler)
        await settle(back)
        await settle(front)
        with tracer.start_as_current_span("client-root") as root:
            assert (await client.request(DEBUG_ECHO, EchoRequest())).data == b"back"
            trace_id = root.get_span_context().trace_id
        await asyncio.sleep(0.1)
    finally:
        tracing_module._tracer = original
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == trace.SpanKind.SERVER]
    assert {s.name for s in servers} == {DEBUG_ECHO.template, HEALTH.template}
    assert all(s.context.trace_id == trace_id for s in spans), [s.name for s in spans]
    by_id = {s.context.span_id: s for s in spans}
    back_span = next(s for s in servers if s.name == HEALTH.template)
    # back's server span -> front's client span -> front's server span -> client span -> root
    chain = []
    span = back_span
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span.name)
    assert chain[-1] == "client-root" and DEBUG_ECHO.template in chain


async def test_caller_giving_up_on_a_request_cancels_the_handler(make_bus):
    server, client = await make_bus(), await make_bus()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(req: EchoRequest) -> EchoReply:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return EchoReply()

    await server.serve(DEBUG_ECHO, slow)
    await settle(server)
    call = asyncio.create_task(client.request(DEBUG_ECHO, EchoRequest()))
    await asyncio.wait_for(started.wait(), 5)
    call.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)
    # a timeout cancels the server's work the same way
    started.clear(), cancelled.clear()
    with pytest.raises(errors.Timeout):
        await client.request(DEBUG_ECHO, EchoRequest(), timeout=0.3)
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_shutdown_answers_in_flight_callers_unavailable(make_bus):
    """A server that drains past its timeout tells its callers, so they retry elsewhere at once."""
    server, client = await make_bus(), await make_bus()

    async def stuck(req: EchoRequest) -> EchoReply:
        await asyncio.sleep(60)
        return EchoReply()

    await server.serve(DEBUG_ECHO, stuck)
    await settle(server)
    call = asyncio.create_task(client.request(DEBUG_ECHO, EchoRequest(), timeout=30))
    for _ in range(500):  # the request is in the handler before the drain starts
        if server.num_inflight:
            break
        await asyncio.sleep(0.01)
    await server.drain(timeout=0.2)
    with pytest.raises(errors.Unavailable, match="shutting down"):
        await asyncio.wait_for(call, 5)
