"""The gateway on the in-memory bus with the real tokenizer, router and worker (real engine).

NATS subjects (generate, generate.once) and the OpenAI HTTP API on a real uvicorn
port, driven by the official ``openai`` client and raw httpx. Cancellation is
checked where it matters: the worker's engine is idle and every KV page is free
again (a request left running would hold pages for tens of seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import time

import httpx
import openai
import pytest

from bus import RequestContext, errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import GENERATE, GENERATE_ONCE, WORKER_HEARTBEAT
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from schemas.tokenizer import ChatMessage, ChatTemplateRequest
from schemas.worker import WorkerHeartbeatEvent, WorkerLoad
from services.gateway import GatewayActor, GatewayConfig
from services.registry import actor_class
from services.router import RouterActor, RouterConfig
from services.runner import bind_health
from services.tokenizer import TokenizerActor, TokenizerConfig, TokenizerCore
from services.workers import WorkerActor, WorkerConfig

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"
LONG_PROMPT = ("kvbus serves language models as actors that talk over NATS. The gateway tokenizes, the router "
               "picks a worker, and the worker streams tokens back. Summarize this in one sentence:")
CHAT = [ChatMessage(role="user", content="Name three colours.")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
ENDLESS = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
"""Runs for a minute on these machines unless cancelled: a test that sees the engine idle soon
after leaving proves the cancel reached the engine."""


# --- the cluster -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def core(model_dir):
    return TokenizerCore(model_dir)


@pytest.fixture(scope="module")
def worker_config(model_dir):
    return WorkerConfig(model=str(model_dir), dtype="float32", kv_cache_memory=0.25, heartbeat_interval=0.2)


@pytest.fixture(scope="module")
def engine(worker_config):
    from services.engine import LLMEngine

    return LLMEngine(worker_config.engine_config)


@pytest.fixture(scope="module")
def reference(engine, core):
    """Greedy continuations computed by the engine directly, before any gateway exists."""
    def run(ids: list[int], params: SamplingParams = GREEDY):
        [out] = engine.generate_sync([ids], params)
        return out

    return {
        "prompt": run(core.encode_batch([PROMPT], True)[0]),
        "chat": run(core.chat_batch([ChatTemplateRequest(messages=CHAT)])[0][1]),
        "long": run(core.encode_batch([LONG_PROMPT], True)[0]),
    }


@dataclasses.dataclass
class Cluster:
    gateway: GatewayActor
    router: RouterActor | None
    worker: WorkerActor | None
    client: object
    free_pages: int
    more_workers: list = dataclasses.field(default_factory=list)
    buses: dict = dataclasses.field(default_factory=dict)
    """Each actor's bus by worker id (a test may cut one off the network)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


async def eventually(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g}s"
        await asyncio.sleep(0.02)


async def engine_is_idle(cluster: Cluster, timeout: float = 10.0) -> None:
    engine = cluster.worker.engine
    await eventually(lambda: not engine.has_unfinished() and engine.block_manager.num_free_pages == cluster.free_pages,
                     timeout, "engine idle with every page free")
    await eventually(lambda: cluster.gateway.pipeline.num_inflight == 0, timeout, "gateway idle")


@contextlib.asynccontextmanager
async def running(core, engine, worker_config, *, gateway: GatewayConfig | None = None,
                  router: RouterConfig | None = None, with_router: bool = True, with_worker: bool = True,
                  more_engines: tuple = ()):
    network = MemoryNetwork()
    actors = []
    buses = {}

    async def start(actor):
        bus = memory_bus(network)
        await actor.start(bus)
        await bind_health(bus, actor)
        actors.append((actor, bus))
        buses[actor.worker_id] = bus
        return actor

    free_pages = engine.block_manager.num_free_pages
    try:
        await start(TokenizerActor(TokenizerConfig(), core=core))
        router_actor = await start(RouterActor(router or RouterConfig(), worker_id="router-0")) \
            if with_router else None
        worker = await start(WorkerActor(worker_config, worker_id="worker-0", engine=engine)) \
            if with_worker else None
        more = [await start(WorkerActor(worker_config, worker_id=f"worker-{i + 1}", engine=e))
                for i, e in enumerate(more_engines)]
        gw = await start(GatewayActor(gateway or GatewayConfig(http_port=0), worker_id="gateway-0"))
        if router_actor is not None and worker is not None:
            ids = {"worker-0", *(w.worker_id for w in more)}
            await eventually(lambda: ids <= set(router_actor.router.workers.known_ids()), 5.0, "workers known")
        client = memory_bus(network)
        yield Cluster(gateway=gw, router=router_actor, worker=worker, client=client, free_pages=free_pages,
                      more_workers=more, buses=buses)
        await client.close()
    finally:
        for actor, bus in reversed(actors):
            await actor.drain(5.0)
            await bus.drain(timeout=5)
            await actor.stop()


