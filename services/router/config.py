"""The router's configuration (``kvbus serve router --help`` is generated from it)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from services.config import ConfigError, check_choices, plugin

DisaggregationMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    policy: str = plugin("services.router.policy:POLICIES", "kv")
    """How to choose among workers: kv (where the prompt's KV pages are cached, then load), round_robin,
    random or least_loaded."""
    worker_ttl: float = 3.0
    """Seconds without a heartbeat after which a worker is dropped."""
    disaggregation: DisaggregationMode = "auto"
    """auto: use a prefill worker when any is alive and the prompt is long enough; always: every
    request on a decode worker with a prefill worker (unavailable without one); never: prefill
    where the tokens are decoded."""
    min_disagg_tokens: int = 32
    """Prompts (uncached part) shorter than this are prefilled on the decode worker in auto mode."""
    max_requests_per_worker: int = 0
    """A decode or aggregated worker with this many running + waiting requests is busy and skipped
    (0: no limit; the worker's own admission still applies)."""
    max_prefill_tokens_per_worker: int = 0
    """A prefill worker with this many queued prefill tokens is busy and skipped (0: no limit)."""
    min_free_page_fraction: float = 0.0
    """A worker whose free KV pages fall below this fraction of its pool is busy and skipped (0: off)."""
    seed: int | None = None
    """Seed of the random policy and of kv's softmax sampling (tests, reproducible benchmarks); default:
    unseeded."""
    # --- the kv policy ---
    kv_overlap_weight: float = 1.0
    """kv: weight of the prefill tokens left after overlap credits against the worker's load (tokens)."""
    router_temperature: float = 0.0
    """kv: 0 takes the lowest cost; above 0 samples workers by softmax of their normalised costs over this
    temperature (spreads ties and near-ties)."""
    kv_credit_device: float = 1.0
    """kv: credit of a prompt page in the worker's own KV pool (no prefill for it)."""
    kv_credit_host: float = 0.75
    """kv: credit of a page in the worker's host kv_store memory (L2: loaded back, not recomputed)."""
    kv_credit_disk: float = 0.25
    """kv: credit of a page in the host kv_store's disk tier (L3)."""
    kv_approx_ttl: float = 120.0
    """kv: seconds a prompt page the router sent to a worker publishing no KV events counts as held there
    (approximate mode)."""
    kv_dump_timeout: float = 5.0
    """kv: seconds to wait for a publisher's dump (full KV state) when it joins or after a gap in its events."""
    kv_publisher_ttl: float = 60.0
    """kv: a KV publisher that is no live worker (a kv_store) and is silent this long is asked for a dump;
    no answer purges its pages."""
    session_ttl: float = 300.0
    """Seconds a conversation (session_id) stays on its decode worker after its last request (0: no
    affinity). It moves earlier when the worker leaves or is busy."""
    max_sessions: int = 100_000
    """Most sessions remembered; past it the least recently used are forgotten."""
    metrics_port: int = 0
    """Port of the router's Prometheus endpoint (GET /metrics: decisions, index, sessions, accuracy); 0: none."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (0.0.0.0 to be scraped from other machines)."""

    def __post_init__(self) -> None:
        check_choices(self)  # policy: the router policy registry
        if self.disaggregation not in ("auto", "always", "never"):
            raise ConfigError(f"RouterConfig.disaggregation must be auto, always or never, "
                              f"got {self.disaggregation!r}")
        for name in ("worker_ttl", "kv_approx_ttl", "kv_dump_timeout", "kv_publisher_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.min_disagg_tokens < 0 or self.max_requests_per_worker < 0 \
                or self.max_prefill_tokens_per_worker < 0:
            raise ConfigError("RouterConfig.min_disagg_tokens, max_requests_per_worker and "
                              "max_prefill_tokens_per_worker must be >= 0")
        if not 0.0 <= self.min_free_page_fraction < 1.0:
            raise ConfigError(f"RouterConfig.min_free_page_fraction must be in [0, 1), "
                              f"got {self.min_free_page_fraction}")
        for name in ("kv_overlap_weight", "router_temperature", "session_ttl"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"RouterConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("kv_credit_device", "kv_credit_host", "kv_credit_disk"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"RouterConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_sessions < 1:
            raise ConfigError(f"RouterConfig.max_sessions must be >= 1, got {self.max_sessions}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"RouterConfig.metrics_port must be in 0..65535, got {self.metrics_port}")
