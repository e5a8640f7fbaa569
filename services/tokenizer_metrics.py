"""The tokenizer's Prometheus metrics (a registry per replica; ``--metrics-port`` serves them).

Observed as they happen: each request's latency by kind (encode, decode, chat; from the handler's
submit to its result, the wait for the batch loop included), each batch's size and run time, and the
requests refused because the queue was full. Read at scrape time: the queue's depth. The actor calls
:meth:`timed` around a submit and :meth:`observe_batch` once per batch; nothing else knows of
Prometheus.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KINDS = ("encode", "decode", "chat")


class TokenizerMetrics:
    def __init__(self, num_waiting: Callable[[], int]):
        """``num_waiting``: requests queued for the batch loop now."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram("kvbus_tokenizer_request_latency_seconds", "One request, submitted to answered "
                                 "(queue wait included), by kind: encode, decode, chat (template and ids).",
                                 ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kvbus_tokenizer_batch_size", "Requests tokenized together in one batch.",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_seconds = Histogram("kvbus_tokenizer_batch_seconds", "Run time of one batch (the fast "
                                       "tokenizer's batch calls, off the event loop).", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.refused = Counter("kvbus_tokenizer_requests_refused", "Requests refused: the queue was full "
                               "(overloaded).", registry=r)
        self.waiting = Gauge("kvbus_tokenizer_num_requests_waiting", "Requests queued for the batch loop.",
                             registry=r)
        self.waiting.set_function(num_waiting)
        for kind in KINDS:  # every kind's series exists from the start, at zero
            self.latency.labels(kind)

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Observe one request of ``kind``, answered or failed."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.latency.labels(kind).observe(time.perf_counter() - started)

    def observe_batch(self, num_requests: int, seconds: float) -> None:
        self.batch_size.observe(num_requests)
        self.batch_seconds.observe(seconds)
