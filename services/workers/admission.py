"""Admission control of one engine worker: bound the queue by count and by expected wait.

A request is refused at once (``overloaded``, with a Retry-After) when the
worker already holds ``max_running_requests + max_queue`` requests, or when
the wait it can expect before a batch slot frees (from the recent service
times) exceeds ``max_queue_wait``, or, with the request's deadline, when it
could not start and finish before the deadline. So what is accepted finishes,
and what is not learns so in milliseconds instead of timing out in a queue.

Expected wait: with ``R`` slots, ``n`` requests in the system and a mean
service time ``S``, the new request starts when ``n - R + 1`` of them have
finished; slots free at a rate of about ``R / S``, so the wait is about
``(n - R + 1) * S / R``. ``S`` is an exponential moving average over finished
requests; before the first one finishes only the count bound applies. The
request's own service time is estimated from the mean seconds per generated
token times its ``max_tokens`` (unknown without one: then only its start must
fit the deadline).
"""

from __future__ import annotations

from bus.errors import Overloaded

EWMA_WEIGHT = 0.2
"""Weight of the newest service time in the moving average."""


class Admission:
    def __init__(self, max_running: int, max_queue: int, max_queue_wait: float):
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_queue_wait = max_queue_wait
        self.mean_service_s: float | None = None
        self.mean_token_s: float | None = None
        self.num_refused = 0

    def observe_finished(self, service_s: float, num_tokens: int = 0) -> None:
        """One request finished ``service_s`` seconds after it was admitted, having generated ``num_tokens``."""
        self.mean_service_s = _ewma(self.mean_service_s, service_s)
        if num_tokens > 0:
            self.mean_token_s = _ewma(self.mean_token_s, service_s / num_tokens)

    def expected_wait(self, num_in_system: int) -> float:
        """Seconds until a request arriving now gets a batch slot."""
        ahead = num_in_system - self.max_running + 1
        if ahead <= 0 or self.mean_service_s is None:
            return 0.0
        return ahead * self.mean_service_s / self.max_running

    def check(self, num_in_system: int, deadline_s: float | None, who: str, max_tokens: int | None = None) -> None:
        """Raise Overloaded (with retry_after) when a new request should not be queued."""
        slot_s = (self.mean_service_s or 1.0) / self.max_running
        limit = self.max_running + self.max_queue
        if num_in_system >= limit:
            self._refuse(f"{who} is full: {num_in_system} requests in the system (limit {limit})",
                         (num_in_system - limit + 1) * slot_s)
        wait = self.expected_wait(num_in_system)
        if wait > self.max_queue_wait:
            self._refuse(f"{who}: expected queue wait {wait:.1f}s exceeds max_queue_wait="
                         f"{self.max_queue_wait:g}s", wait - self.max_queue_wait)
        if deadline_s is not None:
            service = self.mean_token_s * max_tokens if max_tokens and self.mean_token_s is not None else 0.0
            if wait + service > deadline_s:
                self._refuse(f"{who}: expected wait {wait:.1f}s plus service {service:.1f}s exceeds the "
                             f"request's deadline ({deadline_s:.1f}s left)", max(wait, slot_s))

    def _refuse(self, message: str, retry_after: float) -> None:
        self.num_refused += 1
        raise Overloaded(message + "; retry later", retry_after=round(max(retry_after, 0.5), 3))


def _ewma(mean: float | None, value: float) -> float:
    return value if mean is None else mean + EWMA_WEIGHT * (value - mean)
