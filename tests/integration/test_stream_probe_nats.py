"""The interest probe of streamed replies on a real nats-server (bus/core.py, "Interest probes").

A caller whose NATS connection closes mid-stream (no CancelEvent: "no responders" on its inbox) or
who drops its stream without closing it (its bus answers ``gone``) has the generation cancelled and,
with the real engine, every KV page freed; a live caller that reads slowly and a plain nats-py
subscriber that asked for probes and never answers are never cancelled and get every chunk in order;
one that did not ask (no ``Kvbus-Probe: accept``) gets no probe at all.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid

import pytest

from bus.core import NO_RESPONDERS, PROBE_TIMEOUT, SEQ_HEADER, STATUS_HEADER, STREAM_HEADER
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_STREAM, WORKER_GENERATE
from bus.transport import PROBE, PROBE_ACCEPT, PROBE_HEADER
from schemas.common import EchoRequest
from schemas.engine import SamplingParams
from schemas.worker import WorkerGenerateRequest
from tests.probing import CALLER_GONE, WAIT_S, Endless, ProbeLog, open_stream, wait_until
from tests.leaks import Snapshot

pytestmark = pytest.mark.anyio
INTERVAL = 0.3
WORKER_ID = "probe-worker-0"
LONG = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)  # minutes of decoding on a CPU
PROMPT = list(range(1000, 1040))


@pytest.fixture
async def make_bus(nats_url):
    """Connected buses, one per simulated process, each on its own NATS connection."""
    created = []

    async def make(**kwargs):
        bus = await connect(BusConfig(nats_url=nats_url, request_timeout=WAIT_S, **kwargs))
        created.append(bus)
        return bus

    yield make
    for bus in created:
        await bus.close()


async def serve(bus, handler) -> None:
    await bus.serve(DEBUG_STREAM, handler)
    await bus.flush()  # the subscription is on the server before anyone calls


async def test_a_caller_whose_nats_connection_closed_is_cancelled(make_bus):
    server, client = await make_bus(probe_interval=INTERVAL), await make_bus()
    probes = ProbeLog(server)
    handler = Endless()
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    assert first.index == 0
    await client.transport.nc.close()  # the process is as good as gone: no CancelEvent, no inbox
    t0 = time.monotonic()
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
    assert time.monotonic() - t0 < INTERVAL + PROBE_TIMEOUT + 10
    assert "NoResponders" in probes.outcomes
    await wait_until(lambda: server.num_inflight == 0 and not server.serving.num_probing, "handler and probe done")


async def test_a_stream_dropped_without_aclose_is_cancelled(make_bus):
    server, client = await make_bus(probe_interval=INTERVAL), await make_bus()
    probes = ProbeLog(server)
    handler = Endless()
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    assert [first.index] + [(await anext(stream)).index for _ in range(2)] == [0, 1, 2]
    del stream
    gc.collect()
    await wait_until(lambda: handler.is_cancelled, "the handler cancelled")
    assert probes.outcomes[-1] == "gone" and "NoResponders" not in probes.outcomes
    assert not client._pending


async def test_a_live_caller_that_reads_slowly_is_not_cancelled(make_bus):
    server, client = await make_bus(probe_interval=INTERVAL), await make_bus()
    probes = ProbeLog(server)

    async def after_two_more_probes(i: int) -> None:
        await wait_until(lambda: len(probes.outcomes) >= 2 * i, f"probe round {2 * i}")

    handler = Endless(num_chunks=4, gate=after_two_more_probes)
    await serve(server, handler)
    stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x"))
    got = [first.index]
    async with stream:
        async for chunk in stream:
            got.append(chunk.index)
            seen = len(probes.outcomes)
            await wait_until(lambda: len(probes.outcomes) > seen, "a probe while the caller dawdles")
    assert got == [0, 1, 2, 3]  # every chunk, in order, and no probe among them
    assert handler.is_finished and not handler.is_cancelled
    assert "alive" in probes.outcomes and not CALLER_GONE & set(probes.outcomes), probes.outcomes


async def _plain_stream(nc, headers: dict[str, str]) -> tuple[list[str], list[int]]:
    """A plain nats-py client's stream of DEBUG_STREAM (it never answers a probe): every message's
    Kvbus-Stream up to the end one, and the Kvbus-Seq of those that are not probes."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = b'{"data": "eA==", "count": 0}'
    await nc.publish(DEBUG_STREAM.template, body, reply=inbox, headers=headers or None)
    kinds, seqs = [], []
    while not kinds or kinds[-1] != "end":
        msg = await sub.next_msg(timeout=WAIT_S)
        if not kinds and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS:  # see open_stream's NOTE
            await nc.publish(DEBUG_STREAM.template, body, reply=inbox, headers=headers or None)
            continue
        kinds.append(msg.headers.get(STREAM_HEADER))
        if kinds[-1] == PROBE:
            assert msg.data == b"" and msg.reply
        else:
            seqs.append(int(msg.headers[SEQ_HEADER]))
    await sub.unsubscribe()
    return kinds, seqs


