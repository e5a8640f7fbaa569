"""n choices of one prompt (``SamplingParams.n`` > 1, OpenAI's ``n``), on HTTP and NATS alike.

Each choice is its own stream through the pipeline (routing, migration, stop strings, the reply
parsers), with ``n = 1`` and its own seed: choice i draws from ``seed + i`` (mod 2**63), so choice 0 is
what the same request with ``n = 1`` gives; without a seed each choice is unseeded. Choice 0 starts
first; the others start once its first chunk is back, on the worker it went to: the prompt's full
pages are then in that worker's prefix cache, so the prompt is computed once and the n sequences
share its pages through the block manager's reference counts (each later choice's usage reports them
as cached; a choice that migrates is routed afresh). Chunks carry their choice's ``index``;
whole replies come back per choice.

Usage over the choices (:func:`merged_usage`): the prompt counted once (its cached tokens as choice
0 found them), the completions summed, as OpenAI reports ``n``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec

from bus.errors import Internal
from schemas.engine import Usage
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from schemas.worker import TokenChunk
from services.agent.output import merge_tool_calls

_SEED_MOD = 2**63


def choice_request(req: GenerateRequest, index: int) -> GenerateRequest:
    """Choice ``index`` of ``req``: one sequence, its own seed."""
    s = req.sampling
    seed = None if s.seed is None else (s.seed + index) % _SEED_MOD
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(s, n=1, seed=seed))


async def stream_choices(num_choices: int, stream: Callable[[int, list], AsyncIterator[TokenChunk]]
                         ) -> AsyncIterator[tuple[int, TokenChunk]]:
    """(choice index, chunk) as they come from ``stream(index, route)`` for each choice; ``route`` is a
    list choice 0's stream puts its first route in and the others' streams reuse. The first error
    ends all of them (leaving early closes every stream, which cancels their workers)."""
    queue: asyncio.Queue = asyncio.Queue()
    route: list = []
    first_back = asyncio.Event()
    done = object()

    async def run(index: int) -> None:
        try:
            if index:
                await first_back.wait()
            async with contextlib.aclosing(stream(index, route)) as chunks:  # its worker's stream ends with us
                async for chunk in chunks:
                    await queue.put((index, chunk))
                    first_back.set()
        except BaseException as exc:  # (cancelled too: nothing is read any more then)
            await queue.put((index, exc))
            raise
        finally:
            first_back.set()
        await queue.put((index, done))

    tasks = [asyncio.create_task(run(i), name=f"choice-{i}") for i in range(num_choices)]
    try:
        remaining = num_choices
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def replies(chunks: AsyncIterator[GenerateChunk], req: GenerateRequest, request_id: str) -> list[GenerateReply]:
    """The whole reply of each choice, from the stream of all of them."""
    parts = [{"texts": [], "token_ids": [], "logprobs": [], "reasoning": [], "calls": [], "finish_reason": None,
              "usage": None} for _ in range(req.sampling.n)]
    async for chunk in chunks:
        part = parts[chunk.index]
        part["texts"].append(chunk.text)
        part["token_ids"].extend(chunk.token_ids)
        part["logprobs"].extend(chunk.logprobs or ())
        part["reasoning"].append(chunk.reasoning_content or "")
        part["calls"].extend(chunk.tool_calls or ())
        part["finish_reason"] = chunk.finish_reason or part["finish_reason"]
        part["usage"] = chunk.usage or part["usage"]
    out = []
    for part in parts:
        if part["finish_reason"] is None:
            raise Internal(f"the worker's stream ended without a finish reason (request id {request_id})")
        usage = part["usage"] or Usage(prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=len(part["token_ids"]))
        out.append(GenerateReply(
            text="".join(part["texts"]), token_ids=part["token_ids"], finish_reason=part["finish_reason"], usage=usage,
            logprobs=part["logprobs"] if req.sampling.logprobs is not None else None,
            tool_calls=merge_tool_calls(part["calls"]) or None, reasoning_content="".join(part["reasoning"]) or None))
    return out


def merged_usage(usages: list[Usage]) -> Usage:
    """One usage for the n choices of a request (``usages`` in choice order)."""
    if len(usages) == 1:
        return usages[0]
    first = usages[0]
    drafted = sum(u.draft_tokens for u in usages)
    return Usage(
        prompt_tokens=first.prompt_tokens, cached_prompt_tokens=first.cached_prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages), draft_tokens=drafted,
        accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages),
        mean_accepted_length=sum(u.mean_accepted_length * u.draft_tokens for u in usages) / drafted if drafted else 0.0,
        cached_tokens_device=first.cached_tokens_device, cached_tokens_host=first.cached_tokens_host,
        draft_seconds=sum(u.draft_seconds for u in usages))
