"""Configuration of the draft service (``kvbus serve draft``)."""

from __future__ import annotations

import dataclasses

from services.config import ConfigError


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    model: str | None = None
    """The target model's local folder (None: the default model): its tokenizer must match the draft model's."""
    speculative_method: str = "ngram"
    """Drafter: ngram (prompt lookup) or model (draft_model)."""
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

    def __post_init__(self) -> None:
        if self.speculative_method not in ("ngram", "model"):
            raise ConfigError(f"DraftConfig.speculative_method must be ngram or model, got {self.speculative_method!r}")
        if self.speculative_method == "model" and not self.draft_model:
            raise ConfigError("DraftConfig.draft_model is needed with speculative_method=model")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("DraftConfig.num_speculative_tokens must be in [1, 16]")
        if self.max_streams < 1:
            raise ConfigError("DraftConfig.max_streams must be >= 1")
