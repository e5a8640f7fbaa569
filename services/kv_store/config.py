"""Configuration of the kv_store service (one per host)."""

from __future__ import annotations

import dataclasses

from services.config import ConfigError


@dataclasses.dataclass(frozen=True)
class KVStoreConfig:
    host_id: str | None = None
    """Host this store serves (engines with the same host id map its arena); default: the host name."""
    hicache_ratio: float = 2.0
    """L2 size in KV pools per engine: ratio x the first attached engine's pool x ``hicache_engines`` (kvbus up
    gives every engine of a host the same pool); used when hicache_size is unset."""
    hicache_engines: int = 1
    """Engines that will share this store (kvbus up passes the engines it starts on the host): each gets
    hicache_ratio pools of L2, as SGLang sizes its host pool per instance. Two decoders sharing an L2 of
    two pools held less than their own pools together and dropped write-backs (docs/benchmarks.md)."""
    hicache_size: float | None = None
    """L2 size in GB; overrides hicache_ratio."""
    memory_reserve: float = 1.0
    """GB of RAM (and /dev/shm) left free: the store refuses an L2 that would eat into it."""
    hicache_prefault: bool = True
    """Commit L2's memory when the arena is made, in the background (~0.7 s a GB on the 2-core dev VM),
    so a write-back never pays the first touch of its slot (page faults: ~10x the copy itself)."""
    hicache_storage_dir: str | None = None
    """L3 directory of page files; None: no disk tier."""
    hicache_storage_size: float = 16.0
    """Most GB of page files kept in L3 (LRU)."""
    hicache_l3_admit_hits: int = 1
    """A page evicted from L2 goes to L3 only if it was hit at least this many times in L2 (0: always)."""
    max_lease: int = 256
    """Most empty slots one engine may hold for write-back at once (and never more than lease_share of the arena)."""
    lease_share: float = 1 / 8
    """Most of the arena one engine may hold leased, so promotions and other engines find slots.
    1/8 of an arena twice the engine's pool (the default ratio) is its write-back window (a quarter
    of its pool): at 1/16 a burst of evictions outran the leases and pages were dropped."""
    transfer_timeout: float = 30.0
    """Seconds a write-back from an engine on another host may take to arrive after its offer."""
    metrics_port: int = 0
    """Port of the store's Prometheus endpoint (GET /metrics: slots, hits and misses per tier, evictions); 0: none."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (0.0.0.0 to be scraped from other machines)."""

    def __post_init__(self) -> None:
        if not self.hicache_ratio > 0:
            raise ConfigError(f"KVStoreConfig.hicache_ratio must be > 0, got {self.hicache_ratio}")
        if self.hicache_engines < 1:
            raise ConfigError(f"KVStoreConfig.hicache_engines must be >= 1, got {self.hicache_engines}")
        if self.hicache_size is not None and not self.hicache_size > 0:
            raise ConfigError(f"KVStoreConfig.hicache_size must be > 0 GB, got {self.hicache_size}")
        if self.memory_reserve < 0 or not self.hicache_storage_size > 0:
            raise ConfigError("KVStoreConfig.memory_reserve must be >= 0 and hicache_storage_size > 0")
        if not 0 < self.lease_share <= 1:
            raise ConfigError(f"KVStoreConfig.lease_share must be in (0, 1], got {self.lease_share}")
        if self.hicache_l3_admit_hits < 0 or self.max_lease < 1:
            raise ConfigError("KVStoreConfig.hicache_l3_admit_hits must be >= 0 and max_lease >= 1")
        if not self.transfer_timeout > 0:
            raise ConfigError(f"KVStoreConfig.transfer_timeout must be > 0, got {self.transfer_timeout}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"KVStoreConfig.metrics_port must be in 0..65535, got {self.metrics_port}")
