"""A request's spans from the engine workers, on the in-memory bus with a local tracer provider: the
engine thread's timeline becomes queue / prefill / decode spans (with step events, speculation and
detokenize under decode), the decode worker's remote prefill and KV transfer, the prefill worker's
KV send, all in one trace under the caller's span, every span carrying the request id."""

from __future__ import annotations

import uuid

import pytest

import bus.tracing as tracing
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import PREFILL, WORKER_GENERATE
from bus.transport import REQUEST_ID_HEADER
from bus.tracing import names as n
from schemas.engine import SamplingParams
from schemas.worker import WorkerGenerateRequest
from services.engine.timeline import STEP_EVENT_EVERY
from services.workers import WorkerConfig
from services.workers.actor import WorkerActor
from services.workers.decode import DecodeActor
from services.workers.prefill import PrefillActor
from tests.spans import exporter  # noqa: F401 (a fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio
NUM_TOKENS = 2 * STEP_EVENT_EVERY + 3
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37) % 4000 + 100 for i in range(70)]  # 4 full pages and a partial one


@pytest.fixture(scope="module")
def config(tiny_model):
    return WorkerConfig(model=str(tiny_model), kv_cache_memory=0.02, max_running_requests=4,
                        speculative_method="ngram", num_speculative_tokens=3)


async def traced_generate(client, worker_id: str, request_id: str, **fields) -> list[int]:
    """Stream a generation inside a root span, as the gateway does (its trace's request id: ``request_id``)."""
    req = WorkerGenerateRequest(request_id=f"{request_id}-0", prompt_token_ids=PROMPT, sampling=GREEDY,
                                stream_interval=4, **fields)
    root = tracing.RequestTrace.start("root", {}, request_id=request_id)
    tokens: list[int] = []
    with root.activated():
        stream = client.stream(WORKER_GENERATE, req, worker_id=worker_id, headers={REQUEST_ID_HEADER: req.request_id})
    async with stream as chunks:
        async for chunk in chunks:
            tokens += chunk.token_ids
    root.end()
    return tokens


def tree(spans):
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int, list] = {}
    for s in spans:
        if s.parent is not None:
            children.setdefault(s.parent.span_id, []).append(s)
    return by_id, children


def child(children, span, name):
    found = [c for c in children.get(span.context.span_id, []) if c.name == name]
    assert len(found) == 1, (name, [c.name for c in children.get(span.context.span_id, [])])
    return found[0]


async def test_aggregated_worker_records_the_engine_stages(config, exporter):
    network = MemoryNetwork()
    worker_bus, client = memory_bus(network), memory_bus(network)
    worker = WorkerActor(config, worker_id="worker-0")
    await worker.start(worker_bus)
    try:
        tokens = await traced_generate(client, "worker-0", "req-agg")
        assert len(tokens) == NUM_TOKENS
        await wait_for(lambda: any(s.name == "root" for s in exporter.get_finished_spans()), 10, "the root span")
    finally:
        await worker_bus.drain(timeout=5)
        await client.drain(timeout=5)
        await worker.stop()
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {spans[0].context.trace_id}, "one trace"
    assert all(s.attributes.get(tracing.REQUEST_ID) == "req-agg" for s in spans), \
        [(s.name, s.attributes.get(tracing.REQUEST_ID)) for s in spans]
    _, children = tree(spans)
    [server] = [s for s in spans if s.name == WORKER_GENERATE.template]
    assert server.attributes[tracing.HOP_REQUEST_ID] == "req-agg-0"
    assert server.attributes[n.WORKER_ID] == "worker-0"
    queue, prefill, decode = (child(children, server, name) for name in (n.QUEUE, n.PREFILL, n.DECODE))
    assert queue.end_time <= prefill.start_time <= prefill.end_time <= decode.start_time <= decode.end_time
    assert server.start_time <= queue.start_time and decode.end_time <= server.end_time
    assert prefill.attributes[n.PROMPT_TOKENS] == len(PROMPT)
    assert prefill.attributes[n.COMPUTED_TOKENS] + prefill.attributes[n.CACHED_TOKENS] == len(PROMPT)
    assert decode.attributes[n.BATCH_SIZE_MIN] == decode.attributes[n.BATCH_SIZE_MAX] == 1
    assert decode.attributes[n.NUM_TOKENS] == NUM_TOKENS
    steps = decode.attributes[n.NUM_STEPS]
    assert 1 <= steps <= NUM_TOKENS - 1  # speculation may take several tokens a step
    assert len(decode.events) == steps // STEP_EVENT_EVERY
    assert all(e.name == n.STEP_EVENT for e in decode.events)
    assert [e.attributes[n.NUM_STEPS] for e in decode.events] == \
        [STEP_EVENT_EVERY * (i + 1) for i in range(len(decode.events))]
    spec = child(children, decode, n.SPECULATION)
    assert spec.attributes[n.DRAFTER] == "ngram" and spec.attributes[n.DRAFT_PLACEMENT] == "local"
    assert 0 <= spec.attributes[n.ACCEPTED_TOKENS] <= spec.attributes[n.DRAFTED_TOKENS]
    detok = child(children, decode, n.DETOKENIZE)
    assert 0 < detok.attributes[n.BUSY_S] <= (detok.end_time - detok.start_time) / 1e9 + 0.05


