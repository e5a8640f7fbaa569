"""The router's decision over a registry fed by fake heartbeats and a fake clock (no bus)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from bus.errors import InvalidArgument, Overloaded, Unavailable
from schemas.worker import RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services import config as cfg
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.policy import POLICIES, Policy, make_policy
from services.router.scoring import RouteContext
from services.router.workers import WorkerRegistry

LONG = list(range(100))
SHORT = [1, 2, 3]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str, role: str = "decode", *, running: int = 0, waiting: int = 0, free: int = 100,
         total: int = 100, queued: int = 0, host: str = "h1", draining: bool = False,
         model: str = "m", page_size: int = 16) -> WorkerHeartbeatEvent:
    return WorkerHeartbeatEvent(
        worker_id=worker_id, role=role, host_id=host, model=model, page_size=page_size,
        load=WorkerLoad(num_running=running, num_waiting=waiting, num_free_pages=free,
                        num_total_pages=total, num_queued_prefill_tokens=queued),
        is_draining=draining)


def make_router(*beats: WorkerHeartbeatEvent, **config) -> tuple[Router, FakeClock]:
    """A router over these workers; least_loaded (the default before kv) unless ``policy`` says otherwise:
    these tests are about load, membership and disaggregation (the kv policy: test_router_kv_policy.py)."""
    clock = FakeClock()
    router = Router(RouterConfig(**{"policy": "least_loaded", **config}), clock=clock)
    for event in beats:
        router.observe(event)
    return router, clock


def route(router: Router, ids=LONG, exclude=()) -> tuple[str, str | None]:
    reply = router.route(RouteRequest(request_id="r", prompt_token_ids=list(ids), exclude_worker_ids=list(exclude)))
    return reply.decode_worker_id, reply.prefill_worker_id


# --- the registry ------------------------------------------------------------------------
def test_registry_ttl_expiry_is_lazy_and_swept():
    clock = FakeClock()
    left = []
    reg = WorkerRegistry(3.0, clock=clock, on_leave=lambda w, why: left.append((w.worker_id, why)))
    assert reg.observe(beat("a")) is True and reg.observe(beat("b")) is True
    assert reg.observe(beat("a")) is False  # known already
    clock.now += 2.0
    reg.observe(beat("b"))  # b keeps beating, a goes silent
    clock.now += 1.5  # a: 3.5 s of silence, b: 1.5 s
    assert reg.known_ids() == ["a", "b"]  # nothing expires until someone looks
    assert [w.worker_id for w in reg.alive()] == ["b"]
    assert left == [("a", "silent for more than 3s")]
    clock.now += 3.0
    assert reg.expire() == ["b"] and reg.known_ids() == [] and len(reg) == 0


def test_registry_draining_drops_at_once_and_a_new_beat_brings_back():
    reg = WorkerRegistry(3.0, clock=FakeClock())
    reg.observe(beat("a"))
    reg.observe(beat("a", draining=True))
    assert reg.known_ids() == []
    assert reg.observe(beat("a")) is True  # restarted
    assert reg.get("a").role == "decode"


def test_registry_filters_roles_and_counts_routed_until_next_heartbeat():
    reg = WorkerRegistry(3.0, clock=FakeClock())
    reg.observe(beat("p", "prefill", queued=10))
    reg.observe(beat("d", "decode", running=2, waiting=1))
    reg.observe(beat("w", "worker"))
    assert [w.worker_id for w in reg.alive(("decode", "worker"))] == ["d", "w"]
    assert reg.count_by_role() == {"prefill": 1, "decode": 1, "worker": 1}
    reg.note_routed("d", num_requests=2)
    reg.note_routed("p", num_prefill_tokens=90)
    assert reg.get("d").num_requests == 5 and reg.get("p").num_prefill_tokens == 100
    reg.observe(beat("d", running=4))
    assert reg.get("d").num_requests == 4


# --- policies ----------------------------------------------------------------------------
def test_round_robin_cycles_and_survives_membership_changes():
    router, _ = make_router(beat("d1"), beat("d2"), beat("d3"), policy="round_robin")
    assert [route(router)[0] for _ in range(5)] == ["d1", "d2", "d3", "d1", "d2"]
    router.observe(beat("d3", draining=True))
    router.observe(beat("d0"))
    assert [route(router)[0] for _ in range(3)] == ["d0", "d1", "d2"]


def test_round_robin_prefill_cycles_separately():
    router, _ = make_router(beat("d1"), beat("p1", "prefill"), beat("p2", "prefill"), policy="round_robin")
    assert [route(router) for _ in range(3)] == [("d1", "p1"), ("d1", "p2"), ("d1", "p1")]


def test_random_is_seeded_and_uses_every_worker():
    picks = []
    for _ in range(2):
        router, _ = make_router(beat("d1"), beat("d2"), beat("d3"), policy="random", seed=7)
        picks.append([route(router)[0] for _ in range(30)])
    assert picks[0] == picks[1]
    assert set(picks[0]) == {"d1", "d2", "d3"}


def test_least_loaded_decode_fewest_requests_then_most_free_pages():
    router, _ = make_router(beat("d1", running=3), beat("d2", running=1, waiting=1), beat("d3", running=2))
    assert route(router, SHORT)[0] == "d2"
    router, _ = make_router(beat("d1", running=1, free=10), beat("d2", waiting=1, free=80),
                            beat("d3", running=1, free=50))
    assert route(router, SHORT)[0] == "d2"


def test_least_loaded_spreads_a_burst_between_heartbeats():
    router, _ = make_router(beat("d1"), beat("d2", free=90), beat("d3", free=80))
    counts = Counter(route(router, SHORT)[0] for _ in range(9))
    assert counts == {"d1": 3, "d2": 3, "d3": 3}
    router.observe(beat("d1", running=0))  # a fresh report replaces the estimate
    assert route(router, SHORT)[0] == "d1"


def test_least_loaded_prefill_fewest_queued_tokens_then_same_host():
    router, _ = make_router(beat("d1", host="hA"), beat("p1", "prefill", queued=500, host="hA"),
                            beat("p2", "prefill", queued=100, host="hB"), beat("p3", "prefill", queued=300, host="hA"))
    assert route(router) == ("d1", "p2")
    # p2 counts the 100 tokens routed to it until its next heartbeat: 200, still the least.
    assert route(router) == ("d1", "p2")
    assert route(router) == ("d1", "p3")  # p2 at 300 ties p3 at 300: p3 shares d1's host
    assert route(router) == ("d1", "p2")


def test_policy_registry_and_extension_point():
    assert set(POLICIES) >= {"round_robin", "random", "least_loaded"}
    assert make_policy("least_loaded").name == "least_loaded"
    with pytest.raises(ValueError, match="unknown router policy 'nope'"):
        make_policy("nope")

    class CachedPrefix(Policy):  # what the kv policy will do: see prompt ids and worker load
        name = "cached"
        seen: list = []

        def choose(self, stage, ctx, candidates):
            self.seen.append((stage, ctx.num_prompt_tokens, [w.num_requests for w in candidates]))
            return candidates[-1]

        def num_tokens_to_prefill(self, ctx: RouteContext, worker) -> int:
            return 0 if worker.worker_id == "d2" else ctx.num_prompt_tokens

    router = Router(RouterConfig(), clock=FakeClock(), policy=CachedPrefix())
    for event in (beat("d1", running=1), beat("d2"), beat("p1", "prefill")):
        router.observe(event)
    assert route(router) == ("d2", None)  # fully cached on d2: no transfer worth doing
    assert CachedPrefix.seen == [("decode", 100, [1, 0])]


# --- disaggregation, thresholds, exclusions, errors ---------------------------------------
def test_conditional_disaggregation_auto():
    router, _ = make_router(beat("d1"), beat("p1", "prefill"), min_disagg_tokens=32)
    assert route(router, list(range(31))) == ("d1", None)
    assert route(router, list(range(32))) == ("d1", "p1")
    router.observe(beat("p1", "prefill", draining=True))
    assert route(router, LONG) == ("d1", None)  # no prefill worker alive: prefill on the decoder


def test_aggregated_workers_never_get_a_prefill_worker():
    router, _ = make_router(beat("w1", "worker"), beat("p1", "prefill"))
    assert route(router, LONG) == ("w1", None)


def test_prefill_worker_must_match_model_and_page_size():
    router, _ = make_router(beat("d1"), beat("p1", "prefill", page_size=32), beat("p2", "prefill", model="other"))
    assert route(router) == ("d1", None)
    router.observe(beat("p3", "prefill", queued=9999))
    assert route(router) == ("d1", "p3")


def test_always_and_never_modes():
    router, _ = make_router(beat("d1"), beat("w1", "worker", running=5), disaggregation="always")
    with pytest.raises(Unavailable, match="no prefill worker.*disaggregation=always"):
        route(router, SHORT)
    router.observe(beat("p1", "prefill"))
    assert route(router, SHORT) == ("d1", "p1")  # short prompt, still disaggregated
    router.observe(beat("d1", draining=True))
    with pytest.raises(Unavailable, match="role decode"):
        route(router)  # the aggregated worker does not count in "always"
    router, _ = make_router(beat("d1"), beat("p1", "prefill"), disaggregation="never")
    assert route(router, LONG) == ("d1", None)


def test_exclusions_are_skipped():
    router, _ = make_router(beat("d1"), beat("d2", running=5), beat("p1", "prefill"), beat("p2", "prefill", queued=50))
    assert route(router, exclude=["d1", "p1"]) == ("d2", "p2")
    assert route(router, exclude=["p1", "p2"]) == ("d1", None)  # auto: fall back to local prefill
    with pytest.raises(Unavailable, match="all 2 alive were excluded"):
        route(router, exclude=["d1", "d2"])


def test_no_workers_is_unavailable_and_expired_workers_do_not_count():
    router, clock = make_router()
    with pytest.raises(Unavailable, match="none has sent a heartbeat in the last 3s"):
        route(router)
    router.observe(beat("d1"))
    assert route(router)[0] == "d1"
    clock.now += 3.01
    with pytest.raises(Unavailable):
        route(router)


def test_busy_thresholds_skip_workers_and_all_busy_is_overloaded():
    router, _ = make_router(beat("d1", running=4), beat("d2", running=1, free=5), beat("d3", running=2),
                            max_requests_per_worker=4, min_free_page_fraction=0.1)
    assert route(router, SHORT)[0] == "d3"  # d1 full, d2 short of pages
    assert route(router, SHORT)[0] == "d3"  # d3 now at 3 + 1 routed = 4: busy
    with pytest.raises(Overloaded, match="all 3 decode workers are busy"):
        route(router, SHORT)
    router, _ = make_router(beat("d1"), beat("p1", "prefill", queued=1000), max_prefill_tokens_per_worker=1000)
    with pytest.raises(Overloaded, match="all 1 prefill workers are busy"):
        route(router)


def test_empty_prompt_is_invalid():
    router, _ = make_router(beat("d1"))
    with pytest.raises(InvalidArgument):
        route(router, [])


# --- config ------------------------------------------------------------------------------
def test_router_config_cli_env_and_checks():
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, RouterConfig)
    help_text = parser.format_help()
    assert "KVBUS_WORKER_TTL" in help_text and "--min-disagg-tokens" in help_text
    built = cfg.build(RouterConfig, parser.parse_args(["--disaggregation", "never"]),
                      {"KVBUS_POLICY": "round_robin", "KVBUS_WORKER_TTL": "1.5"})
    assert built == RouterConfig(policy="round_robin", worker_ttl=1.5, disaggregation="never")
    with pytest.raises(cfg.ConfigError, match="RouterConfig.policy: unknown router policy 'kvv'; choose one of: kv, "):
        cfg.build(RouterConfig, {}, {"KVBUS_POLICY": "kvv"})
    with pytest.raises(cfg.ConfigError, match="disaggregation"):
        cfg.build(RouterConfig, {}, {"KVBUS_DISAGGREGATION": "sometimes"})
    with pytest.raises(cfg.ConfigError, match="worker_ttl"):
        RouterConfig(worker_ttl=0)
    with pytest.raises(cfg.ConfigError, match="min_free_page_fraction"):
        RouterConfig(min_free_page_fraction=1.0)
