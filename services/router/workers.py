"""The live worker registry, fed by WorkerHeartbeatEvents.

A worker is alive from its first heartbeat until ``ttl`` seconds pass without
one, or until it reports ``is_draining``. Expiry is checked lazily on every
read and by the actor's periodic sweep, so a silent worker never gets a request
and never lingers in health output either.

Between heartbeats the registry counts what the router itself sent to each
worker (``num_routed*``), so a burst of requests spreads instead of piling onto
the worker that looked idlest in its last report. A heartbeat resets the counts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from schemas.worker import WorkerHeartbeatEvent, WorkerLoad, WorkerRole

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclasses.dataclass(slots=True)
class WorkerState:
    worker_id: str
    role: WorkerRole
    host_id: str
    load: WorkerLoad
    last_seen: float
    model: str = ""
    page_size: int = 16
    interval_s: float = 1.0
    num_routed: int = 0
    """Requests this router sent here since the worker's last heartbeat."""
    num_routed_prefill_tokens: int = 0
    """Prompt tokens this router sent here to prefill since the last heartbeat."""
    num_routed_tokens: int = 0
    """Prompt tokens this router sent here to decode since the last heartbeat that need new KV pages here
    (the uncached part)."""
    hash_scheme: str = ""
    """How the worker names KV pages (empty: not advertised)."""
    hash_root: int = 0
    """Root of its page-hash chain (0: not advertised: the unsalted root)."""

    @property
    def num_requests(self) -> int:
        """Running + waiting, as reported, plus what was routed here since."""
        return self.load.num_running + self.load.num_waiting + self.num_routed

    @property
    def num_prefill_tokens(self) -> int:
        """Queued prefill tokens, as reported, plus what was routed here since."""
        return self.load.num_queued_prefill_tokens + self.num_routed_prefill_tokens

    @property
    def num_active_tokens(self) -> int:
        """Tokens its requests hold in KV, as reported (pages in use; cached pages nobody uses are free),
        plus the new KV of the prompts routed here since."""
        return max(self.load.num_total_pages - self.load.num_free_pages, 0) * self.page_size + self.num_routed_tokens

    @property
    def free_page_fraction(self) -> float:
        """Free KV pages over the pool; 1.0 when the worker reports no pool size."""
        if self.load.num_total_pages <= 0:
            return 1.0
        return self.load.num_free_pages / self.load.num_total_pages


class WorkerRegistry:
    """Alive workers by id. ``on_leave(state, reason)`` hears every departure."""

    def __init__(self, ttl: float, *, clock: Clock = time.monotonic,
                 on_leave: Callable[[WorkerState, str], None] | None = None):
        if not ttl > 0:
            raise ValueError(f"worker ttl must be > 0, got {ttl}")
        self.ttl = ttl
        self.clock = clock
        self.on_leave = on_leave
        self._workers: dict[str, WorkerState] = {}

    def observe(self, event: WorkerHeartbeatEvent) -> bool:
        """Take one heartbeat; True when it announces a worker not known before."""
        if event.is_draining:
            self._drop(event.worker_id, "draining")
            return False
        state = self._workers.get(event.worker_id)
        is_new = state is None
        if is_new and event.interval_s >= self.ttl:
            log.warning("worker %s beats every %.1fs, not less than the router's worker_ttl %.1fs: "
                        "it will flap in and out", event.worker_id, event.interval_s, self.ttl)
        self._workers[event.worker_id] = WorkerState(
            worker_id=event.worker_id, role=event.role, host_id=event.host_id, load=event.load,
            last_seen=self.clock(), model=event.model, page_size=event.page_size,
            interval_s=event.interval_s, hash_scheme=event.hash_scheme, hash_root=event.hash_root)
        return is_new

    def expire(self) -> list[str]:
        """Drop every worker silent for ``ttl`` seconds or more; their ids."""
        deadline = self.clock() - self.ttl
        gone = [w.worker_id for w in self._workers.values() if w.last_seen <= deadline]
        for worker_id in gone:
            self._drop(worker_id, f"silent for more than {self.ttl:g}s")
        return gone

    def alive(self, roles: Iterable[str] | None = None) -> list[WorkerState]:
        """Alive workers (of ``roles`` if given), sorted by id so choices are reproducible."""
        self.expire()
        wanted = None if roles is None else set(roles)
        return sorted((w for w in self._workers.values() if wanted is None or w.role in wanted),
                      key=lambda w: w.worker_id)

    def get(self, worker_id: str) -> WorkerState | None:
        self.expire()
        return self._workers.get(worker_id)

    def known_ids(self) -> list[str]:
        """Ids held right now, without expiring anyone (for tests and health output)."""
        return sorted(self._workers)

    def note_routed(self, worker_id: str, *, num_requests: int = 0, num_prefill_tokens: int = 0,
                    num_tokens: int = 0) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.num_routed += num_requests
            state.num_routed_prefill_tokens += num_prefill_tokens
            state.num_routed_tokens += num_tokens

    def count_by_role(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.alive():
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.alive())

    def _drop(self, worker_id: str, reason: str) -> None:
        state = self._workers.pop(worker_id, None)
        if state is not None and self.on_leave is not None:
            self.on_leave(state, reason)
