"""The draft service on the in-memory bus: stream sync, resync, batching, close; and the
engine-side BusDrafter's timeout fallback (the engine calls it from its own thread)."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.errors import InvalidArgument
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import DRAFT_CLOSE, DRAFT_PROPOSE
from schemas.draft import DraftCloseEvent, DraftItem, DraftProposeRequest
from services.draft.actor import DraftActor
from services.draft.client import BusDrafter
from services.draft.config import DraftConfig
from services.draft.ngram import NgramDrafter

pytestmark = pytest.mark.anyio

STREAM = [5, 6, 7, 8, 9, 5, 6]


async def _started(network):
    actor = DraftActor(DraftConfig(num_speculative_tokens=3), worker_id="d0", drafter=NgramDrafter())
    await actor.start(memory_bus(network))
    return actor


async def test_propose_commit_resync_and_close():
    network = MemoryNetwork()
    actor = await _started(network)
    client = memory_bus(network)
    try:
        ask = lambda items: client.request(DRAFT_PROPOSE, DraftProposeRequest(worker_id="w", items=items))  # noqa: E731
        r = await ask([DraftItem(request_id="a", base=0, tokens=STREAM, k=8)])
        assert (r.items[0].position, r.items[0].tokens) == (7, [7, 8, 9])  # capped at 3
        r = await ask([DraftItem(request_id="a", base=7, tokens=[7], k=2)])
        assert (r.items[0].position, r.items[0].tokens) == (8, [8, 9])
        # a base the service does not hold: resync, then the whole stream fixes it
        r = await ask([DraftItem(request_id="a", base=5, tokens=[1], k=2)])
        assert r.items[0].resync
        r = await ask([DraftItem(request_id="b", base=3, tokens=[1], k=2)])
        assert r.items[0].resync
        r = await ask([DraftItem(request_id="b", base=0, tokens=STREAM, k=2)])
        assert r.items[0].tokens == [7, 8]
        with pytest.raises(InvalidArgument):
            await ask([DraftItem(request_id="c", base=0, tokens=[], k=2)])
        # several workers at once: all answered, in fewer batches than requests
        before = actor.num_batches
        replies = await asyncio.gather(*(ask([DraftItem(request_id=f"x{i}", base=0, tokens=STREAM, k=2)])
                                         for i in range(20)))
        assert all(r.items[0].tokens == [7, 8] for r in replies)
        assert actor.num_batches - before < 20
        await client.publish(DRAFT_CLOSE, DraftCloseEvent(request_ids=["a", "b"]))
        await asyncio.sleep(0)  # delivered in order before the next request's batch
        r = await ask([DraftItem(request_id="zz", base=0, tokens=[1, 2], k=1)])
        for _ in range(100):
            if "a" not in actor.lengths:
                break
            await asyncio.sleep(0.01)
        assert "a" not in actor.lengths and "b" not in actor.lengths
    finally:
        await actor.stop()


async def test_bus_drafter_from_another_thread_and_fallback_when_dead():
    network = MemoryNetwork()
    actor = await _started(network)
    loop = asyncio.get_running_loop()
    drafter = BusDrafter(memory_bus(network), loop, "w", timeout=2.0, backoff=30.0)

    def engine_thread_calls():
        drafter.open("r", STREAM)
        first = drafter.propose_many({"r": 2})
        drafter.commit("r", [7, 8])
        second = drafter.propose_many({"r": 1})
        return first, second

    first, second = await asyncio.to_thread(engine_thread_calls)
    assert first["r"].position == 7 and first["r"].tokens == [7, 8]
    assert second["r"].position == 9 and second["r"].tokens == [9]
    assert actor.lengths["r"] == 9  # only the two new tokens were sent
    await actor.stop()
    await network_drop(actor)
    drafter.timeout = 0.2

    def dead():
        t0 = time.monotonic()
        a = drafter.propose_many({"r": 2})
        t1 = time.monotonic()
        b = drafter.propose_many({"r": 2})  # in backoff: no wait at all
        return a, b, t1 - t0, time.monotonic() - t1

    a, b, waited, skipped = await asyncio.to_thread(dead)
    assert a == {} and b == {} and drafter.num_failures == 1
    assert waited < 1.5 and skipped < 0.05
    assert drafter.synced["r"] == 0  # resent whole when the service is back


async def network_drop(actor):
    """Unsubscribe the stopped actor's routes so requests find no responder (a dead process)."""
    for sub in list(actor.bus._subscriptions):
        await sub.unsubscribe()


async def test_metrics_count_batches_proposals_resyncs_and_failures():
    """The draft service's /metrics on a real socket (services/draft/metrics.py)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from services.natsd import free_port

    network = MemoryNetwork()
    actor = DraftActor(DraftConfig(num_speculative_tokens=3, metrics_port=free_port()), worker_id="d0",
                       drafter=NgramDrafter())
    await actor.start(memory_bus(network))
    client = memory_bus(network)

    async def scrape() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=30) as http:
            text = (await http.get(actor.metrics_server.url)).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    ask = lambda items: client.request(DRAFT_PROPOSE, DraftProposeRequest(worker_id="w", items=items))  # noqa: E731
    try:
        m = await scrape()
        assert m["kvbus_draft_batch_size_count"] == 0 and m["kvbus_draft_num_streams"] == 0
        await ask([DraftItem(request_id="a", base=0, tokens=STREAM, k=8)])  # proposes [7, 8, 9]
        await ask([DraftItem(request_id="a", base=5, tokens=[1], k=2)])  # a base not held: resync
        await ask([DraftItem(request_id="b", base=0, tokens=[1, 2, 3], k=2)])  # no match: no proposal
        m = await scrape()
        assert m["kvbus_draft_batch_size_count"] == actor.num_batches == 3
        assert m["kvbus_draft_batch_size_sum"] == 3
        assert (m["kvbus_draft_proposals_total"], m["kvbus_draft_proposed_tokens_total"]) == (1, 3)
        assert m["kvbus_draft_resyncs_total"] == 1 and m["kvbus_draft_num_streams"] == 2
        assert m["kvbus_draft_failed_batches_total"] == 0

        def broken(*args):
            raise RuntimeError("drafter bug")

        actor.drafter.propose_many = broken
        with pytest.raises(Exception):
            await ask([DraftItem(request_id="c", base=0, tokens=STREAM, k=2)])
        m = await scrape()
        assert m["kvbus_draft_failed_batches_total"] == 1 and m["kvbus_draft_num_requests_waiting"] == 0
    finally:
        await actor.stop()
        await client.close()
    assert actor.metrics_server is None