async def test_disaggregated_request_records_prefill_transfer_and_decode(config, exporter):
    network = MemoryNetwork()
    buses = [memory_bus(network) for _ in range(3)]
    prefill = PrefillActor(config, worker_id="prefill-0")
    decode = DecodeActor(config.replace(kv_transfer="nats", local_prefill_tokens=0), worker_id="decode-0")
    await prefill.start(buses[0])
    await decode.start(buses[1])
    rid = uuid.uuid4().hex
    try:
        await wait_for(lambda: decode.liveness.transfer_backends("prefill-0") is not None or True, 5, "heartbeats")
        tokens = await traced_generate(buses[2], "decode-0", rid, prefill_worker_id="prefill-0")
        assert len(tokens) == NUM_TOKENS
        await wait_for(lambda: any(s.name == "root" for s in exporter.get_finished_spans()), 10, "the root span")
    finally:
        for bus in buses:
            await bus.drain(timeout=5)
        for actor in (prefill, decode):
            await actor.stop()
    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {spans[0].context.trace_id}, "one trace"
    assert all(s.attributes.get(tracing.REQUEST_ID) == rid for s in spans)
    _, children = tree(spans)
    [server] = [s for s in spans if s.name == WORKER_GENERATE.template]
    call = child(children, server, n.REMOTE_PREFILL)
    assert call.attributes[n.PREFILL_WORKER] == "prefill-0"
    [prefill_server] = [s for s in spans if s.name == PREFILL.template]
    by_id, _ = tree(spans)
    parent = by_id[prefill_server.parent.span_id]  # the bus's client span, under remote_prefill
    assert by_id[parent.parent.span_id] is call
    queue, pf = child(children, prefill_server, n.QUEUE), child(children, prefill_server, n.PREFILL)
    assert queue.end_time <= pf.start_time
    assert pf.attributes[n.COMPUTED_TOKENS] == len(PROMPT)
    send = child(children, prefill_server, n.KV_SEND)
    assert send.attributes[n.BACKEND] == "nats" and send.attributes[n.BYTES] > 0
    assert send.attributes[n.PAGES] == -(-len(PROMPT) // 16)
    receive = child(children, server, n.KV_RECEIVE)
    assert receive.attributes[n.BYTES] == send.attributes[n.BYTES]
    assert receive.attributes[n.PAGES] == send.attributes[n.PAGES]
    decode_queue, decode_span = child(children, server, n.QUEUE), child(children, server, n.DECODE)
    assert receive.end_time <= decode_queue.start_time + 1_000_000  # (the wait for pages is the transfer's)
    assert decode_queue.end_time <= decode_span.start_time
    assert not [c for c in children.get(server.context.span_id, []) if c.name == n.PREFILL], "imported, not computed"
    assert not [s for s in spans if s.name.startswith("kvbus.v1.kv.")], "no span per KV chunk"