@pytest.fixture
async def cluster(core, engine, worker_config):
    async with running(core, engine, worker_config) as c:
        yield c


async def collect(cluster: Cluster, req: GenerateRequest) -> list:
    async with cluster.client.stream(GENERATE, req, timeout=60) as chunks:
        return [chunk async for chunk in chunks]


def ghost(worker_id: str, model: str) -> WorkerHeartbeatEvent:
    """A heartbeat from a worker that serves nothing (it died after its last beat)."""
    return WorkerHeartbeatEvent(worker_id=worker_id, role="worker", host_id="h", model=model, page_size=16,
                                load=WorkerLoad(num_free_pages=100, num_total_pages=100), interval_s=10.0)


# --- NATS: kvbus.v1.generate and kvbus.v1.generate.once ---------------------------------------


async def test_role_is_registered():
    assert actor_class("gateway") is GatewayActor


async def test_generate_streams_the_workers_tokens(cluster, reference, core):
    ref = reference["prompt"]
    chunks = await collect(cluster, GenerateRequest(prompt=PROMPT, sampling=GREEDY))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text == core.decode_batch([ref.token_ids], True)[0]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(core.encode_batch([PROMPT], True)[0]) and usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_generate_once_chat_and_token_ids(cluster, reference):
    reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(messages=CHAT, sampling=GREEDY), timeout=60)
    assert reply.token_ids == reference["chat"].token_ids and reply.text == reference["chat"].text
    assert reply.finish_reason == reference["chat"].finish_reason and reply.logprobs is None
    # Already tokenized prompt; token ids left out of the chunks on request.
    ids = reference["prompt"].token_ids  # any valid ids will do
    chunks = await collect(cluster, GenerateRequest(prompt_token_ids=ids, sampling=GREEDY, include_token_ids=False))
    assert all(c.token_ids == [] for c in chunks) and chunks[-1].usage.prompt_tokens == len(ids)
    # Logprobs travel through.
    reply = await cluster.client.request(
        GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=SamplingParams(temperature=0, max_tokens=4, logprobs=2)))
    assert [lp.token_id for lp in reply.logprobs] == reply.token_ids
    assert all(len(lp.top_token_ids) == 2 and lp.top_token_ids[0] == lp.token_id for lp in reply.logprobs)


@pytest.mark.parametrize("fields,match", [
    ({}, "exactly one of prompt, messages and prompt_token_ids must be given, got none"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "got prompt, prompt_token_ids"),
    ({"prompt": "a", "model": "gpt-4"},
     "model 'gpt-4' is not served here; this gateway serves 'SmolLM2-135M-Instruct'"),
    ({"prompt_token_ids": [1, 10**6]}, r"prompt_token_ids must be in \[0, 49152\), got \[1000000\]"),
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ({"messages": []}, "messages must not be empty"),
    ({"prompt_token_ids": [1] * 8192}, "the prompt has 8192 tokens; the context length is 8192"),
    ({"prompt_token_ids": [1] * 8000, "sampling": SamplingParams(max_tokens=500)},
     "the prompt has 8000 tokens and max_tokens is 500: 8500 exceeds the context length 8192"),
    ({"prompt": "a", "stream_interval": 0}, "stream_interval must be >= 1"),
])
async def test_invalid_requests_are_refused_with_the_reason(cluster, fields, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        await cluster.client.request(GENERATE_ONCE, GenerateRequest(**fields))
    with pytest.raises(errors.InvalidArgument, match=match):
        await collect(cluster, GenerateRequest(**fields))
    assert not cluster.worker.engine.has_unfinished()


async def test_configured_context_length_and_model_name(core, engine, worker_config):
    config = GatewayConfig(http_port=0, max_model_len=32, model_name="smol")
    async with running(core, engine, worker_config, gateway=config) as cluster:
        with pytest.raises(errors.InvalidArgument, match="the prompt has 3[0-9] tokens; the context length is 32"):
            await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=LONG_PROMPT))
        with pytest.raises(errors.InvalidArgument, match="5 tokens and max_tokens is 30: 35 exceeds .* 32"):
            await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT,
                                                                        sampling=SamplingParams(max_tokens=30)))
        reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, model="smol",
                                                                            sampling=GREEDY), timeout=60)
        assert reply.usage.completion_tokens == 12


