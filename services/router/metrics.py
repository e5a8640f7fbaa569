"""The router's Prometheus metrics (a registry per router; ``--metrics-port`` serves them).

Counted as they happen: decisions by policy, stage and reason, decision latency, and the router's
accuracy: for each request a worker reports finished (its heartbeat's ``prefix_reports``), the
cached prompt tokens it really found minus what this router predicted, as a histogram, beside the
two totals. Read at scrape time from the router's state: workers by role, the load it sees on each
(labels ``role`` and ``worker``: the worker's own, not this router's), the KV index (pages per tier,
publishers, event gaps, resyncs, dump failures, approximate-mode workers) and sessions (held, pinned,
moved by reason).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
"""Reported minus predicted cached tokens: ``le="0"`` less ``le="-1"`` counts exact predictions."""


class RouterMetrics:
    def __init__(self, router):
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvbus_router_decisions", "Routing decisions by policy, stage and reason "
                                 "(session, overlap, load, or the policy's name).",
                                 ["policy", "stage", "reason"], registry=r)
        self.decision_seconds = Histogram("kvbus_router_decision_seconds", "Time to make one routing decision "
                                          "(hashing the prompt included).", buckets=LATENCY_BUCKETS, registry=r)
        self.cached_error = Histogram("kvbus_router_cached_tokens_error", "Per request: cached prompt tokens the "
                                      "worker reported minus the router's prediction.", buckets=ERROR_BUCKETS,
                                      registry=r)
        self.cached_predicted = Counter("kvbus_router_cached_tokens_predicted", "Cached prompt tokens predicted, "
                                        "over the requests the workers reported.", registry=r)
        self.cached_reported = Counter("kvbus_router_cached_tokens_reported", "Cached prompt tokens the workers "
                                       "reported, over the same requests.", registry=r)
        r.register(_StateCollector(router))
        self.num_cached_predicted = self.num_cached_reported = self.num_exact = 0
        """The same totals as plain numbers (health output), and the reports predicted exactly."""

    def observe_decision(self, policy: str, stage: str, reason: str) -> None:
        self.decisions.labels(policy, stage, reason).inc()

    def observe_report(self, predicted: int, reported: int) -> None:
        self.cached_error.observe(reported - predicted)
        self.cached_predicted.inc(predicted)
        self.cached_reported.inc(reported)
        self.num_cached_predicted += predicted
        self.num_cached_reported += reported
        self.num_exact += predicted == reported


class _StateCollector:
    def __init__(self, router):
        self.router = router

    def collect(self):
        router = self.router
        G, C = GaugeMetricFamily, CounterMetricFamily
        workers = G("kvbus_router_workers", "Alive workers by role.", labels=["role"])
        for role, n in sorted(router.workers.count_by_role().items()):
            workers.add_metric([role], n)
        yield workers
        yield from _load_seen(router.workers)
        detail = router.policy.detail()
        if detail:
            pages = G("kvbus_router_index_pages", "(worker or store, page) entries in the KV index by tier; "
                      "predicted: approximate-mode pages.", labels=["tier"])
            for tier in ("device", "host", "disk", "predicted"):
                pages.add_metric([tier], detail.get(f"pages_{tier}", 0))
            yield pages
            yield G("kvbus_router_index_publishers", "KV event publishers followed (workers and kv_stores).",
                    value=detail.get("publishers", 0))
            yield G("kvbus_router_index_publishers_synced", "Publishers in step (their pages get credit).",
                    value=detail.get("publishers_synced", 0))
            yield G("kvbus_router_workers_approximate", "Workers publishing no KV events: credited with what "
                    "this router sent them.", value=detail.get("workers_approximate", 0))
            yield C("kvbus_router_kv_event_gaps", "Gaps in a publisher's event ids (events lost).",
                    value=detail.get("gaps", 0))
            yield C("kvbus_router_kv_resyncs", "Dumps applied (worker joins, gaps, restarts).",
                    value=detail.get("resyncs", 0))
            yield C("kvbus_router_kv_dump_failures", "Dumps not answered.", value=detail.get("dump_failures", 0))
        sessions = router.sessions
        yield G("kvbus_router_sessions", "Sessions pinned to a worker now.", value=len(sessions))
        yield C("kvbus_router_session_pins", "Sessions pinned (first request, or first after the idle TTL).",
                value=sessions.num_pins)
        moves = C("kvbus_router_session_moves", "Sessions moved off their worker, by reason.", labels=["reason"])
        for reason in ("busy", "left", "excluded"):
            moves.add_metric([reason], sessions.num_moves[reason])
        yield moves


def _load_seen(registry):
    """The load each alive worker shows this router: its last heartbeat plus what was routed there since,
    the numbers the policies weigh."""
    G = GaugeMetricFamily
    labels = ["role", "worker"]
    requests = G("kvbus_router_worker_num_requests", "Running + waiting requests of a worker as this router "
                 "sees them (last heartbeat, plus requests routed there since).", labels=labels)
    prefill = G("kvbus_router_worker_prefill_tokens", "Queued prefill tokens of a worker as this router sees "
                "them (last heartbeat, plus prompts routed there since).", labels=labels)
    usage = G("kvbus_router_worker_kv_cache_usage_perc", "Share of a worker's KV pool in use, from its last "
              "heartbeat.", labels=labels)
    age = G("kvbus_router_worker_heartbeat_age_seconds", "Seconds since a worker's last heartbeat.",
            labels=labels)
    now = registry.clock()
    for w in registry.alive():
        key = [w.role, w.worker_id]
        requests.add_metric(key, w.num_requests)
        prefill.add_metric(key, w.num_prefill_tokens)
        usage.add_metric(key, 1.0 - w.free_page_fraction)
        age.add_metric(key, max(0.0, now - w.last_seen))
    yield from (requests, prefill, usage, age)
