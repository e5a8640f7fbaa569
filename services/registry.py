"""Service roles by name, imported lazily so a CPU test never imports CUDA code."""

from __future__ import annotations

import importlib

ROLES: dict[str, str] = {
    "tokenizer": "services.tokenizer:TokenizerActor",
    "gateway": "services.gateway.actor:GatewayActor",
    "router": "services.router.actor:RouterActor",
    "worker": "services.workers.actor:WorkerActor",
    "prefill": "services.workers.prefill:PrefillActor",
    "decode": "services.workers.decode:DecodeActor",
    "draft": "services.draft.actor:DraftActor",
    "kv_store": "services.kv_store.actor:KVStoreActor",
}


def actor_class(role: str) -> type:
    try:
        target = ROLES[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(sorted(ROLES))}") from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
