"""The asyncio face of the engine: streams, prefill-only calls, the step thread.

Steps run back to back in one dedicated engine thread (torch releases the GIL in
its kernels), so the event loop stays free and the next step never waits for the
loop to hand out the last step's tokens: the thread passes each step's outputs to
the loop with one ``call_soon_threadsafe`` and starts the next step at once.
Requests reach the engine through its mailbox; the thread sleeps on an event
when there is no work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence as Seq

import torch

from schemas.engine import RequestOutput, SamplingParams, TokenLogprob
from services.engine.outputs import PrefillResult, RequestError

log = logging.getLogger(__name__)


class AsyncEngineMixin:
    """Mixed into LLMEngine; uses its add_* / abort / step / has_unfinished."""

    _queues: dict[str, asyncio.Queue]
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None
    _work: threading.Event
    _stopping: bool

    def _init_async(self) -> None:
        self._queues = {}
        self._loop = None
        self._thread = None
        self._work = threading.Event()
        self._stopping = False

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
        self._ensure_thread()
        submit()
        self._queues[request_id] = queue
        self._work.set()
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
                self._work.set()

    def _ensure_thread(self) -> None:
        self._loop = asyncio.get_running_loop()  # outputs go to the loop that streams now
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._thread_main, name="kvbus-engine", daemon=True)
        self._thread.start()

    def _thread_main(self) -> None:
        while not self._stopping:
            loop = self._loop
            if loop is None or loop.is_closed():  # asyncio.run() ended: sync callers may step now
                break
            if not self.has_unfinished():
                self._work.wait()
                self._work.clear()
                continue
            try:
                outputs, error = self.step(), None
            except Exception as exc:  # a bug in a step must not hang every stream
                log.exception("engine step failed; failing every running request")
                outputs, error = self._fail_all(), RuntimeError(f"engine step failed: {exc!r}")
            if outputs:
                self._post(self._deliver, outputs, error)

    def _claim_sync(self) -> None:
        """Before a step from outside the engine thread: the thread must be gone. One left by a
        closed event loop is stopped; one serving a live loop means a caller mixed the sync and
        async APIs on one engine, which would step it from two threads at once."""
        thread = self._thread
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            return
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            raise RuntimeError("this engine is driven by its async API in another thread; "
                               "don't call step() or generate_sync() beside it")
        self._stopping = True
        self._work.set()
        thread.join()
        self._thread = None

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass

    def _deliver(self, outputs: list, error: Exception | None) -> None:
        """On the event loop: hand each output (or the step's error) to its stream."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(error if error is not None else out)

    def _fail_all(self) -> list[RequestOutput]:
        """On the engine thread: abort every request after a failed step; their final outputs."""
        return [self._finish(seq, "abort", []) for seq in list(self._seqs.values())]

    async def aclose(self) -> None:
        """Stop the engine thread (pending streams see no more outputs)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._work.set()
        await asyncio.to_thread(thread.join)
        self._thread = None
