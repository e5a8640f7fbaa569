"""KV-aware routing on the real system (kvbus up, real processes, a real nats-server): conversations go
where their cache is, the router's prediction is the worker's cached_tokens to the token, a session
whose worker dies moves and goes on, and router replicas (rebuilt from dumps) agree.

One system per layout, shared by the tests of that layout: 2 aggregated workers, then 1P2D.
Conversations are token ids (NATS ``prompt_token_ids``) so a turn extends the last one exactly; one
goes through HTTP with ``X-Session-ID``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE_ONCE, HEALTH, ROUTE
from schemas.common import HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from schemas.worker import RouteRequest
from services.local_system import LocalSystem
from services.router import RouterActor, RouterConfig
from tests.leaks import engine_states, pid_of
from tests.waiting import wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ANSWER = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WORKERS = [("worker", "worker-0"), ("worker", "worker-1")]


def words(seed: int, n: int) -> list[int]:
    """``n`` token ids of plain vocabulary (SmolLM2's ids 300-5000 are word pieces)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 5000) for _ in range(n)]


class Client:
    """A NATS client of one system: generations, the router's health, direct route probes."""

    def __init__(self, bus):
        self.bus = bus

    async def turn(self, ids: list[int], session: str | None = None) -> tuple[list[int], int]:
        """One generation: (the token ids generated, the prompt tokens the worker found cached)."""
        reply = await self.bus.request(GENERATE_ONCE, GenerateRequest(prompt_token_ids=ids, sampling=ANSWER,
                                                                      session_id=session), timeout=120)
        return reply.token_ids, reply.usage.cached_prompt_tokens

    async def router(self) -> dict[str, str]:
        return (await self.bus.request(HEALTH, HealthRequest(), timeout=5, role="router")).detail

    async def probe(self, ids: list[int], session: str | None = None):
        """The router's decision for a prompt (a decision like any other: it refreshes a session's pin)."""
        return await self.bus.request(ROUTE, RouteRequest(request_id="probe", prompt_token_ids=ids,
                                                          session_id=session), timeout=5)

    async def reported(self, before: dict[str, str], num_cached: int) -> dict[str, int]:
        """Once the workers' reports that reached the router since ``before`` add up to ``num_cached``
        cached tokens: the deltas of its totals (reports of nothing cached may come in meanwhile: kvbus
        up's own first request, for one)."""
        keys = ("reports_matched", "cached_tokens_predicted", "cached_tokens_reported", "cached_tokens_exact")
        now: dict[str, str] = {}

        async def arrived() -> bool:
            now.update(await self.router())
            return int(now["cached_tokens_reported"]) - int(before["cached_tokens_reported"]) >= num_cached

        await async_wait(arrived, 15, f"worker reports of {num_cached} cached tokens")
        return {k: int(now[k]) - int(before[k]) for k in keys}

    async def settled(self) -> None:
        """Wait until the router sees every worker idle: a heartbeat sent after the last turn ended (a
        worker reports every second; until then the finished turn still counts as its load)."""
        async def idle() -> bool:
            loads = [v for k, v in (await self.router()).items() if k.startswith("load_")]
            return bool(loads) and all(v.startswith("0 requests, 0 KV tokens") for v in loads)

        await async_wait(idle, 15, "the router seeing every worker idle")

    async def pages(self) -> int:
        return int((await self.router())["kv_pages_device"])

    async def index_holds(self, ids: list[int], num_tokens: int, session: str | None = None) -> None:
        """Wait until the router predicts ``num_tokens`` cached for ``ids``: the last turn's tail is in its
        index. (A page count alone can be met by other pages arriving meanwhile, kvbus up's own first
        request's: then the next turn is routed before the tail's event and predicted without it.)"""
        async def holds() -> bool:
            return (await self.probe(ids, session)).num_cached_tokens >= num_tokens

        await async_wait(holds, 15, f"the router predicting {num_tokens} cached tokens")

    async def index_grew(self, base: int, num_pages: int) -> None:
        """Wait until the router's index holds ``num_pages`` device pages more than ``base``: a turn's full
        pages and its tail (the tail is kept when the request is freed, just after its last chunk; events
        go out every 50 ms), as a conversation's next turn would find them."""
        async def grown() -> bool:
            return await self.pages() >= base + num_pages

        await async_wait(grown, 15, f"{num_pages} more pages in the router's index")


def session_moves(before: dict[str, str], after: dict[str, str]) -> int:
    """Session moves between two router health details, whatever the reason."""
    return sum(int(v) - int(before.get(k, 0)) for k, v in after.items() if k.startswith("session_moves_"))


async def async_wait(predicate, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def aggregated(model_dir):
    # (a short drain: the worker the last test kills is being restarted when the system stops)
    with LocalSystem("--aggregated", "--workers", "2", "--num-threads", "1", "--speculative", "off",
                     "--drain-timeout", "2", model_dir=model_dir) as system:
        yield system


@pytest.fixture
async def client(aggregated):
    bus = await connect(BusConfig(nats_url=aggregated.nats_url, request_timeout=120))
    try:
        await async_wait(lambda: _all_ready(bus), 120, "both workers ready")
        yield Client(bus)
    finally:
        await bus.close()


async def _all_ready(bus) -> bool:
    return all((await engine_states(bus, WORKERS)).values())


async def test_the_next_turn_lands_where_its_cache_is_and_the_prediction_is_exact(aggregated, client):
    detail = await client.router()
    assert detail["policy"] == "kv" and detail["kv_publishers_synced"] == "2", detail
    turn1 = words(1, 150)
    base = await client.pages()
    answer, cached = await client.turn(turn1, session="conv-a")
    assert cached == 0
    await client.index_grew(base, (len(turn1) + len(answer) - 1) // 16 + 1)
    turn2 = turn1 + answer + words(2, 40)
    await client.index_holds(turn2, len(turn1) + len(answer) - 1, session="conv-a")
    before = await client.router()
    answer2, cached2 = await client.turn(turn2, session="conv-a")
    assert cached2 >= 150 // 16 * 16, cached2  # the conversation stayed on its worker
    report = await client.reported(before, cached2)
    assert report["cached_tokens_predicted"] == report["cached_tokens_reported"] == cached2, (report, cached2)
    assert report["cached_tokens_exact"] == report["reports_matched"] >= 1, report
    # without a session, the same conversation goes where its pages are (not by load)
    await client.index_grew(base, (len(turn2) + len(answer2) - 1) // 16 + 1)
    turn3 = turn2 + answer2 + words(3, 30)
    await client.index_holds(turn3, len(turn2) + len(answer2) - 1)
    await client.settled()  # else the turn that just ended (and the probe) is load on its worker for up to a second
    before = await client.router()
    _, cached3 = await client.turn(turn3)
    report = await client.reported(before, cached3)
    assert cached3 >= (len(turn2) + len(answer2) - 1) // 16 * 16
    assert report["cached_tokens_predicted"] == report["cached_tokens_reported"] == cached3, report


async def test_http_x_session_id_keeps_a_chat_on_its_worker(aggregated, client):
    messages = [{"role": "user", "content": "List three rivers of Europe and one fact about each of them."}]
    async with httpx.AsyncClient(base_url=aggregated.http_url, timeout=120) as http:
        first = await http.post("/v1/chat/completions", headers={"X-Session-ID": "chat-1"},
                                json={"messages": messages, "max_tokens": 8, "temperature": 0})
        assert first.status_code == 200, first.text
        pins = int((await client.router())["session_pins"])
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And three of Asia?"}]
        second = await http.post("/v1/chat/completions", headers={"X-Session-ID": "chat-1"},
                                 json={"messages": messages, "max_tokens": 8, "temperature": 0})
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        too_long = await http.post("/v1/chat/completions", headers={"X-Session-ID": "s" * 300},
                                   json={"messages": messages, "max_tokens": 1})
        assert too_long.status_code == 400 and "X-Session-ID" in too_long.json()["error"]["message"]
    assert int((await client.router())["session_pins"]) == pins  # the second turn kept the first one's pin


async def test_router_replicas_rebuilt_from_dumps_send_a_resent_prompt_to_the_same_worker(aggregated, client):
    prompt = words(4, 120)
    base = await client.pages()
    await client.turn(prompt)
    await client.index_grew(base, len(prompt) // 16)
    await client.settled()
    replicas = [RouterActor(RouterConfig(worker_ttl=3.0), worker_id=f"router-replica-{i}") for i in range(2)]
    buses = [await connect(BusConfig(nats_url=aggregated.nats_url)) for _ in replicas]
    try:
        for replica, bus in zip(replicas, buses):
            await replica.start(bus)  # they saw none of the events: every page they know came in a dump
        await wait_for(lambda: all(r.router.policy.index.is_synced(w) for r in replicas for _, w in WORKERS), 30,
                       "the replicas dumped both workers")
        resent = prompt + words(5, 20)
        decisions = [r.router.route(RouteRequest(request_id=f"resent-{i}", prompt_token_ids=resent))
                     for i, r in enumerate(replicas)]
        assert decisions[0].decode_worker_id == decisions[1].decode_worker_id
        assert decisions[0].num_cached_tokens == decisions[1].num_cached_tokens >= 112
        assert {d.reason for d in decisions} == {"overlap"}
        _, cached = await client.turn(resent)  # whichever replica takes it, it finds the pages
        # NOTE: the resent prompt leaves the cached answer mid-page: the engine also copies the rows it
        # shares with that page (8 here), which KV events do not name; the router predicts whole pages
        # and exact tails, so it under-predicts by less than a page
        assert decisions[0].num_cached_tokens <= cached < decisions[0].num_cached_tokens + 16
    finally:
        for replica, bus in zip(replicas, buses):
            await bus.drain(timeout=5)
            await replica.stop()


async def test_a_session_whose_worker_is_killed_moves_and_the_next_turn_succeeds(aggregated, client):
    turn1 = words(6, 100)
    answer, _ = await client.turn(turn1, session="conv-k")
    pinned = await client.probe(turn1 + answer, session="conv-k")
    assert pinned.reason == "session"
    before = await client.router()
    os.kill(pid_of(aggregated, pinned.decode_worker_id), signal.SIGKILL)
    answer2, cached = await client.turn(turn1 + answer + words(7, 20), session="conv-k")
    assert len(answer2) == ANSWER.max_tokens and cached == 0  # on the other worker, which had none of it
    after = await client.router()
    assert session_moves(before, after) == 1, after
    moved = await client.probe(turn1 + answer + answer2, session="conv-k")
    assert moved.decode_worker_id != pinned.decode_worker_id and moved.reason == "session"