async def test_leaving_the_stream_cancels_the_worker(cluster):
    async with cluster.client.stream(GENERATE, GenerateRequest(prompt=PROMPT, sampling=ENDLESS), timeout=60) as chunks:
        seen = 0
        async for _ in chunks:
            seen += 1
            if seen == 3:
                break
    await engine_is_idle(cluster)
    assert 'kvbus_requests_total{endpoint="generate",status="499"} 1.0' in cluster.gateway.metrics.render().decode()


async def test_a_handler_closed_at_a_chunk_ends_the_workers_stream_at_once(cluster):
    """The bus closes a stream handler at its yield when a cancel lands as a chunk goes out: every layer
    under it (the pipeline, the worker's stream) must end then, not when the collector finds them."""
    ctx = RequestContext("closed-at-a-chunk", GENERATE.template, {}, time.monotonic())
    handler = cluster.gateway.handle_generate(GenerateRequest(prompt=PROMPT, sampling=ENDLESS), ctx)
    for _ in range(2):
        await anext(handler)
    gc.disable()  # nothing may depend on a collection
    try:
        await handler.aclose()
        assert cluster.gateway.pipeline.num_inflight == 0, "the pipeline outlived its handler"
        assert not cluster.buses["gateway-0"]._pending, "the worker's stream outlived its handler"
    finally:
        gc.enable()
    await engine_is_idle(cluster)


async def test_generate_timeout_cancels_the_worker(core, engine, worker_config):
    config = GatewayConfig(http_port=0, generate_timeout=1.0)
    async with running(core, engine, worker_config, gateway=config) as cluster:
        t0 = time.monotonic()
        with pytest.raises(errors.Timeout, match="exceeded generate_timeout=1s"):
            await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=ENDLESS), timeout=30)
        assert time.monotonic() - t0 < 5
        await engine_is_idle(cluster)


async def test_unavailable_worker_is_retried_once_elsewhere(core, engine, worker_config, reference):
    router = RouterConfig(policy="round_robin", worker_ttl=60)
    async with running(core, engine, worker_config, router=router) as cluster:
        await cluster.client.publish(WORKER_HEARTBEAT, ghost("ghost-1", engine.model_dir.name))
        await eventually(lambda: "ghost-1" in cluster.router.router.workers.known_ids(), 5.0)
        before = cluster.router.num_routed
        for _ in range(3):  # round robin over {ghost, real}: some request meets the ghost first
            reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=GREEDY),
                                                 timeout=60)
            assert reply.token_ids == reference["prompt"].token_ids
        assert cluster.router.num_routed - before > 3


async def test_only_one_retry(core, engine, worker_config):
    router = RouterConfig(policy="round_robin", worker_ttl=60)
    async with running(core, engine, worker_config, router=router, with_worker=False) as cluster:
        for name in ("ghost-1", "ghost-2", "ghost-3"):
            await cluster.client.publish(WORKER_HEARTBEAT, ghost(name, engine.model_dir.name))
        await eventually(lambda: len(cluster.router.router.workers.known_ids()) == 3, 5.0)
        with pytest.raises(errors.Unavailable, match="no service is listening on kvbus.v1.worker.ghost-"):
            await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=GREEDY))
        assert cluster.router.num_routed == 2


async def test_overloaded_past_max_concurrent_requests(core, engine, worker_config, reference):
    config = GatewayConfig(http_port=0, max_concurrent_requests=1)
    async with running(core, engine, worker_config, gateway=config) as cluster:
        async with cluster.client.stream(GENERATE, GenerateRequest(prompt=PROMPT, sampling=ENDLESS),
                                         timeout=60) as held:
            await anext(held)
            with pytest.raises(errors.Overloaded, match="max_concurrent_requests=1"):
                await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=GREEDY))
        await engine_is_idle(cluster)
        reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=GREEDY), timeout=60)
        assert reply.token_ids == reference["prompt"].token_ids
        assert 'kvbus_request_errors_total{code="overloaded"} 1.0' in cluster.gateway.metrics.render().decode()


