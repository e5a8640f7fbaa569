"""Tokenizer service: encode, decode, chat templates and vocabulary facts.

Handlers only enqueue; one batch loop drains everything pending and runs the
fast tokenizer's batch API once per kind of work (in a worker thread, so the
event loop keeps taking messages meanwhile). N replicas share the load through
the ``tokenizer`` queue group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bus import tracing
from bus.errors import InvalidArgument, Overloaded, Unavailable
from bus.tracing import names as trace_names
from bus.subjects import TOKENIZER_CHAT, TOKENIZER_DECODE, TOKENIZER_ENCODE, TOKENIZER_INFO
from schemas.tokenizer import (
    ChatTemplateReply,
    ChatTemplateRequest,
    DecodeReply,
    DecodeRequest,
    EncodeReply,
    EncodeRequest,
    TokenizerInfoReply,
    TokenizerInfoRequest,
)
from services.actor import Actor
from services.agent.tool_prompt import fallback_messages, template_messages, template_takes_tools, tool_dict
from services.agent.tools import check_chat_template_kwargs
from services.metrics_http import start_metrics
from services.tokenizer_metrics import TokenizerMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    model: str | None = None
    """Local Hugging Face model folder; default: the prepared SmolLM2-135M-Instruct."""
    max_batch_size: int = 256
    """Most requests tokenized in one batch call."""
    max_input_chars: int = 1_000_000
    """Longest text (or rendered chat) accepted; longer gets invalid_argument."""
    max_queue: int = 10_000
    """Most requests waiting for the batch loop; past it callers get overloaded."""
    metrics_port: int = 0
    """Port of the tokenizer's Prometheus endpoint (GET /metrics: latency, batch sizes, queue); 0: none."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (0.0.0.0 to be scraped from other machines)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_input_chars < 1 or self.max_queue < 1:
            raise ValueError("max_batch_size, max_input_chars and max_queue must be >= 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")


class TokenizerCore:
    """The model's fast tokenizer with batch methods; no bus, no asyncio."""

    def __init__(self, model_dir: Path, *, chat_template: str | None = None):
        """``chat_template``: Jinja source that replaces the model's (e.g. one that renders tools)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from services.engine.model_config import ModelConfig
        from services.models.tokenizer_files import load_tokenizer

        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"{model_dir}: kvbus needs a fast (tokenizers) tokenizer")
        config = ModelConfig.from_dir(self.model_dir)
        self.context_length = config.max_position_embeddings
        self.vocab_size = len(self.tokenizer)
        eos_ids = list(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos_ids
        self.bos_token_id = self.tokenizer.bos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        self.name = self.model_dir.name
        self.template_takes_tools = template_takes_tools(self.tokenizer.chat_template)
        """False (SmolLM2): tools and tool calls are rendered in kvbus's fallback format."""

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, request: ChatTemplateRequest) -> str:
        """The conversation through the model's template; tools (and calls and results in the history)
        through the template when it takes tools, else in the fallback format (services/agent/tool_prompt.py)."""
        if not self.tokenizer.chat_template:
            raise InvalidArgument(f"model {self.name} has no chat template; send a plain prompt instead")
        tools = request.tools or None  # UNSET or [] alike
        kwargs = request.chat_template_kwargs or {}
        check_chat_template_kwargs(kwargs)
        has_tool_history = any(m.tool_calls or m.role == "tool" for m in request.messages)
        if (tools or has_tool_history) and not self.template_takes_tools:
            try:
                return self._apply(fallback_messages(request.messages, tools), None, request, kwargs)
            except Exception:  # a template that takes no role "tool": results as user messages
                return self._apply(fallback_messages(request.messages, tools, result_role="user"), None, request,
                                   kwargs)
        return self._apply(template_messages(request.messages), tools, request, kwargs)

    def _apply(self, messages: list[dict], tools, request: ChatTemplateRequest, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=[tool_dict(t) for t in tools] if tools else None,
            add_generation_prompt=request.add_generation_prompt, tokenize=False, **kwargs)

    def chat_batch(self, requests: list[ChatTemplateRequest]) -> list[tuple[str, list[int]]]:
        prompts = [self.render_chat(r) for r in requests]
        # The template already wrote the special tokens (e.g. <|im_start|>).
        return list(zip(prompts, self.encode_batch(prompts, add_special_tokens=False)))

    def info(self) -> TokenizerInfoReply:
        return TokenizerInfoReply(
            model=self.name, vocab_size=self.vocab_size, bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
            context_length=self.context_length, has_chat_template=bool(self.tokenizer.chat_template),
        )


def chat_chars(req: ChatTemplateRequest) -> int:
    """Characters a chat request asks the template to render (tools and calls included)."""
    num_chars = sum(len(m.content or "") + sum(len(c.function.arguments) + len(c.function.name)
                                               for c in m.tool_calls or ()) for m in req.messages)
    if req.tools:
        num_chars += sum(len(json.dumps(t.function.parameters or {})) + len(t.function.description or "")
                         for t in req.tools)
    return num_chars


def _batch_option(job: "_Job") -> bool | None:
    """The per-request option that must be equal within one batch call."""
    if job.kind == "encode":
        return job.request.add_special_tokens
    if job.kind == "decode":
        return job.request.skip_special_tokens
    return None


@dataclasses.dataclass
class _Job:
    kind: str
    request: Any
    future: asyncio.Future
    batch: tuple[float, float, int] | None = None
    """(start, end, size) of the batch call that served it, in time.monotonic() (for its trace)."""


