"""The draft service's Prometheus metrics (a registry per replica; ``--metrics-port`` serves them).

Observed as they happen: each batch's size (propose requests drafted together) and run time, the
items proposed and the tokens in their proposals, the streams a worker had to resync, the batches that
failed. Read at scrape time: the requests waiting for the next batch and the streams held. The actor
calls :meth:`observe_batch` once per batch; nothing else knows of Prometheus.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class DraftMetrics:
    def __init__(self, num_waiting: Callable[[], int], num_streams: Callable[[], int]):
        """``num_waiting``: propose requests queued for the next batch now; ``num_streams``: streams held."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram("kvbus_draft_batch_size", "Propose requests (one per decode worker step) "
                                    "drafted together in one batch.", buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_seconds = Histogram("kvbus_draft_batch_seconds", "Run time of one batch: stream updates and "
                                       "every proposal (a model drafter's forward passes).",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.proposals = Counter("kvbus_draft_proposals", "Sequences given a proposal (of one token or more).",
                                 registry=r)
        self.proposed_tokens = Counter("kvbus_draft_proposed_tokens", "Tokens proposed, over every proposal "
                                       "(the workers count how many their engines accepted).", registry=r)
        self.resyncs = Counter("kvbus_draft_resyncs", "Items answered resync: the service did not hold the "
                               "stream at the length the worker named (restarted, or dropped past max_streams).",
                               registry=r)
        self.failed_batches = Counter("kvbus_draft_failed_batches", "Batches whose drafting raised (their "
                                      "requests answered unavailable; the workers decode plainly).", registry=r)
        self.waiting = Gauge("kvbus_draft_num_requests_waiting", "Propose requests queued for the next batch.",
                             registry=r)
        self.waiting.set_function(num_waiting)
        self.streams = Gauge("kvbus_draft_num_streams", "Request streams held (their tokens so far).", registry=r)
        self.streams.set_function(num_streams)

    def observe_batch(self, num_requests: int, seconds: float, num_proposals: int, num_tokens: int,
                      num_resyncs: int) -> None:
        self.batch_size.observe(num_requests)
        self.batch_seconds.observe(seconds)
        self.proposals.inc(num_proposals)
        self.proposed_tokens.inc(num_tokens)
        self.resyncs.inc(num_resyncs)
