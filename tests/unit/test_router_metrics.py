"""The router's /metrics: the load it sees on each worker (heartbeat plus what it routed since)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_router_policy import beat, make_router, route


def _load(router) -> dict[tuple[str, str, str], float]:
    """(series, role, worker) -> value of the kvbus_router_worker_* series."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(router.metrics.registry).decode()):
        for s in fam.samples:
            if s.name.startswith("kvbus_router_worker_"):
                out[(s.name, s.labels["role"], s.labels["worker"])] = s.value
    return out


def test_load_seen_follows_heartbeats_routes_and_departures():
    router, clock = make_router(beat("d1", running=2, waiting=1, free=25, total=100),
                                beat("p1", "prefill", queued=300, free=100, total=100))
    clock.now += 0.5
    m = _load(router)
    assert m[("kvbus_router_worker_num_requests", "decode", "d1")] == 3
    assert m[("kvbus_router_worker_kv_cache_usage_perc", "decode", "d1")] == 0.75
    assert m[("kvbus_router_worker_prefill_tokens", "prefill", "p1")] == 300
    assert m[("kvbus_router_worker_heartbeat_age_seconds", "prefill", "p1")] == 0.5

    decode, prefill = route(router)  # 100 prompt tokens: prefilled on p1, decoded on d1
    assert (decode, prefill) == ("d1", "p1")
    m = _load(router)
    assert m[("kvbus_router_worker_num_requests", "decode", "d1")] == 4  # routed since the heartbeat
    assert m[("kvbus_router_worker_prefill_tokens", "prefill", "p1")] > 300

    clock.now += router.config.worker_ttl  # both silent past the TTL: gone from the series
    assert _load(router) == {}