# --- HTTP: the OpenAI API --------------------------------------------------------------------


async def test_http_connections_send_small_writes_at_once(cluster):
    # Nagle on a kept-alive connection held each SSE chunk until the client's delayed ACK of the
    # previous write (~40 ms on Linux): the listener, whose options the sockets it accepts
    # inherit on Linux, must have TCP_NODELAY.
    import socket

    [listener] = [sock for server in cluster.gateway._server.servers for sock in server.sockets]
    assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_http_models_health_and_port(cluster, core, engine, worker_config):
    assert cluster.gateway.http_port and cluster.gateway.http_port != 8000
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        models = (await http.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == \
            [("SmolLM2-135M-Instruct", "model", 8192)]
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "ready": True, "tokenizer": True, "router": True, "workers": 1}
    async with cluster.openai() as client:
        listed = await client.models.list()
    assert [m.id for m in listed.data] == ["SmolLM2-135M-Instruct"]
    async with running(core, engine, worker_config, with_router=False, with_worker=False) as no_router:
        async with httpx.AsyncClient(base_url=no_router.url) as http:
            health = await http.get("/health")
            assert health.status_code == 503
            assert health.json() == {"status": "unavailable", "ready": True, "tokenizer": True, "router": False,
                                     "workers": None}


async def test_openai_completions_whole_and_streamed(cluster, reference):
    async with cluster.openai() as client:
        await _completions_checks(client, reference)


async def _completions_checks(client, reference):
    ref = reference["long"]
    first = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=LONG_PROMPT, max_tokens=12,
                                            temperature=0)
    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    assert first.choices[0].text == ref.text and first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == ref.usage.prompt_tokens
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=LONG_PROMPT, max_tokens=12,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    events = [event async for event in stream]
    assert "".join(e.choices[0].text for e in events if e.choices) == ref.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12
    # The second identical prompt reused the first one's full KV pages.
    assert events[-1].usage.prompt_tokens_details.cached_tokens >= 16
    # Token ids as the prompt; the default max_tokens is OpenAI's 16.
    by_ids = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=[1, 2, 3], temperature=0)
    assert by_ids.usage.prompt_tokens == 3 and by_ids.usage.completion_tokens <= 16


async def test_openai_chat_whole_and_streamed(cluster, reference):
    async with cluster.openai() as client:
        await _chat_checks(client, reference)