async def test_a_plain_nats_subscriber_that_did_not_ask_gets_no_probe(make_bus, nats_url):
    """While our bus's stream (it asks for probes) is probed three rounds, a plain client's stream beside it,
    on the same server, gets only its chunks."""
    import nats

    server, client = await make_bus(probe_interval=INTERVAL), await make_bus()
    probes = ProbeLog(server)

    async def after_a_probe_round(i: int) -> None:
        await wait_until(lambda: len(probes.outcomes) >= i, f"probe round {i}")

    plain_handler = Endless(num_chunks=3, gate=after_a_probe_round)
    await serve(server, lambda req: plain_handler(req) if req.count == 0 else Endless()(req))
    nc = await nats.connect(nats_url)
    try:
        stream, first = await open_stream(client, DEBUG_STREAM, EchoRequest(data=b"x", count=1))
        async with stream:
            kinds, seqs = await _plain_stream(nc, {})
    finally:
        await nc.close()
    assert kinds == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]  # no probe among them
    assert plain_handler.is_finished and not plain_handler.is_cancelled
    assert len(probes.outcomes) >= 3 and set(probes.outcomes) <= {"alive", "Timeout"}, probes.outcomes


async def test_a_plain_nats_subscriber_that_asked_but_never_answers_gets_every_chunk(make_bus, nats_url):
    import nats

    server = await make_bus(probe_interval=INTERVAL)
    probes = ProbeLog(server)

    async def after_a_probe_timed_out(i: int) -> None:
        await wait_until(lambda: probes.outcomes.count("Timeout") >= i, f"probe timeout #{i}")

    handler = Endless(num_chunks=3, gate=after_a_probe_timed_out)
    await serve(server, handler)
    nc = await nats.connect(nats_url)
    try:
        kinds, seqs = await _plain_stream(nc, {PROBE_HEADER: PROBE_ACCEPT})
    finally:
        await nc.close()
    assert kinds.count(PROBE) >= 3
    assert [k for k in kinds if k != PROBE] == ["chunk"] * 3 + ["end"] and seqs == [0, 1, 2, 3]
    assert handler.is_finished and not handler.is_cancelled
    assert "NoResponders" not in probes.outcomes and "gone" not in probes.outcomes


@pytest.mark.parametrize("kind", ["memory", "nats"])
async def test_transport_request_tells_no_responders_from_silence(kind, make_bus):
    """The probe's one transport method, on both transports: a reply, NoResponders, or Timeout."""
    from bus.errors import NoResponders, Timeout
    from bus.memory import MemoryNetwork, memory_bus

    if kind == "memory":
        network = MemoryNetwork()
        server, client = memory_bus(network), memory_bus(network)
    else:
        server, client = await make_bus(), await make_bus()
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
    if kind == "memory":
        await server.close()
        await client.close()
        assert not network.subscriptions  # the request's own inbox was let go


# --- the real engine: the generation is aborted and every page comes back ------------------------------
@pytest.fixture(scope="module")
def engine_config(model_dir):
    from services.workers import WorkerConfig

    return WorkerConfig(model=str(model_dir), kv_cache_memory=0.1, max_running_requests=2, max_queue=1)


@pytest.fixture(scope="module")
def engine(engine_config):
    from services.engine import LLMEngine

    return LLMEngine(engine_config.engine_config)


@pytest.fixture
async def worker(make_bus, engine_config, engine):
    """An aggregated worker with the real engine on its own connection (default probe interval), and
    an observer bus that counts leaks through the worker's health subject."""
    from services.runner import bind_health
    from services.workers.actor import WorkerActor

    server = await make_bus()
    actor = WorkerActor(engine_config, worker_id=WORKER_ID, engine=engine)
    await actor.start(server)
    await bind_health(server, actor)
    await server.flush()
    observer = await make_bus()
    yield actor, observer
    await server.drain(timeout=5)
    await actor.stop()  # stops the engine's async driver; the module reuses the engine


