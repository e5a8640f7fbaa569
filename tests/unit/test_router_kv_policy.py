"""The kv policy and conversation affinity through the router's decision, with fake heartbeats, fake KV
events and a fake clock (no bus)."""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from bus.errors import Overloaded
from schemas.kv_store import KVDumpReply, KVEvent, KVEventBatchEvent
from schemas.worker import PrefixReport, RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services.engine.page_hash import SCHEME, hash_tail, page_hashes, root_hash
from services.router.config import RouterConfig
from services.router.core import Router

PROMPT = list(range(1000, 1200))  # 200 tokens: 12 full cacheable pages of 16
HASHES = page_hashes(PROMPT[:192], 16)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, role: str = "worker", *, running: int = 0, used: int = 0, queued: int = 0,
         host: str = "h1", scheme: str = SCHEME, root: int = 0, reports=(), draining: bool = False,
         ) -> WorkerHeartbeatEvent:
    return WorkerHeartbeatEvent(
        worker_id=worker_id, role=role, host_id=host, model="m", page_size=16, is_draining=draining,
        load=WorkerLoad(num_running=running, num_free_pages=1000 - used, num_total_pages=1000,
                        num_queued_prefill_tokens=queued),
        hash_scheme=scheme, hash_root=root, prefix_reports=list(reports))


def stored(publisher: str, event_id: int, hashes, tier: str = "device", host: str = "h1") -> KVEventBatchEvent:
    return KVEventBatchEvent(worker_id=publisher, host_id=host, event_id=event_id, events=[
        KVEvent(kind="stored", tier=tier, page_hashes=list(hashes), parent_hashes=[0] * len(hashes))])


def make_router(*beats: WorkerHeartbeatEvent, **config) -> tuple[Router, FakeClock]:
    """A kv router over these workers, each dumped (empty) as it joins."""
    clock = FakeClock()
    router = Router(RouterConfig(**config), clock=clock, rng=random.Random(3))
    for event in beats:
        join(router, event)
    return router, clock


def join(router: Router, event: WorkerHeartbeatEvent) -> None:
    router.observe(event)
    for publisher in router.policy.take_kv_dump_requests():
        router.observe_dump(KVDumpReply(worker_id=publisher, host_id=event.host_id, event_id=0, events=[]))


def route(router: Router, ids=PROMPT, session: str | None = None, exclude=(), request_id: str = "r"):
    return router.route(RouteRequest(request_id=request_id, prompt_token_ids=list(ids), session_id=session,
                                     exclude_worker_ids=list(exclude)))


def decisions(router: Router, stage: str, reason: str) -> float:
    return router.metrics.registry.get_sample_value(
        "kvbus_router_decisions_total", {"policy": "kv", "stage": stage, "reason": reason}) or 0.0


# --- cost ----------------------------------------------------------------------------------
def test_kv_is_the_default_and_goes_where_the_prefix_is():
    router, _ = make_router(beat("w1"), beat("w2"), beat("w3"))
    assert router.policy.name == "kv"
    router.observe_kv(stored("w2", 1, HASHES[:10]))
    router.observe_kv(stored("w3", 1, HASHES[:4]))
    reply = route(router)
    assert (reply.decode_worker_id, reply.num_cached_tokens, reply.reason) == ("w2", 160, "overlap")
    cold = route(router, list(range(50)))  # nothing cached anywhere: the least load (w2 now holds one more)
    assert (cold.decode_worker_id, cold.num_cached_tokens, cold.reason) == ("w1", 0, "load")
    assert decisions(router, "decode", "overlap") == 1 and decisions(router, "decode", "load") == 1


def test_overlap_is_weighed_against_load_in_tokens():
    # w2 holds 160 of the 200 prompt tokens but its requests hold 11 pages of KV: 40 + 176 > 200 + 0.
    router, _ = make_router(beat("w1"), beat("w2", used=11))
    router.observe_kv(stored("w2", 1, HASHES[:10]))
    assert route(router).decode_worker_id == "w1"
    router, _ = make_router(beat("w1"), beat("w2", used=11), kv_overlap_weight=2.0)
    router.observe_kv(stored("w2", 1, HASHES[:10]))
    assert route(router).decode_worker_id == "w2"  # 2 * 40 + 176 < 2 * 200


