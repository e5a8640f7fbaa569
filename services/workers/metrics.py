"""An engine worker's Prometheus metrics (prefill, decode, aggregated), a registry per worker.

Collected at scrape time from counters the engine, its block manager and the
HiCache tier client already keep (the same numbers as the health detail), so
the engine step does no extra work. The one series observed as it happens is
the load-back latency histogram: the tier client calls ``observe`` once per
load-back (it used to keep only the sum). Every series carries the worker's
``role`` and ``worker_id``. The HiCache series (``kvbus_hicache_*``) appear only
on workers started with ``--hicache``. docs/hicache.md lists them all.

Read from the event loop while the engine thread runs: single integer reads,
no iteration over the engine's structures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: a few pages from the shared arena take well under a millisecond; a long prefix
# on a loaded CPU, tens of milliseconds.
LOAD_BACK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class WorkerMetrics:
    """``registry`` holds the worker's series; :meth:`attach_tier` wires the load-back histogram."""

    def __init__(self, worker):
        self.registry = CollectorRegistry()
        self.labels = {"role": worker.role, "worker_id": worker.worker_id}
        self.load_back_seconds = Histogram(
            "kvbus_hicache_load_back_seconds", "Duration of one load-back (host tier to KV pool pages).",
            list(self.labels), buckets=LOAD_BACK_BUCKETS, registry=self.registry).labels(**self.labels)
        self.registry.register(_WorkerCollector(worker, self.labels))

    def attach_tier(self, tier) -> None:
        tier.observe_load_back = self.load_back_seconds.observe


