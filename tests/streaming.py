"""Streaming a generation from an engine worker on the bus and collecting its tokens."""

from __future__ import annotations

import uuid

from bus.subjects import WORKER_GENERATE
from schemas.worker import WorkerGenerateRequest


async def worker_tokens(client, worker_id: str, prompt: list[int], sampling, **fields) -> list[int]:
    """The tokens ``worker_id`` streams for ``prompt``; ``fields``: more WorkerGenerateRequest fields."""
    req = WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling, **fields)
    out: list[int] = []
    async with client.stream(WORKER_GENERATE, req, worker_id=worker_id) as chunks:
        async for chunk in chunks:
            out += chunk.token_ids
    return out