def test_tier_credits_prefer_the_device_then_host_memory_then_disk():
    router, _ = make_router(beat("a"), beat("b"), beat("c", host="h2"), beat("d", host="h3"))
    router.observe_kv(stored("a", 1, HASHES[:6]))  # 6 pages x 1.0
    router.observe_kv(stored("store-h2", 1, HASHES[:8], "host", host="h2"))  # 8 x 0.75 = 6
    router.observe_kv(stored("store-h3", 1, HASHES[:12], "disk", host="h3"))  # 12 x 0.25 = 3
    policy, ctx_reply = router.policy, route(router)
    assert ctx_reply.decode_worker_id == "a"  # 6 pages credited whole; c ties on credit, a loses no load
    # prediction: the tokens found cached whatever the tier
    from services.router.scoring import RouteContext

    ctx = RouteContext(request_id="x", prompt_token_ids=PROMPT)
    workers = {w.worker_id: w for w in router.workers.alive()}
    assert [policy.num_cached_tokens(ctx, workers[w]) for w in "abcd"] == [96, 0, 128, 192]
    assert policy.cost("decode", ctx, workers["c"]) == 200 - 96
    assert policy.cost("decode", ctx, workers["d"]) == 200 - 48
    router2, _ = make_router(beat("c", host="h2"), beat("d", host="h3"), kv_credit_disk=1.0)
    router2.observe_kv(stored("store-h2", 1, HASHES[:8], "host", host="h2"))
    router2.observe_kv(stored("store-h3", 1, HASHES[:12], "disk", host="h3"))
    assert route(router2).decode_worker_id == "d"  # configurable: disk credited as much as the device


def test_a_conversations_next_turn_is_predicted_to_the_token_tails_included():
    router, _ = make_router(beat("w1"), beat("w2"))
    turn1 = PROMPT[:100]
    answer = [7, 8, 9, 10, 11]
    # the worker kept turn 1 + answer (minus its last token, never computed): 6 full pages and a tail
    kept = turn1 + answer[:-1]
    full = page_hashes(kept[:96], 16)
    tail = hash_tail(full[-1], kept[96:])
    router.observe_kv(stored("w2", 1, full + [tail]))
    turn2 = turn1 + answer + list(range(50, 90))
    reply = route(router, turn2)
    assert (reply.decode_worker_id, reply.num_cached_tokens) == ("w2", 96 + 8)


def test_a_salted_worker_is_matched_through_its_advertised_root():
    salted = root_hash("tenant-a")
    router, _ = make_router(beat("w1"), beat("w2", root=salted))
    router.observe_kv(stored("w2", 1, page_hashes(PROMPT[:192], 16, "tenant-a")))
    router.observe_kv(stored("w1", 1, HASHES[:3]))
    reply = route(router)
    assert (reply.decode_worker_id, reply.num_cached_tokens) == ("w2", 192)


def test_a_worker_with_another_hash_scheme_gets_no_credit_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="services.router.kv_policy"):
        router, _ = make_router(beat("w1", running=1), beat("w2", scheme="other-hash-v9"))
    assert "w2 names KV pages by scheme 'other-hash-v9'" in caplog.text
    router.observe_kv(stored("w2", 1, HASHES))
    reply = route(router)
    assert (reply.decode_worker_id, reply.num_cached_tokens) == ("w2", 0)  # by load alone
    router.observe(beat("w2", used=100, scheme="other-hash-v9"))
    assert route(router).decode_worker_id == "w1"


def test_softmax_sampling_is_seeded_and_prefers_low_cost():
    picks = []
    for _ in range(2):
        router, _ = make_router(beat("w1"), beat("w2"), beat("w3"), router_temperature=0.5, seed=11)
        router.observe_kv(stored("w2", 1, HASHES))
        picks.append([route(router).decode_worker_id for _ in range(40)])
        for w in ("w1", "w2", "w3"):
            router.observe(beat(w))  # fresh reports: no load added by the 40 routes
    assert picks[0] == picks[1]
    counts = Counter(picks[0])
    assert set(counts) == {"w1", "w2", "w3"} and counts["w2"] > counts["w1"] and counts["w2"] > counts["w3"]


def test_busy_thresholds_exclude_workers_and_all_busy_is_overloaded():
    router, _ = make_router(beat("w1", running=2), beat("w2"), max_requests_per_worker=2)
    router.observe_kv(stored("w1", 1, HASHES))
    assert route(router).decode_worker_id == "w2"  # w1 holds the prefix but is busy
    router.observe(beat("w2", running=2))
    with pytest.raises(Overloaded, match="all 2 decode workers are busy"):
        route(router)


