"""Configuration of the engine workers (prefill, decode, aggregated): the engine's plus serving knobs."""

from __future__ import annotations

import dataclasses
import socket

from services.config import ConfigError, check_choices, plugin
from services.engine.config import EngineConfig


def default_host_id() -> str:
    return socket.gethostname()


@dataclasses.dataclass(frozen=True)
class WorkerConfig(EngineConfig):
    max_queue: int = 64
    """Requests that may wait for a batch slot beyond max_running_requests; past it callers get overloaded."""
    max_queue_wait: float = 30.0
    """Most seconds a new request may expect to wait for a batch slot (from recent service times);
    past it callers get overloaded at once, with a Retry-After."""
    peer_ttl: float = 3.0
    """Seconds without a heartbeat after which a prefill worker we wait on is taken for dead
    (the prompt is then prefilled locally at once)."""
    stream_interval: int = 1
    """Default tokens per streamed chunk (a request may ask for more)."""
    heartbeat_interval: float = 1.0
    """Seconds between WorkerHeartbeatEvents to the router."""
    kv_transfer: str = plugin("services.transfer.base:BACKENDS", "auto", extra=("auto",))
    """KV transfer backend: auto (shm on the same host, else nats) or a registered backend (shm, nats)."""
    transfer_timeout: float = 30.0
    """Seconds a KV transfer may take before it is abandoned and its pages freed."""
    transfer_missing_only: bool = True
    """Decode workers: tell the prefill worker how many leading prompt pages this worker holds (prefix
    cache, or host tier with hicache), so only the pages after them cross the transfer layer."""
    local_prefill_tokens: int = 0
    """Decode workers: prefill here, not on the named prefill worker, when at most this many prompt tokens
    are left after the pages this worker holds (conditional disaggregation; 0: always the prefill worker).
    kvbus up sets 1024 where the engines take turns on the same cores."""
    host_id: str | None = None
    """Identity of this machine for shared-memory transfer; default: the host name."""
    draft_placement: str = "local"
    """With speculative_method: local (the drafter runs in this process, called by the engine) or remote (the draft service, kvbus serve draft)."""
    draft_timeout: float = 0.05
    """remote drafting: seconds a step waits for proposals before it decodes plainly (then skips the service for a while)."""
    hicache: bool = False
    """Use this host's kv_store (HiCache): write evicted KV pages back to host memory, load prefix hits back."""
    hicache_write_policy: str = plugin("services.kv_store.policies:WRITE_POLICIES", "write_back")
    """When pages reach the host tier: write_back (on L1 eviction), write_through, write_through_selective."""
    hicache_selective_hits: int = 2
    """write_through_selective: L1 hits after which a page is copied to the host tier."""
    hicache_min_load_pages: int = 1
    """Fewest host-tier pages worth loading back; shorter runs are recomputed."""
    hicache_prefault: bool = True
    """Map the kv_store's arena into this worker ahead of use, in the background (~0.3 s a GB): a page's
    first touch from this process otherwise faults on the copy thread (~6x a write-back's copy)."""
    hicache_reconnect_interval: float = 1.0
    """Seconds between checks of the attachment to the kv_store (a restarted store is re-attached)."""
    hicache_timeout: float = 0.25
    """Seconds the worker waits for the kv_store's lookup before queueing a request anyway (then: recompute)."""
    hicache_store_host: str | None = None
    """Host id of the kv_store to use; default: this worker's host (map its arena). Another host: pages move by
    value through the transfer layer's nats backend, staged in a private host cache (docs/hicache.md)."""
    hicache_staging_ratio: float = 1.0
    """With a kv_store on another host: the private staging cache's size, in KV pools (at least 64 pages)."""
    hicache_fetch_timeout: float = 10.0
    """With a kv_store on another host: seconds a lookup may take, fetching pages included, before the request is
    queued anyway (its pages are then recomputed)."""
    metrics_port: int = 0
    """Port of this worker's Prometheus endpoint (GET /metrics: cache hits, HiCache traffic, load); 0: none."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (0.0.0.0 to be scraped from other machines)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_queue < 0:
            raise ConfigError(f"WorkerConfig.max_queue must be >= 0, got {self.max_queue}")
        if self.stream_interval < 1:
            raise ConfigError(f"WorkerConfig.stream_interval must be >= 1, got {self.stream_interval}")
        if not self.max_queue_wait > 0 or not self.peer_ttl > 0:
            raise ConfigError("WorkerConfig.max_queue_wait and peer_ttl must be > 0")
        if not self.heartbeat_interval > 0 or not self.transfer_timeout > 0:
            raise ConfigError("WorkerConfig.heartbeat_interval and transfer_timeout must be > 0")
        if self.draft_placement not in ("local", "remote"):
            raise ConfigError(f"WorkerConfig.draft_placement must be local or remote, got {self.draft_placement!r}")
        if not self.draft_timeout > 0:
            raise ConfigError("WorkerConfig.draft_timeout must be > 0")
        if self.hicache_selective_hits < 1 or self.hicache_min_load_pages < 1 or not self.hicache_timeout > 0:
            raise ConfigError("WorkerConfig.hicache_selective_hits and hicache_min_load_pages must be >= 1, "
                              "hicache_timeout > 0")
        if not (self.hicache_staging_ratio > 0 and self.hicache_fetch_timeout > 0):
            raise ConfigError("WorkerConfig.hicache_staging_ratio and hicache_fetch_timeout must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"WorkerConfig.metrics_port must be in 0..65535, got {self.metrics_port}")
        check_choices(self)  # kv_transfer, hicache_write_policy: their registries

    @property
    def engine_config(self) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        config = EngineConfig(**{n: getattr(self, n) for n in names})
        if self.draft_placement == "remote":  # the worker attaches a BusDrafter once on the bus
            config = config.replace(speculative_method=None)
        return config
