"""KV-aware routing on a real 1P2D system (kvbus up: one prefill worker, two decode workers, every
prompt prefilled on the prefill worker): a conversation's next turn goes to the decode worker that
holds its earlier turns, by its session and, without one, by the KV index alone; the router's
prediction for the prefill worker is what it reports cached; a session whose decode worker is killed
moves to the other one, and its next turn still finds its prefix on the prefill worker."""

from __future__ import annotations

import os
import signal

import pytest

from bus.nats_transport import BusConfig, connect
from services.local_system import LocalSystem
from tests.integration.test_router_kv import ANSWER, Client, async_wait, session_moves, words
from tests.leaks import engine_states, pid_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ENGINES = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]


@pytest.fixture(scope="module")
def one_p_two_d(model_dir):
    with LocalSystem("--prefill", "1", "--decode", "2", "--num-threads", "1", "--speculative", "off",
                     "--drain-timeout", "2", "--engine-args", "--local-prefill-tokens 0", model_dir=model_dir) as system:
        yield system


@pytest.fixture
async def client(one_p_two_d):
    bus = await connect(BusConfig(nats_url=one_p_two_d.nats_url, request_timeout=120))
    try:
        async def ready() -> bool:
            return all((await engine_states(bus, ENGINES)).values())

        await async_wait(ready, 120, "the three engines ready")
        yield Client(bus)
    finally:
        await bus.close()


async def test_the_next_turn_goes_to_the_decode_worker_holding_the_conversation(client):
    detail = await client.router()
    assert detail["policy"] == "kv" and detail["kv_publishers_synced"] == "3", detail
    turn1 = words(11, 150)
    base = await client.pages()
    answer, cached = await client.turn(turn1, session="conv-d")
    assert cached == 0
    # turn 1's 9 full prompt pages on the prefill worker, and on the decoder, which imported them
    # (and decoded the answer): both in the index before the next turn
    await client.index_grew(base, 2 * (len(turn1) // 16))
    await client.settled()
    turn2 = turn1 + answer + words(12, 40)
    pinned = await client.probe(turn2, session="conv-d")
    by_cache = await client.probe(turn2)  # no session: the index alone
    assert pinned.reason == "session" and by_cache.reason == "overlap", (pinned, by_cache)
    assert by_cache.decode_worker_id == pinned.decode_worker_id
    assert by_cache.prefill_worker_id == "prefill-0" and by_cache.num_cached_tokens >= 144
    before = await client.router()
    _, cached2 = await client.turn(turn2, session="conv-d")
    assert cached2 >= 144  # the prefill worker's cache (the decoder's pages are not sent again)
    report = await client.reported(before, cached2)
    assert report["cached_tokens_predicted"] == report["cached_tokens_reported"] == cached2, (report, cached2)


async def test_a_session_whose_decode_worker_is_killed_moves_and_its_prefix_is_still_found(one_p_two_d, client):
    # (the module's last test: the killed worker is being restarted when the system stops)
    turn1 = words(13, 100)
    answer, _ = await client.turn(turn1, session="conv-dk")
    pinned = await client.probe(turn1 + answer, session="conv-dk")
    assert pinned.reason == "session"  # (and no prefill worker: the decoder holds all but the new tokens)
    before = await client.router()
    os.kill(pid_of(one_p_two_d, pinned.decode_worker_id), signal.SIGKILL)
    answer2, cached = await client.turn(turn1 + answer + words(14, 20), session="conv-dk")
    # on the other decoder, prefilled by the prefill worker, which still holds turn 1's full pages
    assert len(answer2) == ANSWER.max_tokens and cached >= len(turn1) // 16 * 16, cached
    after = await client.router()
    assert session_moves(before, after) == 1, after
    moved = await client.probe(turn1 + answer + answer2, session="conv-dk")
    assert moved.decode_worker_id != pinned.decode_worker_id and moved.reason == "session"
