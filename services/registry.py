"""Service roles by name, imported lazily so a CPU test never imports CUDA code."""

from __future__ import annotations

from services.plugins import Registry

ROLES = Registry("role", {
    "tokenizer": "services.tokenizer:TokenizerActor",
    "gateway": "services.gateway.actor:GatewayActor",
    "router": "services.router.actor:RouterActor",
    "worker": "services.workers.actor:WorkerActor",
    "prefill": "services.workers.prefill:PrefillActor",
    "decode": "services.workers.decode:DecodeActor",
    "draft": "services.draft.actor:DraftActor",
    "kv_store": "services.kv_store.actor:KVStoreActor",
})


def actor_class(role: str) -> type:
    return ROLES.get(role)
