"""OpenAI response bodies for the two generation endpoints, whole and streamed (SSE events).

The endpoints differ only here: the HTTP app (http.py) runs both through the same pipeline.
Chat replies carry what the reply parsers found (services/agent/output.py): ``tool_calls`` (whole, or
as OpenAI streams them: id, type and name first, then arguments) and ``reasoning_content``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from schemas.engine import Usage
from schemas.generate import GenerateChunk, GenerateReply, ToolCallDelta
from services.gateway.choices import merged_usage
from services.gateway.openai_mapping import (
    chat_logprobs,
    chat_to_generate,
    completion_logprobs,
    completion_to_generate,
    logprob_token_ids,
    usage_info,
)
from services.gateway.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionDelta,
    ToolCallDeltaOut,
)

if TYPE_CHECKING:
    from services.gateway.pipeline import GenerationPipeline

_encoder = msgspec.json.Encoder()


def sse(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


def tool_call_delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    if d.name is not None:  # a call's first piece
        return ToolCallDeltaOut(index=d.index, id=d.id, type="function",
                                function=FunctionDelta(name=d.name, arguments=d.arguments))
    return ToolCallDeltaOut(index=d.index, function=FunctionDelta(arguments=d.arguments))


class Completions:
    endpoint, id_prefix = "completions", "cmpl-"
    request_type, to_generate = CompletionRequest, staticmethod(completion_to_generate)

    def __init__(self, pipeline: GenerationPipeline, request_id: str, model: str, wants_logprobs: bool,
                 num_choices: int = 1):
        self.pipeline, self.id, self.model, self.wants_logprobs = pipeline, request_id, model, wants_logprobs
        self.num_choices = num_choices
        self.created = int(time.time())
        self.offsets = [0] * num_choices  # each choice's text so far (legacy logprobs' text_offset)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, object="text_completion", created=self.created, model=self.model,
                                  choices=choices, usage=usage_info(usage) if usage else None)

    async def _logprobs(self, logprobs, index: int = 0) -> Any:
        if not self.wants_logprobs or logprobs is None:
            return None
        texts = await self.pipeline.token_texts(logprob_token_ids(logprobs))
        return completion_logprobs(logprobs, texts, self.offsets[index])

    async def whole(self, reply: GenerateReply) -> CompletionResponse:
        return await self.whole_choices([reply])

    async def whole_choices(self, replies: list[GenerateReply]) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=r.text, logprobs=await self._logprobs(r.logprobs),
                                    finish_reason=r.finish_reason) for i, r in enumerate(replies)]
        return self._response(choices, merged_usage([r.usage for r in replies]))

    def opening(self) -> list[bytes]:
        return []

    async def piece(self, chunk: GenerateChunk) -> bytes | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs:
            return None
        choice = CompletionChoice(index=chunk.index, text=chunk.text,
                                  logprobs=await self._logprobs(chunk.logprobs, chunk.index),
                                  finish_reason=chunk.finish_reason)
        self.offsets[chunk.index] += len(chunk.text)
        return sse(self._response([choice]))

    def usage_event(self, usage: Usage) -> bytes:
        return sse(self._response([], usage))


class ChatCompletions(Completions):
    endpoint, id_prefix = "chat_completions", "chatcmpl-"
    request_type, to_generate = ChatCompletionRequest, staticmethod(chat_to_generate)

    async def _logprobs(self, logprobs, index: int = 0) -> Any:
        # NOTE: logprobs cover every generated token, a tool call's text included
        if not self.wants_logprobs or logprobs is None:
            return None
        return chat_logprobs(logprobs, await self.pipeline.token_texts(logprob_token_ids(logprobs)))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                       model=self.model, choices=choices, usage=usage_info(usage) if usage else None))

    async def whole_choices(self, replies: list[GenerateReply]) -> ChatCompletionResponse:
        choices = []
        for i, reply in enumerate(replies):
            message = ChatMessageOut(
                content=reply.text or (None if reply.tool_calls or reply.reasoning_content else ""),
                tool_calls=reply.tool_calls or msgspec.UNSET,
                reasoning_content=reply.reasoning_content if reply.reasoning_content is not None else msgspec.UNSET)
            choices.append(ChatChoice(index=i, message=message, logprobs=await self._logprobs(reply.logprobs),
                                      finish_reason=reply.finish_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage_info(merged_usage([r.usage for r in replies])))

    def opening(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.num_choices)]

    async def piece(self, chunk: GenerateChunk) -> bytes | None:
        if not (chunk.text or chunk.tool_calls or chunk.reasoning_content or chunk.finish_reason or chunk.logprobs):
            return None
        delta = ChatDelta(content=chunk.text or None, reasoning_content=chunk.reasoning_content or None,
                          tool_calls=[tool_call_delta(d) for d in chunk.tool_calls] if chunk.tool_calls else None)
        return self._chunk([ChatChunkChoice(index=chunk.index, delta=delta, logprobs=await self._logprobs(chunk.logprobs),
                                            finish_reason=chunk.finish_reason)])

    def usage_event(self, usage: Usage) -> bytes:
        return self._chunk([], usage)
