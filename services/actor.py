"""The base of every service actor: routes, lifecycle, health.

An actor owns its state and exposes ``handle_*`` coroutines that take and
return Structs; ``routes()`` says which subject each one serves. Actors get a
:class:`bus.Bus` and never import nats.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from bus import Bus
from bus.subjects import Subject

VERSION = "0.1.0"


class Actor:
    role: ClassVar[str]
    """Service role: the name of ``kvbus serve <role>``."""
    config_class: ClassVar[type]

    def __init__(self, config: Any, *, worker_id: str | None = None):
        self.config = config
        self.worker_id = worker_id or uuid.uuid4().hex[:8]
        self.bus: Bus | None = None
        self.started_at = time.monotonic()
        self.is_ready = False

    def routes(self) -> list[tuple[Subject, Callable, dict[str, str]]]:
        """(subject, handler, subject params) to bind when the actor starts."""
        return []

    async def setup(self) -> None:
        """Load what the actor needs before it takes messages (models, pools)."""

    async def start(self, bus: Bus) -> None:
        await self.setup()
        self.bus = bus
        for subject, handler, params in self.routes():
            await bus.serve(subject, handler, **params)
        self.is_ready = True

    async def drain(self, timeout: float) -> None:
        """Finish work that did not arrive through the bus (e.g. HTTP); called before the bus drains."""

    async def stop(self) -> None:
        """Release what ``setup`` took; called after the bus drained in-flight work."""
        self.is_ready = False

    def health_detail(self) -> dict[str, str]:
        return {}
