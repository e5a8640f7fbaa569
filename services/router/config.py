"""The router's configuration (``kvbus serve router --help`` is generated from it)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from services.config import ConfigError
from services.router.policy import POLICIES

DisaggregationMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    policy: str = "least_loaded"
    """How to choose among workers: round_robin, random or least_loaded."""
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
    """Seed of the random policy (tests, reproducible benchmarks); default: unseeded."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"RouterConfig.policy must be one of {', '.join(sorted(POLICIES))}, "
                              f"got {self.policy!r}")
        if self.disaggregation not in ("auto", "always", "never"):
            raise ConfigError(f"RouterConfig.disaggregation must be auto, always or never, "
                              f"got {self.disaggregation!r}")
        if not self.worker_ttl > 0:
            raise ConfigError(f"RouterConfig.worker_ttl must be > 0, got {self.worker_ttl}")
        if self.min_disagg_tokens < 0 or self.max_requests_per_worker < 0 \
                or self.max_prefill_tokens_per_worker < 0:
            raise ConfigError("RouterConfig.min_disagg_tokens, max_requests_per_worker and "
                              "max_prefill_tokens_per_worker must be >= 0")
        if not 0.0 <= self.min_free_page_fraction < 1.0:
            raise ConfigError(f"RouterConfig.min_free_page_fraction must be in [0, 1), "
                              f"got {self.min_free_page_fraction}")