async def _chat_checks(client, reference):
    ref = reference["chat"]
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    whole = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == ref.text and choice.finish_reason == ref.finish_reason
    assert len(choice.logprobs.content) == whole.usage.completion_tokens == len(ref.token_ids)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in choice.logprobs.content)
    stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    events = [e async for e in stream]
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == ref.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == ref.finish_reason
    assert events[-1].usage.completion_tokens == len(ref.token_ids)
    assert events[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_stop_strings_and_sampling_fields_reach_the_engine(cluster, reference):
    ref = reference["long"].text
    word = ref.split()[len(ref.split()) // 2]
    async with cluster.openai() as client:
        await _stop_checks(client, ref, word)


async def _stop_checks(client, ref, word):
    out = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=LONG_PROMPT, max_tokens=12,
                                          temperature=0, stop=[word])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == ref[:ref.index(word)]
    # Seeded sampling with vLLM's extra fields is reproducible.
    extra = {"top_k": 20, "min_p": 0.01, "ignore_eos": True}
    runs = [await client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                            temperature=1.0, top_p=0.9, seed=7, extra_body=extra) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text and runs[0].usage.completion_tokens == 8


async def test_http_errors_are_openai_shaped(core, engine, worker_config):
    config = GatewayConfig(http_port=0, max_request_bytes=64 * 1024)
    async with running(core, engine, worker_config, gateway=config) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url) as http:
            async def post(path: str, **kwargs) -> tuple[int, dict]:
                response = await http.post(path, **kwargs)
                return response.status_code, response.json()["error"]

            status, err = await post("/v1/completions", content=b'{"prompt": "x", ')
            assert status == 400 and err["type"] == "invalid_request_error"
            assert err["message"].startswith("malformed JSON body")
            status, err = await post("/v1/chat/completions", json={"messages": "hello"})
            assert status == 400 and err["param"] == "messages" and "Expected `array | null`" in err["message"]
            status, err = await post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
            assert (status, err["code"], err["param"]) == (400, "model_not_found", "model")
            status, err = await post("/v1/completions", json={"prompt": [1] * 8192})
            assert (status, err["code"]) == (400, "context_length_exceeded")
            assert "8192 tokens; the context length is 8192" in err["message"]
            status, err = await post("/v1/completions", content=b'{"prompt": "' + b"x" * 70_000 + b'"}')
            assert (status, err["code"]) == (413, "request_too_large")
            response = await http.get("/v1/nope")
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
            response = await http.get("/v1/completions")
            assert response.status_code == 405
        async with cluster.openai() as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="SmolLM2-135M-Instruct", n=17,
                                                     messages=[{"role": "user", "content": "hi"}])
            assert info.value.status_code == 400 and "n must be in [1, 16]" in info.value.message
            assert info.value.body["param"] == "n"
            with pytest.raises(openai.BadRequestError, match="top_p must be in"):
                await client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", top_p=2.0)
        async with httpx.AsyncClient(base_url=cluster.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'kvbus_requests_total{endpoint="completions",status="400"} 4.0' in metrics
        assert 'kvbus_requests_total{endpoint="completions",status="413"} 1.0' in metrics
        assert not cluster.worker.engine.has_unfinished()


async def test_http_overloaded_is_429(core, engine, worker_config):
    config = GatewayConfig(http_port=0, max_concurrent_requests=1)
    async with running(core, engine, worker_config, gateway=config) as cluster:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()  # NOTE: keep it referenced; collecting it closes the connection
                assert (await anext(lines)).startswith("data: ")
                with pytest.raises(openai.RateLimitError) as info:
                    async with cluster.openai() as client:
                        await client.completions.create(model="SmolLM2-135M-Instruct", prompt="x")
                assert info.value.status_code == 429 and info.value.body["code"] == "overloaded"
        await engine_is_idle(cluster)


async def test_http_stream_disconnect_cancels_the_worker(cluster):
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 2000,
                "ignore_eos": True, "stream": True, "temperature": 0}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            lines = response.aiter_lines()
            data = [line async for line in _take_data(lines, 4)]
            assert json.loads(data[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert cluster.worker.engine.has_unfinished()
    # The connection is closed: the worker must abort and give its pages back.
    await engine_is_idle(cluster)
    metrics = cluster.gateway.metrics.render().decode()
    assert 'kvbus_requests_total{endpoint="chat_completions",status="499"} 1.0' in metrics


async def test_http_disconnect_while_waiting_cancels_the_worker(cluster):
    async def whole_request():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})

    task = asyncio.create_task(whole_request())
    await eventually(lambda: cluster.worker.engine.num_running == 1, 10.0, "request running")
    await asyncio.sleep(0.3)
    task.cancel()  # closes the connection mid-request
    await asyncio.gather(task, return_exceptions=True)
    await engine_is_idle(cluster)
    assert 'kvbus_requests_total{endpoint="completions",status="499"} 1.0' in cluster.gateway.metrics.render().decode()


async def test_metrics_count_tokens_and_latencies(cluster):
    async with cluster.openai() as client:
        await client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        [_ async for _ in stream]
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    assert samples['kvbus_requests_total{endpoint="completions",status="200"}'] == 2
    assert samples["kvbus_generation_tokens_total"] == 12
    assert samples["kvbus_prompt_tokens_total"] == 2 * 5
    assert samples["kvbus_time_to_first_token_seconds_count"] == 2
    assert samples["kvbus_inter_token_latency_seconds_count"] == 2 * 5
    assert samples["kvbus_e2e_request_latency_seconds_count"] == 2
    assert samples["kvbus_e2e_request_latency_seconds_sum"] >= samples["kvbus_time_to_first_token_seconds_sum"] > 0
    assert samples["kvbus_gateway_num_requests_running"] == 0


async def test_drain_lets_http_requests_finish_then_stops_listening(cluster):
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        request = asyncio.create_task(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                                         "temperature": 0, "ignore_eos": True}))
        await eventually(lambda: cluster.worker.engine.num_running == 1, 10.0, "request running")
        await cluster.gateway.drain(10.0)
        response = await request
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12
        with pytest.raises(httpx.ConnectError):
            await http.get("/health")


async def _take_data(lines, n: int):
    async for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]
            n -= 1
            if n == 0:
                return


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# --- deadlines and migration ---------------------------------------------------------------------


