"""Process-wide torch settings an engine wants, made once where its process starts.

``torch.set_num_threads`` and ``torch.manual_seed`` change the whole process, so no constructor
calls them: :func:`build_engine` makes them, then the engine. The engine thread builds every
service's engine that way (``AsyncEngine.create``); tests and benches that step an engine
themselves call it too.
"""

from __future__ import annotations

import os

import torch

from typing import TYPE_CHECKING

from services.engine.config import EngineConfig

if TYPE_CHECKING:
    from services.engine.engine import LLMEngine


def configure_torch(config: EngineConfig) -> None:
    """CPU engines: torch's threads (``num_threads``, 0: every core this process may run on).
    The global RNG, which requests without a seed of their own draw from: ``seed``."""
    if config.device == "cpu":
        torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)) or 1)
    torch.manual_seed(config.seed)


def build_engine(config: EngineConfig | None = None, **kwargs) -> LLMEngine:
    """:func:`configure_torch`, then ``LLMEngine(config, **kwargs)``, on the calling thread (the one
    that will step it: its OpenMP pool is that thread's; ``engine_thread.py``)."""
    from services.engine.engine import LLMEngine

    config = config or EngineConfig()
    configure_torch(config)
    return LLMEngine(config, **kwargs)
