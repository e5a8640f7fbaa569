"""An in-memory transport with NATS semantics, for fast actor tests.

Supports ``*`` and ``>`` wildcards, queue groups (one member of a group gets
each message) and the "no responders" status on requests nobody listens to.
Each subscription delivers in order, one message at a time, like nats-py.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid

from bus.core import NO_RESPONDERS, STATUS_HEADER, Bus, RawHandler, RawMsg, RawSubscription, Transport


def subject_matches(pattern: str, subject: str) -> bool:
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


class _MemorySubscription(RawSubscription):
    def __init__(self, transport: "MemoryTransport", pattern: str, handler: RawHandler, queue: str | None):
        self.transport = transport
        self.pattern = pattern
        self.queue = queue
        self.handler = handler
        self.mailbox: asyncio.Queue[RawMsg | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while (msg := await self.mailbox.get()) is not None:
            try:
                await self.handler(msg)
            except Exception:  # like nats-py: a failing callback doesn't kill the subscription
                import logging
                logging.getLogger(__name__).exception("subscription callback failed")

    async def unsubscribe(self) -> None:
        self.transport.network.discard(self)
        if self in self.transport._own:
            self.transport._own.remove(self)
        self.mailbox.put_nowait(None)


class MemoryNetwork:
    """The shared "server": every MemoryTransport on it sees the others' messages."""

    def __init__(self, max_payload: int | None = None) -> None:
        self.subscriptions: list[_MemorySubscription] = []
        self._rng = random.Random(0)
        self.max_payload = max_payload
        """Like nats-server's max_payload (None: no limit); a larger message is refused."""

    def discard(self, sub: _MemorySubscription) -> None:
        if sub in self.subscriptions:
            self.subscriptions.remove(sub)

    def route(self, msg: RawMsg) -> int:
        matches = [s for s in self.subscriptions if subject_matches(s.pattern, msg.subject)]
        plain = [s for s in matches if s.queue is None]
        groups: dict[str, list[_MemorySubscription]] = {}
        for s in matches:
            if s.queue is not None:
                groups.setdefault(s.queue, []).append(s)
        chosen = plain + [self._rng.choice(members) for members in groups.values()]
        for s in chosen:
            s.mailbox.put_nowait(RawMsg(msg.subject, msg.data, dict(msg.headers) if msg.headers else None, msg.reply))
        return len(chosen)


class MemoryTransport(Transport):
    _ids = itertools.count()

    def __init__(self, network: MemoryNetwork):
        self.network = network
        self._own: list[_MemorySubscription] = []

    async def publish(self, subject, data, headers=None, reply=None) -> None:
        limit = self.network.max_payload
        if limit is not None and len(data) > limit:  # as nats-py's MaxPayloadError
            raise ValueError(f"message of {len(data)} bytes exceeds max_payload {limit}")
        delivered = self.network.route(RawMsg(subject, bytes(data), headers, reply))
        if delivered == 0 and reply:
            self.network.route(RawMsg(reply, b"", {STATUS_HEADER: NO_RESPONDERS}, None))

    async def subscribe(self, subject, handler, queue=None) -> RawSubscription:
        sub = _MemorySubscription(self, subject, handler, queue)
        self.network.subscriptions.append(sub)
        self._own.append(sub)
        return sub

    @property
    def max_payload(self) -> int | None:
        return self.network.max_payload

    def new_inbox(self) -> str:
        return f"_INBOX.mem{next(self._ids)}{uuid.uuid4().hex[:8]}"

    async def close(self) -> None:
        for sub in list(self._own):
            await sub.unsubscribe()


def memory_bus(network: MemoryNetwork, **kwargs) -> Bus:
    """A Bus on ``network``; make one per actor to mimic separate connections."""
    return Bus(MemoryTransport(network), **kwargs)
