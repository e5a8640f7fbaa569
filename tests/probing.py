"""Helpers for tests of the streamed replies' interest probe (bus/core.py, "Interest probes"):
a log of every probe's outcome, a streaming handler that records how it ended, waiting on conditions."""

from __future__ import annotations

import asyncio
import time

from bus.core import STREAM_HEADER, Bus
from bus.errors import BusError, NoResponders
from bus.transport import header
from schemas.common import EchoChunk, EchoRequest

CALLER_GONE = {"NoResponders", "gone"}
"""Probe outcomes that cancel a stream; a live caller's probes are "alive", or (a loaded machine) "Timeout"."""
WAIT_S = 30.0
"""Generous bound for conditions: the machine is shared and may be loaded."""


async def wait_until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g}s"
        await asyncio.sleep(0.01)


class ProbeLog:
    """The outcome of every probe a server bus sent: the answer's Kvbus-Stream, or the error's type."""

    def __init__(self, bus: Bus):
        self.outcomes: list[str] = []
        request = bus.transport.request

        async def logged(subject, data, headers, timeout):
            try:
                answer = await request(subject, data, headers, timeout)
            except BusError as exc:
                self.outcomes.append(type(exc).__name__)
                raise
            self.outcomes.append(header(answer, STREAM_HEADER) or "")
            return answer

        bus.transport.request = logged


class Endless:
    """A streaming handler that records whether it was cancelled; optionally waits on a gate per chunk."""

    def __init__(self, num_chunks: int | None = None, gate=None):
        self.num_chunks = num_chunks
        self.gate = gate
        self.num_sent = 0
        self.is_cancelled = False
        self.is_finished = False

    async def __call__(self, req: EchoRequest):
        try:
            i = 0
            while self.num_chunks is None or i < self.num_chunks:
                yield EchoChunk(index=i, data=req.data)
                self.num_sent = i = i + 1
                if self.gate is not None:
                    await self.gate(i)
                else:
                    await asyncio.sleep(0.01)
            self.is_finished = True
        except asyncio.CancelledError:
            self.is_cancelled = True
            raise


async def open_stream(client: Bus, subject, request, **params):
    """``client.stream(...)`` and its first chunk, retried while nobody seems to listen yet.

    NOTE: nats-server (2.9) may answer "no responders" for a millisecond or two after another
    connection's subscription was flushed, when connections closed just before (as between tests);
    the subscription being visible is the condition waited on here.
    """
    deadline = time.monotonic() + WAIT_S
    while True:
        stream = client.stream(subject, request, **params)
        try:
            return stream, await anext(stream)
        except NoResponders:
            await stream.aclose()
            assert time.monotonic() < deadline, f"nobody listens on {subject.template}"
            await asyncio.sleep(0.01)
