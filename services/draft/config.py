"""Configuration of the draft service (``kvbus serve draft``)."""

from __future__ import annotations

import dataclasses

from services.config import ConfigError, plugin


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    model: str | None = None
    """The target model's local folder (None: the default model): its tokenizer must match the draft model's."""
    speculative_method: str = plugin("services.draft.base:DRAFTERS", "ngram")
    """Drafter, by name (services.draft.base.DRAFTERS: ngram, prompt lookup; model, a small draft model)."""
    draft_model: str | None = None
    """speculative_method=model: local HF folder of the draft model."""
    num_speculative_tokens: int = 8
    """Most tokens proposed per request and call, whatever a worker asks."""
    ngram_min: int = 2
    """ngram: shortest context tail looked up."""
    ngram_max: int = 4
    """ngram: longest context tail looked up."""
    device: str = "cpu"
    """model: torch device of the draft model."""
    max_streams: int = 4096
    """Most request streams held; past it the least recently used is dropped (its worker resyncs)."""
    metrics_port: int = 0
    """Port of the draft service's Prometheus endpoint (GET /metrics: batches, proposals, resyncs); 0: none."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics endpoint binds (0.0.0.0 to be scraped from other machines)."""

    def __post_init__(self) -> None:
        from services.draft.base import speculative_method_problem  # the drafter registry says

        problem = speculative_method_problem(self) if self.speculative_method else ("speculative_method", "is needed")
        if problem is not None:
            field, why = problem
            raise ConfigError(f"DraftConfig.{field} {why}, got {getattr(self, field)!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("DraftConfig.num_speculative_tokens must be in [1, 16]")
        if self.max_streams < 1:
            raise ConfigError("DraftConfig.max_streams must be >= 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"DraftConfig.metrics_port must be in 0..65535, got {self.metrics_port}")
