"""Streaming a generation from an engine worker on the bus and collecting its tokens, and the cold
reference they are compared with."""

from __future__ import annotations

import gc
import uuid

from bus.subjects import WORKER_GENERATE
from schemas.engine import Usage
from schemas.worker import WorkerGenerateRequest


async def worker_stream(client, worker_id: str, prompt: list[int], sampling, **fields) -> tuple[list[int], Usage | None]:
    """The tokens ``worker_id`` streams for ``prompt``, and the usage of its last chunk that has one;
    ``fields``: more WorkerGenerateRequest fields."""
    req = WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling, **fields)
    out: list[int] = []
    usage = None
    async with client.stream(WORKER_GENERATE, req, worker_id=worker_id) as chunks:
        async for chunk in chunks:
            out += chunk.token_ids
            usage = chunk.usage or usage
    return out, usage


async def worker_tokens(client, worker_id: str, prompt: list[int], sampling, **fields) -> list[int]:
    """The tokens ``worker_id`` streams for ``prompt`` (``worker_stream`` without the usage)."""
    return (await worker_stream(client, worker_id, prompt, sampling, **fields))[0]


def cold_tokens(engine_config, prompt: list[int], sampling) -> list[int]:
    """``prompt``'s tokens from a fresh engine with no prefix cache (what a run on cached pages must
    match), freed at once: CI's one process holds many engines."""
    from services.engine import LLMEngine

    cold = LLMEngine(engine_config.replace(enable_prefix_caching=False))
    tokens = cold.generate_sync([prompt], sampling)[0].token_ids
    del cold
    gc.collect()
    return tokens