class TokenizerActor(Actor):
    role = "tokenizer"
    config_class = TokenizerConfig

    def __init__(self, config: TokenizerConfig, *, worker_id: str | None = None, core: TokenizerCore | None = None):
        super().__init__(config, worker_id=worker_id)
        self.core = core
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._loop_task: asyncio.Task | None = None
        self.num_batches = 0
        self.metrics = TokenizerMetrics(num_waiting=self._queue.qsize)
        self.metrics_server = None

    async def setup(self) -> None:
        if self.core is None:
            from services.models import resolve_model

            model_dir = await asyncio.to_thread(resolve_model, self.config.model)
            self.core = await asyncio.to_thread(TokenizerCore, model_dir)
        self._loop_task = asyncio.create_task(self._batch_loop(), name="tokenizer-batch-loop")
        self.metrics_server = await start_metrics(self.metrics.registry, self.config.metrics_host,
                                                  self.config.metrics_port, f"tokenizer {self.worker_id}")

    async def stop(self) -> None:
        await super().stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(Unavailable("tokenizer is shutting down"))

    def routes(self):
        return [
            (TOKENIZER_ENCODE, self.handle_encode, {}),
            (TOKENIZER_DECODE, self.handle_decode, {}),
            (TOKENIZER_CHAT, self.handle_chat, {}),
            (TOKENIZER_INFO, self.handle_info, {}),
        ]

    def health_detail(self) -> dict[str, str]:
        return {"model": self.core.name if self.core else "", "queued": str(self._queue.qsize()),
                "batches": str(self.num_batches)}

    # --- handlers: validate, enqueue, await ---------------------------------------------
    async def handle_encode(self, req: EncodeRequest) -> EncodeReply:
        self._check_length(len(req.text))
        return EncodeReply(ids=await self._submit("encode", req))

    async def handle_decode(self, req: DecodeRequest) -> DecodeReply:
        bad = [i for i in req.ids if i < 0 or i >= self.core.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids out of range [0, {self.core.vocab_size}): {bad[:8]}")
        return DecodeReply(text=await self._submit("decode", req))

    async def handle_chat(self, req: ChatTemplateRequest) -> ChatTemplateReply:
        if not req.messages:
            raise InvalidArgument("messages must not be empty")
        self._check_length(chat_chars(req))
        prompt, ids = await self._submit("chat", req)
        return ChatTemplateReply(prompt=prompt, ids=ids)

    async def handle_info(self, req: TokenizerInfoRequest) -> TokenizerInfoReply:
        return self.core.info()

    def _check_length(self, num_chars: int) -> None:
        if num_chars > self.config.max_input_chars:
            raise InvalidArgument(f"input of {num_chars} characters exceeds max_input_chars={self.config.max_input_chars}")

    async def _submit(self, kind: str, request: Any) -> Any:
        if self._queue.qsize() >= self.config.max_queue:
            self.metrics.refused.inc()
            raise Overloaded(f"tokenizer queue is full ({self.config.max_queue} waiting)")
        future = asyncio.get_running_loop().create_future()
        job = _Job(kind, request, future)
        submitted = time.monotonic()
        self._queue.put_nowait(job)
        try:
            with self.metrics.timed(kind):
                return await future
        finally:
            if job.batch is not None:  # its queue wait and its batch call, in the request's trace
                trace = tracing.RequestTrace.current()
                start, end, size = job.batch
                trace.record(trace_names.QUEUE, submitted, start)
                trace.record(trace_names.BATCH, start, end, {"kvbus.batch_size": size, "kvbus.tokenizer.kind": kind})

    # --- the batch loop -----------------------------------------------------------------
    async def _batch_loop(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            while len(jobs) < self.config.max_batch_size and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            jobs = [j for j in jobs if not j.future.done()]  # callers that gave up
            if not jobs:
                continue
            started, batch_from = time.perf_counter(), time.monotonic()
            try:
                results = await asyncio.to_thread(self._run_batch, jobs)
            except Exception as exc:  # fail the whole batch but keep the loop alive
                log.exception("tokenizer batch of %d failed", len(jobs))
                results = [exc] * len(jobs)
            self.num_batches += 1
            self.metrics.observe_batch(len(jobs), time.perf_counter() - started)
            batch = (batch_from, time.monotonic(), len(jobs))
            for job, result in zip(jobs, results):
                job.batch = batch
                if job.future.done():
                    continue
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _run_batch(self, jobs: list[_Job]) -> list[Any]:
        """Group jobs by kind and options, one batch call per group; results in job order."""
        results: list[Any] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.kind, _batch_option(job))].append(i)
        for (kind, option), idx in groups.items():
            reqs = [jobs[i].request for i in idx]
            try:
                if kind == "encode":
                    out = self.core.encode_batch([r.text for r in reqs], option)
                elif kind == "decode":
                    out = self.core.decode_batch([r.ids for r in reqs], option)
                else:
                    out = self._chat_each(reqs)
            except Exception as exc:
                out = [exc] * len(reqs)
            for i, value in zip(idx, out):
                results[i] = value
        return results

    def _chat_each(self, reqs: list[ChatTemplateRequest]) -> list[Any]:
        # A bad conversation (e.g. a role the template rejects) fails alone, not its batch.
        try:
            return self.core.chat_batch(reqs)
        except Exception:
            out: list[Any] = []
            for r in reqs:
                try:
                    out.extend(self.core.chat_batch([r]))
                except InvalidArgument as exc:
                    out.append(exc)
                except Exception as exc:
                    out.append(InvalidArgument(f"chat template failed: {exc}"))
            return out
