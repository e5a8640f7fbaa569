"""The interest probe of streamed replies, with the real engine on a real nats-server (bus/core.py,
"Interest probes").

A caller whose NATS connection closes mid-generation (no CancelEvent: "no responders" on its inbox) or
who drops its stream without closing it (its bus answers ``gone``) has the generation aborted and every
KV page freed (counted through the worker's health subject); a client with the CLIENT role of
deploy/nats/auth.conf may answer the probes it gets. The probe itself, on the in-memory bus and on
NATS alike: tests/integration/test_stream_probe.py.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid

import pytest

from bus.core import PROBE_TIMEOUT
from bus.nats_transport import BusConfig, connect
from bus.subjects import WORKER_GENERATE
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
