"""Prefill and decode workers with real engines on the in-memory bus."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from bus import errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import WORKER_GENERATE
from schemas.engine import SamplingParams
from schemas.worker import WorkerGenerateRequest
from services.workers import WorkerConfig
from services.workers.decode import DecodeActor
from services.workers.prefill import PrefillActor
from tests.streaming import worker_stream, worker_tokens
from tests.waiting import wait_for

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = list(range(1000, 1077))  # 77 tokens: 4 full pages and a partial one


@pytest.fixture(scope="module")
def engines(model_dir):
    from services.engine import LLMEngine

    config = WorkerConfig(model=str(model_dir), kv_cache_memory=0.1, max_running_requests=2, max_queue=1)
    return config, LLMEngine(config.engine_config), LLMEngine(config.engine_config)


@pytest.fixture(scope="module")
def reference(engines):
    _, engine, _ = engines
    return engine.generate_sync([PROMPT], GREEDY)[0].token_ids


NEXT_TURN = list(range(2000, 2040))


@pytest.fixture(scope="module")
def reference_turn2(engines, reference):
    _, engine, _ = engines
    return engine.generate_sync([PROMPT + reference + NEXT_TURN], GREEDY)[0].token_ids


FRESH = list(range(3000, 3077))  # a conversation no other test sends
FRESH_NEXT = list(range(4000, 4030))


@pytest.fixture(scope="module")
def fresh_turns(engines):
    _, engine, _ = engines
    first = engine.generate_sync([FRESH], GREEDY)[0].token_ids
    turn2 = FRESH + first + FRESH_NEXT
    return first, turn2, engine.generate_sync([turn2], GREEDY)[0].token_ids


@pytest.fixture
async def system(engines):
    config, prefill_engine, decode_engine = engines
    network = MemoryNetwork()
    buses = [memory_bus(network) for _ in range(3)]
    prefill = PrefillActor(config, worker_id="prefill-0", engine=prefill_engine)
    decode = DecodeActor(config.replace(kv_transfer="nats"), worker_id="decode-0", engine=decode_engine)
    await prefill.start(buses[0])
    await decode.start(buses[1])
    yield prefill, decode, buses[2]
    for bus in buses:
        await bus.drain(timeout=5)
    for actor in (prefill, decode):  # stops the engines' async drivers; the module reuses the engines
        await actor.stop()


async def generate(client, prefill_worker_id: str | None, params=GREEDY, prompt=PROMPT) -> list[int]:
    return await worker_tokens(client, "decode-0", prompt, params, prefill_worker_id=prefill_worker_id,
                               stream_interval=2)


def gate_steps(engine, monkeypatch) -> threading.Event:
    """Hold ``engine``'s forward passes until the returned event is set (within 60 s): its requests
    stay where they are however fast their steps would be."""
    gate, run = threading.Event(), engine.runner.run

    def gated(batch):
        assert gate.wait(60), "the test never opened the gate"
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", gated)
    return gate


def all_pages_free(*actors) -> bool:
    return all(a.engine.block_manager.num_free_pages == a.engine.block_manager.num_pages
               and a.engine.num_running == 0 and a.engine.num_waiting == 0 for a in actors)


async def test_remote_prefill_matches_the_engine(system, reference):
    prefill, decode, client = system
    assert await generate(client, "prefill-0") == reference
    assert decode.num_remote_prefills == 1 and decode.num_transfers["nats"] == 1
    assert prefill.num_prefilled == 1 and decode.num_local_prefills == 0


async def test_dead_prefill_worker_falls_back_to_local_prefill(system, reference):
    prefill, decode, client = system
    assert await generate(client, "prefill-gone") == reference
    assert decode.num_prefill_failures == 1 and decode.num_local_prefills == 1
    assert decode.receiver.num_expected == 0  # the abandoned transfer was dropped


async def test_a_prefill_worker_that_goes_silent_costs_seconds_not_the_transfer_timeout(system, reference):
    """The prefill worker takes the request and then says nothing more (SIGSTOP, a dead host): the decode
    worker learns from the missing heartbeats within peer_ttl and prefills locally."""
    prefill, decode, client = system

    async def black_hole(*args, **kwargs) -> None:
        return None

    prefill.bus.transport.publish = black_hole  # no reply, no heartbeat from now on
    t0 = time.monotonic()
    assert await generate(client, "prefill-0") == reference
    took = time.monotonic() - t0
    assert took < decode.config.peer_ttl + 5 < decode.config.transfer_timeout, took
    assert decode.num_prefill_failures == 1 and decode.num_local_prefills == 1
    assert decode.receiver.num_expected == 0
    # the prefill got the cancel: its engine lets the prompt go
    await wait_for(lambda: all_pages_free(prefill, decode), timeout=10, what="every page free")


async def test_cancel_mid_stream_frees_pages_on_both_workers(system):
    prefill, decode, client = system
    req = WorkerGenerateRequest(request_id="long", prompt_token_ids=PROMPT, prefill_worker_id="prefill-0",
                                sampling=SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    async with client.stream(WORKER_GENERATE, req, worker_id="decode-0") as chunks:
        async for chunk in chunks:
            break
    await wait_for(lambda: all_pages_free(prefill, decode), timeout=5, what="every page free")


async def test_full_worker_answers_overloaded(system, monkeypatch):
    prefill, decode, client = system
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine = prefill.engine
    # The prefill worker's forward passes wait at a gate, so its requests stay in it however fast
    # their prefill would be (a prompt whose rows are all cached computes one token).
    gate = gate_steps(engine, monkeypatch)
    tasks = [asyncio.create_task(generate(client, "prefill-0", long)) for _ in range(3)]  # 2 running + 1 queued
    try:
        await wait_for(lambda: engine.num_running + engine.num_waiting + prefill.num_admitting == 3, timeout=30,
                       what="all three admitted")
        with pytest.raises(errors.Overloaded, match="full"):
            await generate(client, "prefill-0", long)
    finally:
        gate.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)



async def test_only_the_pages_the_decode_worker_lacks_cross(system, reference, reference_turn2):
    """Turn 2 of a conversation resends turn 1 and its answer; the decode worker holds their pages
    (prompt and generated alike), so only the pages after them are sent."""
    prefill, decode, client = system
    assert await generate(client, "prefill-0") == reference
    turn2 = PROMPT + reference + NEXT_TURN  # 129 tokens: 8 full pages before the last token's page
    sent, skipped, nbytes = decode.transfer_pages, decode.transfer_pages_skipped, decode.transfer_bytes
    assert await generate(client, "prefill-0", prompt=turn2) == reference_turn2
    num_skipped = decode.transfer_pages_skipped - skipped
    assert num_skipped >= 5  # turn 1's 88 computed tokens: 5 full pages
    assert float(decode.health_detail()["last_transfer_s"]) > 0  # the pages' trip after the first token
    assert decode.transfer_pages - sent == 9 - num_skipped
    page_bytes = (decode.transfer_bytes - nbytes) // (9 - num_skipped)

    decode.config = decode.config.replace(transfer_missing_only=False)  # the old path: every page crosses
    sent, skipped, nbytes = decode.transfer_pages, decode.transfer_pages_skipped, decode.transfer_bytes
    assert await generate(client, "prefill-0", prompt=turn2) == reference_turn2
    assert decode.transfer_pages - sent == 9 and decode.transfer_pages_skipped == skipped
    assert decode.transfer_bytes - nbytes == 9 * page_bytes
    assert decode.num_local_prefills == 0 and decode.num_prefill_failures == 0
    await wait_for(lambda: all_pages_free(prefill, decode), timeout=5, what="every page free")


async def test_a_prefill_worker_that_ignores_skip_pages_still_serves(system, reference, reference_turn2):
    """A prefill worker from before skip_pages sends every page; the decode worker takes them all."""
    prefill, decode, client = system
    assert await generate(client, "prefill-0") == reference
    real = prefill.engine.prefill

    async def old_prefill(prompt, params, request_id=None, **_ignored):
        return await real(prompt, params, request_id=request_id)

    prefill.engine.prefill = old_prefill
    try:
        sent, skipped = decode.transfer_pages, decode.transfer_pages_skipped
        assert await generate(client, "prefill-0", prompt=PROMPT + reference + NEXT_TURN) == reference_turn2
        assert decode.transfer_pages - sent == 9 and decode.transfer_pages_skipped == skipped
        assert decode.num_local_prefills == 0 and decode.num_prefill_failures == 0
    finally:
        del prefill.engine.prefill  # the instance attribute: back to the class's method


SYSTEM_PROMPT = list(range(5000, 5048))  # 3 full pages that two conversations open with
OPEN_A = SYSTEM_PROMPT + list(range(5100, 5110))  # 58 tokens: short enough to prefill on the decode worker
OPEN_B = SYSTEM_PROMPT + list(range(5200, 5240))  # 88 tokens: 40 after the system prompt's pages


@pytest.fixture(scope="module")
def openings(engines):
    """Greedy answers to OPEN_A and OPEN_B from the prefill worker's engine (the decode worker's
    prefix cache must not hold the system prompt before the test)."""
    _, engine, _ = engines
    return [out.token_ids for out in engine.generate_sync([OPEN_A, OPEN_B], GREEDY)]


async def stream(client, prompt: list[int]):
    """(tokens, usage) of one generation through the decode worker, prefill-0 named."""
    return await worker_stream(client, "decode-0", prompt, GREEDY, prefill_worker_id="prefill-0")


async def test_a_prompt_behind_a_local_prefill_of_its_prefix_stays_there(openings, system, monkeypatch):
    """Two conversations open with the same system prompt at once. The first is short and is
    prefilled on the decode worker; the second is past ``local_prefill_tokens`` by the system
    prompt's pages only. The pages the first is computing count as held, so the second stays too:
    the engine holds it until they are cached and computes only its own 40 tokens. Before, it
    went to the prefill worker, which computed the system prompt a second time."""
    prefill, decode, client = system
    decode.config = decode.config.replace(local_prefill_tokens=64)
    engine = decode.engine
    remote, kept, behind, prefilled = (decode.num_remote_prefills, decode.num_kept_local, decode.num_kept_behind,
                                       prefill.num_prefilled)
    gate = gate_steps(engine, monkeypatch)  # the decode engine's steps wait: the first prompt stays "computing"
    try:
        first = asyncio.create_task(stream(client, OPEN_A))
        await wait_for(lambda: decode._computing, timeout=30, what="the first prompt taken here")
        assert len(decode._computing) == 1 and decode.num_kept_local == kept + 1
        second = asyncio.create_task(stream(client, OPEN_B))
        await wait_for(lambda: decode.num_kept_local == kept + 2 or decode.num_remote_prefills > remote, timeout=30,
                       what="the second prompt's local-or-remote choice")
    finally:
        gate.set()
    (tokens_a, usage_a), (tokens_b, usage_b) = await asyncio.gather(first, second)
    assert [tokens_a, tokens_b] == openings
    assert decode.num_remote_prefills == remote and prefill.num_prefilled == prefilled
    assert decode.num_kept_local == kept + 2 and decode.num_kept_behind == behind + 1
    assert usage_a.cached_prompt_tokens == 0
    assert usage_b.cached_prompt_tokens == len(SYSTEM_PROMPT)  # the system prompt, computed once
    assert decode._computing == {} and decode.health_detail()["kept_behind"] == str(decode.num_kept_behind)
    decode.config = decode.config.replace(local_prefill_tokens=0)
    await wait_for(lambda: all_pages_free(prefill, decode), timeout=5, what="every page free")


async def test_a_short_remainder_is_prefilled_where_it_is_decoded(fresh_turns, system):
    """Conditional disaggregation at the decode worker (``local_prefill_tokens``): turn 2 of a
    conversation whose history this worker holds leaves a short remainder, computed here without
    a transfer; a cold prompt past the limit still goes to the prefill worker."""
    first, turn2, want2 = fresh_turns
    prefill, decode, client = system
    decode.config = decode.config.replace(local_prefill_tokens=64)
    remote, local, prefilled = decode.num_remote_prefills, decode.num_local_prefills, prefill.num_prefilled
    assert await generate(client, "prefill-0", prompt=FRESH) == first  # 77 uncached tokens > 64
    assert decode.num_remote_prefills == remote + 1 and prefill.num_prefilled == prefilled + 1
    sent = decode.transfer_pages
    assert await generate(client, "prefill-0", prompt=turn2) == want2  # holds >= 5 of 8 pages: <= 49 left
    assert decode.num_local_prefills == local + 1 and decode.num_kept_local >= 1
    assert decode.num_remote_prefills == remote + 1 and prefill.num_prefilled == prefilled + 1
    assert decode.transfer_pages == sent and decode.num_prefill_failures == 0
    assert decode.health_detail()["kept_local"] == str(decode.num_kept_local)
    decode.config = decode.config.replace(local_prefill_tokens=0)  # off: every prefill goes remote
    assert await generate(client, "prefill-0", prompt=turn2) == want2
    assert decode.num_remote_prefills == remote + 2
    await wait_for(lambda: all_pages_free(prefill, decode), timeout=5, what="every page free")