def test_a_burst_of_one_prompt_spreads_once_its_routed_load_outweighs_the_prefill():
    router, _ = make_router(beat("w1"), beat("w2"))
    router.observe_kv(stored("w1", 1, HASHES))
    got = [route(router).decode_worker_id for _ in range(14)]
    # the k-th copy costs w1 8 (uncached) + 16 k (each routed copy: 8 to prefill, 8 of new KV), w2 200;
    # at k = 12 they tie and w2, with fewer requests, takes it; then w2 holds 400 of load
    assert got == ["w1"] * 12 + ["w2", "w1"]


# --- disaggregation ------------------------------------------------------------------------
def test_disaggregated_decode_by_overlap_prefill_by_overlap_and_queue():
    router, _ = make_router(beat("d1", "decode"), beat("d2", "decode"), beat("p1", "prefill"),
                            beat("p2", "prefill", queued=50), beat("p3", "prefill", queued=300))
    router.observe_kv(stored("d2", 1, HASHES[:2]))  # an earlier turn decoded on d2
    router.observe_kv(stored("p2", 1, HASHES[:10]))
    router.observe_kv(stored("p3", 1, HASHES))
    reply = route(router)
    # p1: 200 + 0; p2: 40 + 50; p3: 8 + 300
    assert (reply.decode_worker_id, reply.prefill_worker_id) == ("d2", "p2")
    assert reply.num_cached_tokens == 160  # the prefill worker's prediction
    assert decisions(router, "prefill", "overlap") == 1


def test_the_decode_worker_prefills_when_the_predicted_uncached_part_is_short():
    router, _ = make_router(beat("d1", "decode"), beat("p1", "prefill"), min_disagg_tokens=32)
    router.observe_kv(stored("d1", 1, HASHES[:11]))  # 176 cached: 24 left
    reply = route(router)
    assert (reply.decode_worker_id, reply.prefill_worker_id, reply.num_cached_tokens) == ("d1", None, 176)
    router.observe_kv(stored("d1", 2, []))
    assert route(router, PROMPT + list(range(40))).prefill_worker_id == "p1"  # 40 more tokens: worth it


# --- sessions --------------------------------------------------------------------------------
def test_a_session_stays_on_its_worker_until_idle_for_the_ttl():
    router, clock = make_router(beat("w1"), beat("w2"), session_ttl=300.0, worker_ttl=1e6)
    first = route(router, list(range(40)), session="s1")
    assert first.decode_worker_id == "w1" and router.sessions.num_pins == 1
    router.observe(beat("w1", used=50))  # w1 looks busier now; the session stays anyway
    router.observe(beat("w2"))
    clock.now += 299.99
    again = route(router, list(range(60)), session="s1")
    assert (again.decode_worker_id, again.reason) == ("w1", "session")
    clock.now += 300.0  # idle exactly the TTL since the last request: forgotten, placed afresh
    assert route(router, list(range(60)), session="s1").decode_worker_id == "w2"
    assert router.sessions.num_pins == 2 and sum(router.sessions.num_moves.values()) == 0
    assert decisions(router, "decode", "session") == 1


def test_a_session_moves_when_its_worker_is_busy_leaves_or_is_excluded_and_each_move_is_counted():
    router, clock = make_router(beat("w1"), beat("w2"), beat("w3"), max_requests_per_worker=4)
    assert route(router, session="s").decode_worker_id == "w1"
    router.observe(beat("w1", running=4))
    moved = route(router, session="s")
    assert moved.decode_worker_id == "w2" and router.sessions.num_moves == {"busy": 1}
    router.observe(beat("w2", draining=True))
    assert route(router, session="s").decode_worker_id == "w3" and router.sessions.num_moves["left"] == 1
    router.observe(beat("w1"))
    assert route(router, session="s", exclude=["w3"]).decode_worker_id == "w1"
    assert router.sessions.num_moves == {"busy": 1, "left": 1, "excluded": 1}
    metric = router.metrics.registry.get_sample_value("kvbus_router_session_moves_total", {"reason": "busy"})
    assert metric == 1.0