class _WorkerCollector:
    def __init__(self, worker, labels: dict[str, str]):
        self.worker = worker
        self.names, self.values = list(labels), list(labels.values())

    def _family(self, kind, name: str, doc: str, value: float, **extra: str):
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(name, doc, labels=self.names + list(extra))
        fam.add_metric(self.values + list(extra.values()), value)
        return fam

    def _counters(self, name: str, doc: str, label: str, rows: dict[str, float]):
        """One counter family with a sample per value of ``label``."""
        fam = CounterMetricFamily(name, doc, labels=[*self.names, label])
        for key, value in rows.items():
            fam.add_metric([*self.values, key], value)
        return fam

    def collect(self):
        w = self.worker
        engine = w.engine
        if engine is None:  # not set up yet
            return
        c, g = "counter", "gauge"
        bm, st = engine.block_manager, engine.stats
        # named as vLLM's scheduler state (vllm:num_requests_running, ...: docs/observability.md)
        yield self._family(g, "kvbus_num_requests_running", "Requests in the engine's running batch.",
                           engine.num_running)
        yield self._family(g, "kvbus_num_requests_waiting",
                           "Requests waiting: in the engine's queue, or admitted and awaiting KV or a prefill.",
                           engine.num_waiting + w.num_admitting)
        yield self._family(c, "kvbus_engine_requests_refused", "Requests refused by admission (overloaded).",
                           w.admission.num_refused)
        free = bm.num_free_pages
        yield self._family(g, "kvbus_kv_cache_usage_perc", "Share of the KV pool's pages held by requests "
                           "(1 = full; cached prefixes nobody uses count as free).",
                           (bm.num_pages - free) / bm.num_pages if bm.num_pages else 0.0)
        yield self._family(g, "kvbus_engine_kv_pages_total", "Pages of the KV pool.", bm.num_pages)
        yield self._family(g, "kvbus_engine_kv_pages_used", "KV pool pages held by requests.", bm.num_pages - free)
        yield self._family(g, "kvbus_engine_kv_pages_free", "KV pool pages free or holding evictable cached prefixes.",
                           free)
        yield self._family(g, "kvbus_engine_kv_pages_cached", "Free pages that hold a cached prefix (L1).",
                           bm.num_cached_pages)
        yield self._family(c, "kvbus_engine_kv_pages_evicted", "Cached pages evicted from L1 (the KV pool).",
                           bm.num_evictions)
        yield self._family(g, "kvbus_engine_kv_pages_held",
                           "Of the cached pages, those waiting requests will reuse (evicted after all others).",
                           bm.num_held_pages)
        yield self._family(c, "kvbus_engine_kv_held_pages_evicted",
                           "Held pages evicted all the same: the pool needed them before their request ran.",
                           bm.holds.num_evicted)
        # Prefix cache, in prompt tokens of finished requests (the usage's split). Misses are
        # prompt - hits in PromQL: a difference taken here could step back between two engine
        # updates, and a counter must never decrease.
        yield self._family(c, "kvbus_engine_prompt_tokens", "Prompt tokens of finished requests.",
                           st.num_prompt_tokens)
        yield self._counters("kvbus_engine_prefix_cache_hit_tokens",
                             "Prompt tokens not computed: found in L1 (tier=device) or loaded back from "
                             "HiCache (tier=host, L3 promotions included).", "tier",
                             {"device": st.num_cached_device_tokens, "host": st.num_cached_host_tokens})
        if hasattr(w, "transfer_bytes"):  # a decode worker: KV received from prefill workers
            yield self._family(c, "kvbus_kv_transfer_received_bytes", "KV payload bytes received from prefill workers.",
                               w.transfer_bytes)
            yield self._family(c, "kvbus_kv_transfer_received_pages", "KV pages received from prefill workers.",
                               w.transfer_pages)
            yield self._family(c, "kvbus_kv_transfer_skipped_pages",
                               "Prompt pages not sent: this worker held them (prefix cache or host tier).",
                               w.transfer_pages_skipped)
            yield self._family(c, "kvbus_kv_transfer_import_gaps",
                               "Imported requests whose held prefix had shrunk before admission (recomputed here).",
                               engine.scheduler.num_import_gaps)
        tier = w.tier
        if tier is None:
            return
        s = tier.stats
        yield self._family(g, "kvbus_hicache_attached", "1 while attached to the host's kv_store arena.",
                           int(tier.is_attached))
        yield self._counters("kvbus_hicache_lookups",
                             "Host-tier lookups of a request's pages missing from L1: result=hit loaded "
                             "at least one page, miss found fewer than hicache_min_load_pages.",
                             "result", {"hit": s["hits"], "miss": s["misses"]})
        yield self._family(c, "kvbus_hicache_written_back_pages",
                           "Pages copied to the host tier (write-back and write-through, the sync ones included).",
                           s["written_back"])
        yield self._family(c, "kvbus_hicache_written_back_sync_pages",
                           "Of those, copied on the engine thread because the pool ran dry first.", s["written_sync"])
        yield self._family(c, "kvbus_hicache_dropped_pages",
                           "Pages evicted from L1 unwritten: no host slot was at hand.", s["dropped"])
        yield self._family(c, "kvbus_hicache_written_back_bytes", "Bytes copied to the host tier.",
                           s["write_back_bytes"])
        yield self._family(c, "kvbus_hicache_loaded_back_pages", "Pages loaded back from the host tier.",
                           s["loaded_back"])
        yield self._family(c, "kvbus_hicache_loaded_back_bytes", "Bytes loaded back from the host tier.",
                           s["load_back_bytes"])
        yield self._family(c, "kvbus_hicache_verify_failed_pages",
                           "Host pages that changed under a load-back (recomputed, never served).", s["verify_failed"])
        yield self._family(c, "kvbus_hicache_async_loads",
                           "Load-backs run on the copy thread while other requests kept stepping.", bm.num_async_loads)
        yield self._family(c, "kvbus_hicache_loads_given_up",
                           "Asynchronous load-backs still in flight after load_back_timeout: their requests "
                           "computed those pages instead.", bm.num_load_timeouts)
        yield self._family(g, "kvbus_hicache_loads_inflight",
                           "Asynchronous load-backs not yet landed (those of aborted or given-up requests included).",
                           bm.num_loading)
        yield self._family(g, "kvbus_hicache_write_back_queue_depth",
                           "Copies queued for the copy thread, not yet started (write-backs; loads go first).",
                           tier.num_queued)
        yield self._family(g, "kvbus_hicache_write_back_inflight_pages",
                           "KV pool pages held by a write-back until the engine sees its copy land.", bm.num_copying)
        yield self._family(g, "kvbus_hicache_leased_slots", "Empty host slots leased for coming write-backs.",
                           tier.num_leased)
        link = getattr(tier.link, "stats", None)
        if link is not None:  # a kv_store on another host: pages moved by value
            for unit in ("pages", "bytes"):
                yield self._counters(f"kvbus_hicache_remote_{unit}",
                                     f"{unit.capitalize()} moved to (sent) or from (received) a kv_store on another "
                                     "host.", "direction",
                                     {"sent": link[f"{unit}_sent"], "received": link[f"{unit}_received"]})
            yield self._family(c, "kvbus_hicache_remote_failed",
                               "Puts of pages and fetches to a kv_store on another host that failed (the pages "
                               "stay local or are recomputed).", link["put_failed"] + link["fetch_failed"])