def long_request() -> WorkerGenerateRequest:
    return WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=PROMPT, sampling=LONG)


@pytest.mark.slow
async def test_the_engine_frees_every_page_when_the_callers_connection_closes(worker, make_bus, caplog):
    actor, observer = worker
    snapshot = Snapshot(observer, [("worker", WORKER_ID)])
    client = await make_bus()
    with caplog.at_level(logging.INFO, logger="bus.core"):
        stream, _ = await open_stream(client, WORKER_GENERATE, long_request(), worker_id=WORKER_ID)
        for _ in range(2):
            await anext(stream)
        assert actor.engine.num_running == 1
        await client.transport.nc.close()
        t0 = time.monotonic()
        await snapshot.assert_no_leaks(timeout=WAIT_S)
    took = time.monotonic() - t0
    assert took < actor.bus.probe_interval + PROBE_TIMEOUT + 10, f"pages came back only after {took:.1f}s"
    assert any("caller is gone" in r.getMessage() and stream.request_id in r.getMessage() for r in caplog.records)


@pytest.mark.slow
async def test_the_engine_frees_every_page_when_the_caller_drops_its_stream(worker, make_bus, caplog):
    actor, observer = worker
    snapshot = Snapshot(observer, [("worker", WORKER_ID)])
    client = await make_bus()
    with caplog.at_level(logging.INFO, logger="bus.core"):
        stream, _ = await open_stream(client, WORKER_GENERATE, long_request(), worker_id=WORKER_ID)
        request_id = stream.request_id
        for _ in range(2):
            await anext(stream)
        assert actor.engine.num_running == 1
        del stream  # no aclose(): the caller's bus now answers the probe "gone"
        gc.collect()
        t0 = time.monotonic()
        await snapshot.assert_no_leaks(timeout=WAIT_S)
    took = time.monotonic() - t0
    assert took < actor.bus.probe_interval + PROBE_TIMEOUT + 10, f"pages came back only after {took:.1f}s"
    assert any("no longer reads" in r.getMessage() and request_id in r.getMessage() for r in caplog.records)
    assert not client._pending


# --- deploy/nats/auth.conf: a client with the CLIENT role can answer a probe --------------------------
async def test_a_client_with_the_deploy_client_role_answers_probes(tmp_path):
    """CLIENT may publish on no inbox; ``allow_responses`` lets it answer the probe it got, so a stream
    it dropped is cancelled ("gone"), and one it reads is not ("alive")."""
    import shutil
    from pathlib import Path

    from bus.subjects import GENERATE
    from schemas.generate import GenerateChunk, GenerateRequest
    from services.natsd import local_nats_server

    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")
    shutil.copy(Path(__file__).resolve().parents[2] / "deploy/nats/auth.conf", tmp_path / "auth.conf")
    (tmp_path / "server.conf").write_text("include ./auth.conf\n")
    with local_nats_server("-c", str(tmp_path / "server.conf")) as url:
        service = await connect(BusConfig(nats_url=url, nats_user="kvbus-service", nats_password="CHANGE-ME-service",
                                          probe_interval=INTERVAL))
        client = await connect(BusConfig(nats_url=url, nats_user="kvbus-client", nats_password="CHANGE-ME-client"))
        try:
            probes = ProbeLog(service)
            handlers: list[Endless] = []

            async def generate(req: GenerateRequest):
                handler = Endless()
                handlers.append(handler)
                async for chunk in handler(EchoRequest()):
                    yield GenerateChunk(text=str(chunk.index))

            await service.serve(GENERATE, generate)
            await service.flush()
            stream, _ = await open_stream(client, GENERATE, GenerateRequest(prompt="x"))
            async with stream:
                async for chunk in stream:
                    if "alive" in probes.outcomes:  # answered through allow_responses
                        break
            assert not CALLER_GONE & set(probes.outcomes), probes.outcomes
            await wait_until(lambda: handlers[0].is_cancelled, "the first stream cancelled by its CancelEvent")
            stream, _ = await open_stream(client, GENERATE, GenerateRequest(prompt="x"))
            del stream
            gc.collect()
            await wait_until(lambda: handlers[1].is_cancelled, "the dropped stream cancelled")
            assert probes.outcomes[-1] == "gone"
        finally:
            await service.close()
            await client.close()