async def test_a_caller_that_gives_up_without_a_cancel_frees_the_pages(cluster):
    """A plain NATS client's generate.once times out and sends nothing more: the Kvbus-Timeout it sent
    is the only word the gateway gets, and it must stop the generation and free the pages."""
    transport = cluster.client.transport
    inbox = transport.new_inbox()
    body = json.dumps({"prompt": PROMPT, "sampling": {"max_tokens": 2000, "ignore_eos": True,
                                                      "temperature": 0}}).encode()
    t0 = time.monotonic()
    await transport.publish(GENERATE_ONCE.template, body,
                            {"Content-Type": "application/json", "Kvbus-Timeout": "1.0"}, reply=inbox)
    await eventually(lambda: cluster.worker.engine.num_running == 1, 10.0, "request running")
    await engine_is_idle(cluster, timeout=10.0)
    assert time.monotonic() - t0 < 1.0 + 3.0, "the generation outlived its caller's deadline by seconds"


async def test_timeout_s_in_the_request_bounds_the_generation(cluster):
    req = GenerateRequest(prompt=PROMPT, sampling=ENDLESS, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(errors.Timeout, match="deadline"):
        await cluster.client.request(GENERATE_ONCE, req, timeout=30)
    assert time.monotonic() - t0 < 4
    await engine_is_idle(cluster)
    with pytest.raises(errors.InvalidArgument, match="timeout_s"):
        await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, timeout_s=0.0), timeout=30)


@pytest.fixture(scope="module")
def second_engine(worker_config):
    from services.engine import LLMEngine

    return LLMEngine(worker_config.engine_config)


def cut_off(bus) -> None:
    """The process behind ``bus`` stops talking (what SIGSTOP or a SIGKILL looks like from outside)."""
    async def black_hole(*args, **kwargs) -> None:
        return None

    bus.transport.publish = black_hole


MIGRATE = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)


def assert_same_greedy(want, got_ids: list[int]) -> None:
    """Token-identical, except at a near-tie of the reference (a recomputed prompt rounds differently)."""
    if got_ids == want.token_ids:
        return
    k = next(k for k, (a, b) in enumerate(zip(want.token_ids, got_ids)) if a != b)
    top = dict(zip(want.logprobs[k].top_token_ids, want.logprobs[k].top_logprobs))
    assert got_ids[k] in top and abs(top[want.token_ids[k]] - top[got_ids[k]]) < 1e-3, (k, got_ids, want.token_ids)


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_worker_that_dies_mid_stream_is_replaced_without_gap_or_repeat(
        core, engine, second_engine, worker_config, streamed):
    [want] = engine.generate_sync([core.encode_batch([LONG_PROMPT], True)[0]], MIGRATE)
    gateway = GatewayConfig(http_port=0, worker_ttl=1.0)
    async with running(core, engine, worker_config, gateway=gateway, router=RouterConfig(worker_ttl=1.0),
                       more_engines=(second_engine,)) as cluster:
        workers = [cluster.worker, *cluster.more_workers]
        req = GenerateRequest(prompt=LONG_PROMPT, sampling=MIGRATE)
        t0 = time.monotonic()
        if streamed:
            chunks = []
            async with cluster.client.stream(GENERATE, req, timeout=60) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 2:
                        [victim] = [w for w in workers if w.engine.num_running]
                        cut_off(cluster.buses[victim.worker_id])
            token_ids = [t for c in chunks for t in c.token_ids]
            text = "".join(c.text for c in chunks)
            usage = chunks[-1].usage
        else:
            call = asyncio.create_task(cluster.client.request(GENERATE_ONCE, req, timeout=60))
            await eventually(lambda: any(w.engine.num_running for w in workers), 10.0, "request running")
            await asyncio.sleep(0.2)
            [victim] = [w for w in workers if w.engine.num_running]
            cut_off(cluster.buses[victim.worker_id])
            reply = await call
            token_ids, text, usage = reply.token_ids, reply.text, reply.usage
        assert time.monotonic() - t0 < 30, "the migration waited for a timeout, not for the heartbeat's silence"
        assert cluster.gateway.pipeline.num_migrations == 1
        assert_same_greedy(want, token_ids)
        assert len(token_ids) == 48 and usage.completion_tokens == 48
        assert usage.prompt_tokens == len(core.encode_batch([LONG_PROMPT], True)[0])
        if token_ids == want.token_ids:
            assert text == want.text
        # the cut-off worker heard the gateway's cancel: its engine stops and frees its pages
        await eventually(lambda: not victim.engine.has_unfinished(), 10.0, "the dead worker's request aborted")
        for w in workers:
            await eventually(lambda: w.engine.block_manager.num_free_pages == cluster.free_pages, 10.0, "pages free")