def test_a_worker_that_comes_back_under_the_same_id_does_not_keep_its_sessions():
    router, clock = make_router(beat("w1"), beat("w2"), worker_ttl=3.0)
    assert route(router, session="s").decode_worker_id == "w1"
    clock.now += 3.0
    join(router, beat("w2"))  # w1 went silent
    router.tick()
    join(router, beat("w1"))  # restarted before the session's next request: its cache is empty
    router.observe_kv(stored("w2", 1, HASHES))
    reply = route(router, session="s")
    assert (reply.decode_worker_id, reply.reason) == ("w2", "overlap")
    assert router.sessions.num_moves == {"left": 1}


# --- accuracy ----------------------------------------------------------------------------------
def test_reports_in_heartbeats_are_compared_with_the_prediction():
    router, _ = make_router(beat("w1"), beat("w2"))
    router.observe_kv(stored("w1", 1, HASHES[:5]))
    assert route(router, request_id="req-a").num_cached_tokens == 80
    assert route(router, list(range(30)), request_id="req-b").decode_worker_id == "w2"
    router.observe(beat("w1", reports=[PrefixReport(request_id="req-a-0", num_prompt_tokens=200,
                                                    num_cached_tokens=88)]))
    router.observe(beat("w2", reports=[PrefixReport(request_id="req-b", num_prompt_tokens=30, num_cached_tokens=0),
                                       PrefixReport(request_id="other", num_prompt_tokens=5, num_cached_tokens=5)]))
    value = router.metrics.registry.get_sample_value
    assert value("kvbus_router_cached_tokens_error_count") == 2
    assert value("kvbus_router_cached_tokens_error_bucket", {"le": "0.0"}) == 1  # req-b: exact
    assert value("kvbus_router_cached_tokens_error_bucket", {"le": "16.0"}) == 2  # req-a: 8 more than predicted
    assert value("kvbus_router_cached_tokens_predicted_total") == 80
    assert value("kvbus_router_cached_tokens_reported_total") == 88
    detail = router.detail()
    assert detail["reports_matched"] == "2" and detail["cached_tokens_exact"] == "1"
    router.observe(beat("w1", reports=[PrefixReport(request_id="req-a-0", num_prompt_tokens=200,
                                                    num_cached_tokens=88)]))
    assert value("kvbus_router_cached_tokens_error_count") == 2  # reported once, counted once


def test_router_metrics_show_the_index_and_decision_latency():
    from prometheus_client import generate_latest

    router, _ = make_router(beat("w1"), beat("w2"))
    router.observe_kv(stored("w1", 1, HASHES))
    router.observe_kv(stored("w1", 3, HASHES[:1]))  # a gap
    route(router)
    text = generate_latest(router.metrics.registry).decode()
    assert 'kvbus_router_index_pages{tier="device"} 12.0' in text
    assert "kvbus_router_kv_event_gaps_total 1.0" in text
    assert 'kvbus_router_workers{role="worker"} 2.0' in text
    assert "kvbus_router_decision_seconds_count 1.0" in text


# --- hashing as the workers do ---------------------------------------------------------------------
@pytest.mark.parametrize("page_size,length,salt", [(16, 200, ""), (16, 17, ""), (16, 16, "t"), (7, 250, "tenant"),
                                                   (32, 1, ""), (1, 9, "")])
def test_prompt_pages_hash_as_the_engine_does_lazily_and_remembered(page_size, length, salt):
    from services.engine.page_hash import root_hash
    from services.router.prompt import PromptPages

    rng = random.Random(length)
    ids = [rng.randrange(2**32) for _ in range(length)]
    limit = (length - 1) // page_size
    want = page_hashes(ids[: limit * page_size], page_size, salt)
    for _ in range(2):  # the second time from the memo
        pages = PromptPages(ids, page_size, root_hash(salt))
        assert len(pages) == limit and pages.computed == []
        assert next(iter(pages), None) == (want[0] if want else None)
        assert len(pages.computed) == min(limit, 8)  # a lookup that stops early hashes little
        assert list(pages) == want and pages.hashes == want
        k = min(2, limit)
        tails = pages.tails(k)
        parent = want[k - 1] if k else root_hash(salt)
        longest = min(page_size - 1, length - 1 - k * page_size)
        assert tails == [(m, hash_tail(parent, ids[k * page_size:k * page_size + m])) for m in range(longest, 0, -1)]


def test_a_token_id_out_of_range_is_invalid_not_internal():
    from bus.errors import InvalidArgument

    router, _ = make_router(beat("w1"))
    with pytest.raises(InvalidArgument, match="prompt_token_ids must be integers"):
        route(router, [5] * 40 + [-1] + [5] * 40)
