"""The asyncio face of the engine: streams, prefill-only calls, the engine thread.

:class:`AsyncEngine` wraps an :class:`~services.engine.engine.LLMEngine` and drives it through
its public calls only (``add_*``, ``abort``, ``step``, ``abort_all``). Steps run back to back on
the engine's own thread (``engine_thread.py``; torch releases the GIL in its kernels), so the
event loop stays free and the next step never waits for the loop to hand out the last step's
tokens. Requests reach the engine through its mailbox; the thread sleeps when there is no work.
Services build it with ``await AsyncEngine.create(config)``, which loads the engine on that same
thread (why that matters: ``engine_thread.py``).

Everything else an AsyncEngine is asked for (``block_manager``, ``scheduler``, ``stats``,
``generate_sync`` ...) is the wrapped engine's, so a service reads its engine's state through
the one object it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence as Seq
from typing import TYPE_CHECKING

from schemas.engine import RequestOutput, SamplingParams, TokenLogprob
from services.engine.engine_thread import EngineThread
from services.engine.outputs import PrefillResult, RequestError

if TYPE_CHECKING:
    import torch

    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._thread: EngineThread | None = None

    def __getattr__(self, name: str):
        # only names this class lacks: the wrapped engine's state and sync calls
        if name == "engine":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.engine, name)

    @classmethod
    async def create(cls, config: EngineConfig | None = None, **kwargs) -> AsyncEngine:
        """Build the engine on a new engine thread, which then steps it (services use this).
        The thread makes the process-wide torch settings first (``process.build_engine``)."""
        from services.engine.process import build_engine

        thread = EngineThread()
        try:
            engine = await thread.run(lambda: build_engine(config, **kwargs))
        except BaseException:
            thread.stop()
            raise
        driver = cls(engine)
        driver._adopt(thread)
        return driver

    # ---- streams ---------------------------------------------------------------------------

    def generate(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``async for``); leaving the loop early aborts it.

        Validation errors (RequestError) are raised at the first ``anext``.
        """
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda: self.engine.add_request(request_id, prompt, params))

    async def prefill(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
        *, skip_pages: int = 0,
    ) -> PrefillResult:
        """Prefill only: the first token and a copy of the prompt's KV pages from ``skip_pages`` on.

        The pages go back to this engine's prefix cache; cancelling aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        out = None
        async with contextlib.aclosing(self._stream(request_id, lambda: self.engine.add_prefill_request(
                request_id, prompt, params, skip_pages=skip_pages))) as outputs:
            async for out in outputs:
                if out.finished:
                    break
        result = self.engine.take_prefill_result(request_id)
        if result is None:
            raise RuntimeError(f"prefill of {request_id!r} produced no pages ({out.finish_reason})")
        return result

    def generate_prefilled(
        self,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        kv: torch.Tensor | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        num_cached_tokens: int = 0,
        first_logprob: TokenLogprob | None = None,
        kv_scales: Seq[float] = (),
        kv_first_page: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request prefilled elsewhere (see ``LLMEngine.add_prefilled_request``).

        Validation errors (RequestError) are raised at the first ``anext``.
        """
        request_id = request_id or uuid.uuid4().hex
        return self._stream(request_id, lambda: self.engine.add_prefilled_request(
            request_id, prompt_token_ids, first_token_id, kv, params, num_cached_tokens=num_cached_tokens,
            first_logprob=first_logprob, kv_scales=kv_scales, kv_first_page=kv_first_page))

    def provide_kv(self, request_id: str, kv: torch.Tensor | None, kv_scales: Seq[float] = (),
                   kv_first_page: int | None = None) -> bool:
        """Hand over the pages of a request streamed by :meth:`generate_prefilled` with ``kv=None``
        (see ``LLMEngine.import_kv``; ``None``: compute its prompt here instead)."""
        taken = self.engine.import_kv(request_id, kv, kv_scales, kv_first_page)
        self._wake()
        return taken

    async def _stream(self, request_id: str, submit) -> AsyncIterator[RequestOutput]:
        if request_id in self._queues:
            raise RequestError(f"request id {request_id!r} is already streaming")
        queue: asyncio.Queue = asyncio.Queue()
        self._ensure_thread()
        submit()
        self._queues[request_id] = queue
        self._wake()
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
                self.engine.abort(request_id)
                self._wake()

    def deliver(self, outputs: list, error: Exception | None) -> None:
        """On the event loop: hand each output (or the step's error) to its stream."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                if error is None and out.error is not None:  # this request failed alone
                    queue.put_nowait(RequestError(out.error))
                else:
                    queue.put_nowait(error if error is not None else out)

    async def aclose(self) -> None:
        """Stop the engine thread (pending streams see no more outputs)."""
        thread = self._thread
        if thread is None:
            return
        thread.stop()
        await asyncio.to_thread(thread.join)
        self._thread = None

    # ---- the engine thread -------------------------------------------------------------------

    def _adopt(self, thread: EngineThread) -> None:
        other = self.engine.driver
        if other is not None and other is not self:
            other.release()  # another AsyncEngine over the same engine: only one thread steps it
        thread.driver = self
        self._thread = thread
        self.engine.driver = self

    def _ensure_thread(self) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._adopt(thread := EngineThread())
        thread.loop = asyncio.get_running_loop()  # outputs go to the loop that streams now

    def _wake(self) -> None:
        """Tell the engine thread there is work (none after aclose: the next stream starts one)."""
        thread = self._thread
        if thread is not None:
            thread.work.set()

    def step_on_thread(self) -> tuple[list[RequestOutput], Exception | None]:
        """On the engine thread: one step, holding the core lease where engines share this host's
        cores (core_lease.py). A step that fails aborts every request: its error goes to them all."""
        lease = self.engine.core_lease
        try:
            with lease if lease is not None else contextlib.nullcontext():
                return self.engine.step(), None
        except Exception as exc:  # a bug in a step must not hang every stream
            log.exception("engine step failed; failing every running request")
            return self.engine.abort_all(), RuntimeError(f"engine step failed: {exc!r}")

    # ---- what LLMEngine.step asks its driver --------------------------------------------------

    def before_step(self) -> None:
        """Before a step: from the engine thread, go on; from any other thread, the engine thread
        must be gone (:meth:`release`)."""
        thread = self._thread
        if thread is not None and not thread.is_current():
            self.release()

    def post_early(self, outputs: list[RequestOutput]) -> bool:
        """From a step in progress: hand ``outputs`` to their streams now, before the forward pass.
        False when no event loop listens (the step then returns them)."""
        thread = self._thread
        return thread is not None and thread.post(outputs)

    def release(self) -> None:
        """Stop stepping from this driver's thread so that another may step. A thread left by a
        closed event loop is stopped; one serving a live loop means a caller mixed the sync and
        async APIs on one engine, which would step it from two threads at once."""
        thread = self._thread
        if thread is None or thread.is_current() or not thread.is_alive():
            return
        loop = thread.loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            raise RuntimeError("this engine is driven by its async API in another thread; "
                               "don't call step() or generate_sync() beside it")
        thread.stop()
        thread.join()
        self._thread = None
