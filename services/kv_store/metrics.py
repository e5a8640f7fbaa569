"""The kv_store's Prometheus metrics, collected at scrape time from its core (a registry per store).

The same numbers as its health detail, read under the core's lock so one scrape
is a consistent snapshot: slots by state, pages and bytes per tier, hits and
misses per tier, commits, evictions, spills, promotions, corrupted L3 files.
Every series carries the store's ``host_id`` and ``worker_id``; before the first
engine attaches (no arena yet) only ``kvbus_kv_store_attached`` (0) is reported.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class KVStoreMetrics:
    def __init__(self, actor):
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(actor))


class _StoreCollector:
    def __init__(self, actor):
        self.actor = actor

    def collect(self):
        actor = self.actor
        names, values = ["host_id", "worker_id"], [actor.host_id, actor.worker_id]

        def family(cls, name: str, doc: str, rows: dict[str, float] | float, label: str = ""):
            fam = cls(name, doc, labels=names + ([label] if label else []))
            for key, value in (rows.items() if label else [("", rows)]):
                fam.add_metric(values + ([key] if label else []), value)
            return fam

        core = actor.core
        if core is None or core.index is None:
            yield family(GaugeMetricFamily, "kvbus_kv_store_attached", "1 once an engine created the L2 arena.", 0)
            return
        with core.lock:
            idx, disk, k = core.index, core.disk, dict(core.counters)
            page_bytes = core.arena.layout.page_bytes if core.arena is not None else 0
            slots = {"stored": idx.num_stored, "leased": idx.num_leased, "free": len(idx.free)}
            num_slots = idx.num_slots
            disk_pages = len(disk) if disk is not None else 0
            disk_max = disk.max_pages if disk is not None else 0
            disk_evicted = disk.num_evicted if disk is not None else 0
            corrupted = disk.num_corrupted if disk is not None else 0
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield family(G, "kvbus_kv_store_attached", "1 once an engine created the L2 arena.", 1)
        yield family(G, "kvbus_kv_store_slots_capacity", "Page slots of the L2 (host memory) arena.", num_slots)
        yield family(G, "kvbus_kv_store_slots", "L2 slots by state (they sum to the capacity).", slots, "state")
        yield family(G, "kvbus_kv_store_page_bytes", "Bytes of one KV page (one slot, one L3 file's payload).",
                     page_bytes)
        yield family(G, "kvbus_kv_store_pages", "Pages held per tier.",
                     {"host": slots["stored"], "disk": disk_pages}, "tier")
        yield family(G, "kvbus_kv_store_bytes", "Bytes of pages held per tier (pages x page bytes).",
                     {"host": slots["stored"] * page_bytes, "disk": disk_pages * page_bytes}, "tier")
        yield family(G, "kvbus_kv_store_disk_pages_capacity", "Most pages L3 keeps (0: no disk tier).", disk_max)
        yield family(C, "kvbus_kv_store_hits", "Looked-up pages found per tier (a disk hit is promoted to L2).",
                     {"host": k["hits_host"], "disk": k["hits_disk"]}, "tier")
        # A lookup stops at its first miss. Missing from L2 is a disk hit or a miss of both tiers.
        misses = {"host": k["hits_disk"] + k["misses"]}
        if disk is not None:
            misses["disk"] = k["misses"]
        yield family(C, "kvbus_kv_store_misses", "Lookups that ended at a page this tier lacks.", misses, "tier")
        yield family(C, "kvbus_kv_store_committed_pages", "Pages engines wrote into L2 and committed.", k["committed"])
        yield family(C, "kvbus_kv_store_duplicate_pages", "Commits of pages L2 already held (slot freed).",
                     k["duplicates"])
        yield family(C, "kvbus_kv_store_evicted_pages", "Pages evicted per tier (LRU).",
                     {"host": k["evicted_host"], "disk": disk_evicted}, "tier")
        yield family(C, "kvbus_kv_store_spilled_pages", "Pages L2 evicted that were written to L3.", k["spilled_disk"])
        yield family(C, "kvbus_kv_store_spilled_bytes", "Bytes written to L3.", k["bytes_in_disk"])
        yield family(C, "kvbus_kv_store_promoted_pages", "L3 pages copied into L2 for a lookup (the disk hits).",
                     k["hits_disk"])
        yield family(C, "kvbus_kv_store_remote_pages",
                     "Pages moved over the transfer layer for engines on other hosts: in = written back, out = fetched.",
                     {"in": k["remote_in"], "out": k["remote_out"]}, "direction")
        yield family(C, "kvbus_kv_store_corrupted_pages", "L3 files dropped for a failed checksum (never served).",
                     corrupted)
