"""The engine thread: the one thread of a process that runs its OpenMP parallel regions (torch compute).

It runs submitted jobs (building the engine, copying KV pages) and, while an event loop streams
from the engine, steps it back to back, handing each step's outputs to the loop with one
``call_soon_threadsafe``. When a worker traces requests, each step is then handed to the engine's
``timelines`` (timeline.py: a few stores per traced request in the batch, never OpenTelemetry).

NOTE: keep every OpenMP parallel region of a process on one thread. libgomp gives each thread
that opens a parallel region its own pool of workers, and once a second pool exists the first
one's steps slow down: on the 2-core dev VM a decode step of the default model took 24 ms when
one thread built and stepped the engine, and 34 ms when the main thread had run a single matmul
first (docs/engine.md, "Threads"). So ``AsyncEngine.create`` builds the engine here, and work that
touches big tensors (KV page copies) goes through :meth:`submit`. Helper threads that move pages
open no parallel region: on CPU the HiCache copy thread and the shared-memory transfer copy with a
plain memcpy (numpy), and on CUDA they only queue copies on a stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, name: str = "kvbus-engine"):
        self.driver = None  # the async_api.AsyncEngine that adopts this thread
        self.loop: asyncio.AbstractEventLoop | None = None  # where outputs go
        self.work = threading.Event()
        self._jobs: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread, between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive():
            future.set_exception(RuntimeError("the engine thread has stopped"))
            return future
        self._jobs.append((fn, future))
        self.work.set()
        return future

    async def run(self, fn: Callable):
        return await asyncio.wrap_future(self.submit(fn))

    def post(self, outputs: list) -> bool:
        """From a step in progress: hand ``outputs`` to the event loop now, before the step's
        forward pass (the first token of a request whose prefill ran elsewhere). False when no
        loop listens (the step then returns them)."""
        loop, driver = self.loop, self.driver
        if not self.is_current() or loop is None or driver is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(driver.deliver, outputs, None)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def stop(self) -> None:
        """Ask the thread to end after the job or step in progress (join with :meth:`join`)."""
        self._stopping = True
        self.work.set()

    def join(self) -> None:
        self._thread.join()

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the caller gets it
                    future.set_exception(exc)

    def _main(self) -> None:
        while not self._stopping:
            self._run_jobs()
            driver, loop = self.driver, self.loop
            if loop is not None and loop.is_closed():  # asyncio.run() ended: sync callers may step now
                break
            if driver is None or loop is None or not driver.engine.has_unfinished():
                self.work.wait()
                self.work.clear()
                continue
            timelines = driver.engine.timelines  # requests a worker traces (timeline.py); falsy: none
            if timelines:
                started = time.monotonic()
                outputs, error = driver.step_on_thread()
                timelines.after_step(driver.engine, started, time.monotonic())  # before the outputs go out
            else:
                outputs, error = driver.step_on_thread()
            if outputs:
                try:
                    loop.call_soon_threadsafe(driver.deliver, outputs, error)
                except RuntimeError:  # that loop is closed: nobody is listening any more
                    pass
        while self._jobs:  # nobody will run these now
            _, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine thread has stopped"))
