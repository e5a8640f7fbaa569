"""The gateway's Prometheus metrics, on a registry of its own (tests run several gateways).

The request-level series a client sees (TTFT, TPOT, inter-token latency, end to end, tokens,
speculation), named as vLLM names them with ``kvbus_`` for ``vllm:`` (docs/observability.md has the
table). Served at the HTTP port's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from schemas.engine import Usage

# Seconds; fine at the low end where CPU decode steps and cached TTFTs live.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)
_ACCEPTED_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 9.0)
_SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    """Counters and histograms; ``render()`` gives the Prometheus text format."""

    def __init__(self, num_inflight: Callable[[], int] | None = None,
                 migrations: Callable[[], tuple[int, int]] | None = None):
        """``num_inflight``: generations in flight now; ``migrations``: (requests migrated, requests that
        ran out of migrations), both read at scrape time."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvbus_requests", "Finished requests by endpoint and HTTP-like status.",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvbus_request_errors", "Failed requests by error code.", ["code"], registry=r)
        self.ttft = Histogram("kvbus_time_to_first_token_seconds", "Request received to first token sent.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvbus_inter_token_latency_seconds",
                             "Gap between streamed chunks divided by the tokens the later one carries.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvbus_e2e_request_latency_seconds", "Request received to last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.tpot = Histogram("kvbus_request_time_per_output_token_seconds",
                              "Per request of two tokens or more: its first token to its last over the "
                              "tokens after the first (TPOT).", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvbus_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_prompt_tokens = Counter("kvbus_cached_tokens",
                                            "Prompt tokens served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("kvbus_generation_tokens", "Generated tokens streamed to callers.",
                                         registry=r)
        # speculative decoding (docs/speculative.md), from the usage of requests that speculated
        self.draft_tokens = Counter("kvbus_spec_decode_num_draft_tokens", "Drafted tokens the target verified.",
                                    registry=r)
        self.accepted_draft_tokens = Counter("kvbus_spec_decode_num_accepted_tokens",
                                             "Drafted tokens the target accepted (acceptance rate: this "
                                             "over kvbus_spec_decode_num_draft_tokens).", registry=r)
        self.accepted_length = Histogram("kvbus_spec_decode_accept_length",
                                         "Per speculating request: tokens appended per verification step.",
                                         buckets=_ACCEPTED_LENGTH_BUCKETS, registry=r)
        self.draft_share = Histogram("kvbus_spec_decode_draft_time_share",
                                     "Per speculating request: share of its decode time (first token to last) "
                                     "its steps spent drafting, a remote drafter's round trip included.",
                                     buckets=_SHARE_BUCKETS, registry=r)
        self.inflight = Gauge("kvbus_gateway_num_requests_running", "Generations in flight in this gateway.",
                              registry=r)
        if num_inflight is not None:
            self.inflight.set_function(num_inflight)
        r.register(_MigrationCollector(migrations or (lambda: (0, 0))))

    def observe_request(self, endpoint: str, status: int, error_code: str | None = None) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if error_code is not None:
            self.errors.labels(code=error_code).inc()

    def observe_usage(self, usage: Usage, decode_seconds: float = 0.0) -> None:
        """A finished request's usage; ``decode_seconds``: its first token to its last."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        if usage.completion_tokens > 1 and decode_seconds > 0:
            self.tpot.observe(decode_seconds / (usage.completion_tokens - 1))
        if usage.draft_tokens:
            self.draft_tokens.inc(usage.draft_tokens)
            self.accepted_draft_tokens.inc(usage.accepted_draft_tokens)
            self.accepted_length.observe(usage.mean_accepted_length)
            if decode_seconds > 0:
                self.draft_share.observe(min(1.0, usage.draft_seconds / decode_seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MigrationCollector:
    """Migrations counted by the pipeline (a worker died mid-stream), read at scrape time."""

    def __init__(self, migrations: Callable[[], tuple[int, int]]):
        self.migrations = migrations

    def collect(self):
        num_migrations, num_failed = self.migrations()
        yield CounterMetricFamily("kvbus_migrations", "Requests moved to another worker after theirs failed "
                                  "mid-stream (each move counts).", value=num_migrations)
        yield CounterMetricFamily("kvbus_migrations_failed", "Requests that ran out of migrations (or of workers) "
                                  "and ended unavailable.", value=num_failed)