def cut_off_at_token(buses, index: int) -> dict[str, str]:
    """The worker that is about to stream generated token number ``index`` dies right then, before
    that chunk leaves (from outside: a SIGKILL at an exact token); every other worker goes on."""
    import msgspec

    from bus.transport import STREAM_HEADER
    from schemas.worker import TokenChunk

    dead: dict[str, str] = {}
    for wid, bus in buses.items():
        real = bus.transport.publish
        sent = [0]

        async def publish(subject, data, headers=None, reply=None, *, real=real, sent=sent, wid=wid):
            if wid in dead.values():
                return None
            if not dead and (headers or {}).get(STREAM_HEADER) == "chunk":
                try:
                    chunk = msgspec.msgpack.decode(data, type=TokenChunk)
                except msgspec.DecodeError:
                    chunk = None
                if chunk is not None:
                    if sent[0] + len(chunk.token_ids) > index:
                        dead["worker"] = wid
                        return None
                    sent[0] += len(chunk.token_ids)
            return await real(subject, data, headers, reply)

        bus.transport.publish = publish
    return dead


async def test_a_stop_string_across_the_migration_point_still_stops(core, engine, second_engine, worker_config):
    """The dead worker held back the start of a stop string; the next worker's text completes it."""
    prompt = core.encode_batch([LONG_PROMPT], True)[0]
    [plain] = engine.generate_sync([prompt], MIGRATE)
    texts = core.decode_batch([plain.token_ids[:i] for i in range(len(plain.token_ids) + 1)], True)
    # a stop string made of generated tokens k and k+1 whose first occurrence starts at token k
    k = next(k for k in range(6, len(plain.token_ids) - 2)
             if len(texts[k + 1]) - len(texts[k]) >= 2 and len(texts[k + 2]) - len(texts[k + 1]) >= 2
             and texts[k + 2].find(texts[k + 2][len(texts[k]):]) == len(texts[k]))
    stop = texts[k + 2][len(texts[k]):]
    sampling = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=(stop,))
    [want] = engine.generate_sync([prompt], sampling)
    assert want.finish_reason == "stop" and want.text == texts[k], "the reference must stop at the string"
    gateway = GatewayConfig(http_port=0, worker_ttl=1.0)
    async with running(core, engine, worker_config, gateway=gateway, router=RouterConfig(worker_ttl=1.0),
                       more_engines=(second_engine,)) as cluster:
        dead = cut_off_at_token(cluster.buses, k + 1)  # token k (the stop's start, held back) went out
        req = GenerateRequest(prompt=LONG_PROMPT, sampling=sampling, stream_interval=1)
        chunks = []
        async with cluster.client.stream(GENERATE, req, timeout=60) as stream:
            async for chunk in stream:
                chunks.append(chunk)
        assert dead, "no worker was cut off"
        assert cluster.gateway.pipeline.num_migrations == 1
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-1].finish_reason == "stop"
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
        for w in [cluster.worker, *cluster.more_workers]:
            await eventually(lambda: not w.engine.has_unfinished(), 10.0, "aborted")
            await eventually(lambda: w.engine.block_manager.num_free_pages == cluster.free_pages, 10.0, "pages free")


async def test_migrations_are_bounded_then_unavailable(core, engine, second_engine, worker_config):
    gateway = GatewayConfig(http_port=0, worker_ttl=1.0, max_migrations=0)
    async with running(core, engine, worker_config, gateway=gateway, router=RouterConfig(worker_ttl=1.0),
                       more_engines=(second_engine,)) as cluster:
        workers = [cluster.worker, *cluster.more_workers]
        with pytest.raises(errors.Unavailable, match="after 0 migrations"):
            async with cluster.client.stream(GENERATE, GenerateRequest(prompt=PROMPT, sampling=ENDLESS),
                                             timeout=60) as stream:
                async for _ in stream:
                    for w in workers:
                        if w.engine.num_running:
                            cut_off(cluster.buses[w.worker_id])
        assert cluster.gateway.pipeline.num_migrations_failed == 1
        for w in workers:
            await eventually(lambda: not w.engine.has_unfinished(), 10.0, "aborted")
