"""kvbus's own model runtime and continuous-batching engine.

Heavy names (torch) load on first use, so ``services.engine.page_hash`` stays
cheap to import for the router and the kv_store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "services.engine.config",
    "LLMEngine": "services.engine.engine",
    "AsyncEngine": "services.engine.async_api",
    "configure_torch": "services.engine.process",
    "build_engine": "services.engine.process",
    "CacheTierHooks": "services.engine.tier_hooks",
    "NoTierHooks": "services.engine.tier_hooks",
    "TierHooksList": "services.engine.tier_hooks",
    "ModelConfig": "services.engine.model_config",
    "UnsupportedModelError": "services.engine.model_config",
    "RequestError": "services.engine.outputs",
    "PrefillResult": "services.engine.outputs",
    "Completion": "services.engine.outputs",
    "EngineStats": "services.engine.outputs",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from services.engine.async_api import AsyncEngine
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.process import build_engine, configure_torch
    from services.engine.outputs import Completion, EngineStats, PrefillResult, RequestError
    from services.engine.model_config import ModelConfig, UnsupportedModelError
    from services.engine.tier_hooks import CacheTierHooks, NoTierHooks, TierHooksList


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
