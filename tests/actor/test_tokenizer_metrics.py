"""The tokenizer's /metrics on a real socket: latency by kind, batch sizes, the queue, refusals."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus import errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import TOKENIZER_CHAT, TOKENIZER_ENCODE
from schemas.tokenizer import ChatMessage, ChatTemplateRequest, EncodeRequest
from services.natsd import free_port
from services.tokenizer import TokenizerActor, TokenizerConfig, TokenizerCore
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def core(model_dir):
    return TokenizerCore(model_dir)


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_requests_batches_and_refusals_are_counted(core):
    network = MemoryNetwork()
    server, client = memory_bus(network), memory_bus(network)
    actor = TokenizerActor(TokenizerConfig(metrics_port=free_port(), max_queue=40), core=core)
    await actor.start(server)
    try:
        url = actor.metrics_server.url
        m = await scrape(url)
        assert m[("kvbus_tokenizer_request_latency_seconds_count", (("kind", "chat"),))] == 0
        assert m[("kvbus_tokenizer_num_requests_waiting", ())] == 0

        texts = [f"text number {i}" for i in range(30)]
        await asyncio.gather(*(client.request(TOKENIZER_ENCODE, EncodeRequest(text=t)) for t in texts))
        await client.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=[ChatMessage(role="user", content="Hi")]))
        m = await scrape(url)
        assert m[("kvbus_tokenizer_request_latency_seconds_count", (("kind", "encode"),))] == 30
        assert m[("kvbus_tokenizer_request_latency_seconds_count", (("kind", "chat"),))] == 1
        # every request was in exactly one batch; 30 sent at once were batched (fewer batches than requests)
        assert m[("kvbus_tokenizer_batch_size_sum", ())] == 31
        assert m[("kvbus_tokenizer_batch_size_count", ())] == actor.num_batches < 31
        assert m[("kvbus_tokenizer_batch_seconds_count", ())] == actor.num_batches

        # the batch loop held in its batch call: the queue fills to max_queue (seen while it waits), then refuses
        release, held, run_batch = threading.Event(), [], actor._run_batch

        def held_batch(jobs):
            held.append(len(jobs))
            release.wait(30)
            return run_batch(jobs)

        actor._run_batch = held_batch
        calls = [asyncio.create_task(client.request(TOKENIZER_ENCODE, EncodeRequest(text="x"))) for _ in range(200)]
        # every call is refused, in the held batch or queued (at most max_queue each, so >= 120 refused)
        await wait_for(lambda: held and sum(t.done() for t in calls) + held[0] + actor._queue.qsize() == 200,
                       what="every call refused, held or queued")
        num_queued = actor._queue.qsize()
        m = await scrape(url)
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        num_refused = sum(isinstance(r, errors.Overloaded) for r in results)
        assert num_refused == 200 - held[0] - num_queued >= 120
        assert m[("kvbus_tokenizer_num_requests_waiting", ())] == num_queued
        assert (await scrape(url))[("kvbus_tokenizer_requests_refused_total", ())] == num_refused
    finally:
        await server.drain(timeout=5)
        await actor.stop()
        await client.close()
    assert actor.metrics_server is None
