"""The asyncio face of the engine: streams, prefill-only calls, the step loop.

Steps run in one worker thread (torch releases the GIL in its kernels), so the
event loop stays free; requests reach the engine through its mailbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import logging
import uuid
from collections.abc import AsyncIterator, Sequence as Seq

import torch

from schemas.engine import RequestOutput, SamplingParams, TokenLogprob
from services.engine.outputs import PrefillResult, RequestError

log = logging.getLogger(__name__)


class AsyncEngineMixin:
    """Mixed into LLMEngine; uses its add_* / abort / step / has_unfinished."""

    _queues: dict[str, asyncio.Queue]
    _loop_task: asyncio.Task | None
    _wakeup: asyncio.Event | None
    _executor: concurrent.futures.ThreadPoolExecutor | None

    def _init_async(self) -> None:
        self._queues = {}
        self._loop_task = None
        self._wakeup = None
        self._executor = None

    def generate(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``async for``); leaving the loop early aborts it.

        Validation errors (RequestError) are raised at the first ``anext``.
        """
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda: self.add_request(request_id, prompt, params))

    async def prefill(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> PrefillResult:
        """Prefill only: the first token and a copy of the prompt's KV pages.

        The pages go back to this engine's prefix cache; cancelling aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        out = None
        async with contextlib.aclosing(
                self._stream(request_id, lambda: self.add_prefill_request(request_id, prompt, params))) as outputs:
            async for out in outputs:
                if out.finished:
                    break
        result = self.take_prefill_result(request_id)
        if result is None:
            raise RuntimeError(f"prefill of {request_id!r} produced no pages ({out.finish_reason})")
        return result

    def generate_prefilled(
        self,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        kv: torch.Tensor,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        num_cached_tokens: int = 0,
        first_logprob: TokenLogprob | None = None,
        kv_scales: Seq[float] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request prefilled elsewhere (see :meth:`add_prefilled_request`).

        Validation errors (RequestError) are raised at the first ``anext``.
        """
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda: self.add_prefilled_request(
            request_id, prompt_token_ids, first_token_id, kv, params, num_cached_tokens=num_cached_tokens,
            first_logprob=first_logprob, kv_scales=kv_scales))

    async def _stream(self, request_id: str, submit) -> AsyncIterator[RequestOutput]:
        if request_id in self._queues:
            raise RequestError(f"request id {request_id!r} is already streaming")
        queue: asyncio.Queue = asyncio.Queue()
        self._ensure_loop()
        submit()
        self._queues[request_id] = queue
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished:
                self.abort(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._loop_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbus-engine")
        self._wakeup = asyncio.Event()
        self._loop_task = loop.create_task(self._run_loop(), name="kvbus-engine-loop")

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.step)
            except Exception as exc:  # a bug in a step must not hang every stream
                log.exception("engine step failed; failing every running request")
                self._fail_all(exc)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _fail_all(self, exc: Exception) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", [])
            queue = self._queues.get(seq.request_id)
            if queue is not None:
                queue.put_nowait(RuntimeError(f"engine step failed: {exc!r}"))

    async def aclose(self) -> None:
        """Stop the async driver (pending streams see no more outputs)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
