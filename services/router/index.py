"""The router's KV index: which worker holds which page, in which tier, fed by KV events.

Publishers are engine workers (tier ``device``: their own pool) and kv_stores (tiers ``host`` and
``disk``: one per host, shared by every engine there). The index keeps, per publisher, the pages it
holds and in which tiers (bits), and answers one question per decision: how long a leading run of a
prompt's pages can a worker get without computing them (:meth:`KVIndex.match`: its own pages, then
its host's stores'). One dict per publisher, not one per page: a decision looks up each page in a
few dicts, and the garbage collector has a few containers to walk, not one per page.

Keeping in step with a publisher (no I/O here; ``events.py`` moves the messages):

- batches are applied in ``event_id`` order; a jump is a gap (``num_gaps``): the publisher is
  marked for a dump, and batches that arrive meanwhile are held and replayed on top of it;
- a publisher seen for the first time mid-stream, and every worker that joins, is dumped too;
  until its first dump (or a batch with id 1) a publisher gives no credit: a restarted router
  rebuilds from dumps before it routes with overlap credit;
- an id that goes back means the publisher restarted: its pages are purged;
- a worker that leaves is purged; a publisher that is no live worker (a kv_store) and stays
  silent for ``publisher_ttl`` is dumped again, and purged when nobody answers.

Approximate mode: a worker whose dump finds no responder (events off, another implementation of
our subjects) is credited with the prompts the router itself sent it, each page for ``approx_ttl``.
Applying events is idempotent (a page stored twice is stored), so replaying a batch that a dump
already reflects is harmless.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from schemas.kv_store import KVDumpReply, KVEvent, KVEventBatchEvent

DEVICE, HOST, DISK = 1, 2, 4
TIER_BITS = {"device": DEVICE, "host": HOST, "disk": DISK}
STORE_TIERS = HOST | DISK
MAX_HELD_BATCHES = 1024
"""Batches held while a dump is in flight; past it they are dropped and another dump is asked."""
MAX_PREDICTED_PAGES = 200_000
"""Most pages predicted per approximate-mode worker (the oldest go first)."""
RETRY_MAX_S = 30.0


@dataclasses.dataclass(slots=True)
class Publisher:
    publisher_id: str
    host_id: str
    last_heard: float
    pages: dict[int, int] = dataclasses.field(default_factory=dict)
    """Page hash -> tier bits."""
    last_event_id: int | None = None
    """Id of the last batch applied; None: no history (credit waits for a dump or a batch with id 1)."""
    is_worker: bool = False
    """A live engine worker (heartbeats); else a kv_store or a publisher not heard of otherwise."""
    is_store: bool = False
    """It published host or disk tiers: its pages count for every worker on its host."""
    can_dump: bool = True
    """False once a dump found no responder: its events are applied as they come, gaps and all."""
    wants_dump: bool = False
    is_dumping: bool = False
    held: list[KVEventBatchEvent] = dataclasses.field(default_factory=list)
    num_dump_failures: int = 0
    retry_at: float = 0.0

    @property
    def is_synced(self) -> bool:
        return self.last_event_id is not None


class Match(NamedTuple):
    """A leading run of a prompt's full pages a worker can have without computing them, by tier."""

    num_device_pages: int = 0
    num_host_pages: int = 0
    num_disk_pages: int = 0

    @property
    def num_pages(self) -> int:
        return self.num_device_pages + self.num_host_pages + self.num_disk_pages


class KVIndex:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, approx_ttl: float = 120.0,
                 publisher_ttl: float = 60.0, retry_s: float = 1.0):
        self.clock = clock
        self.approx_ttl, self.publisher_ttl, self.retry_s = approx_ttl, publisher_ttl, retry_s
        self._publishers: dict[str, Publisher] = {}
        self._stores_by_host: dict[str, set[str]] = {}
        self._predicted: dict[str, OrderedDict[int, float]] = {}  # approximate workers: hash -> expiry
        self.num_pages = {"device": 0, "host": 0, "disk": 0}
        """(publisher, page, tier) entries held, by tier."""
        self.num_gaps = 0
        self.num_restarts = 0
        self.num_stale = 0
        self.num_resyncs = 0
        self.num_dump_failures = 0
        self.num_batches = 0

    # --- membership -----------------------------------------------------------------------
    def worker_joined(self, worker_id: str, host_id: str) -> None:
        """A worker's first heartbeat: ask its whole state (a router that just started has none)."""
        self._predicted.pop(worker_id, None)
        pub = self._publisher(worker_id, host_id)
        pub.is_worker, pub.can_dump, pub.num_dump_failures, pub.retry_at = True, True, 0, 0.0
        if not pub.is_dumping:
            pub.wants_dump = True

    def worker_left(self, worker_id: str) -> None:
        self._predicted.pop(worker_id, None)
        pub = self._publishers.pop(worker_id, None)
        if pub is not None:
            self._forget(pub)

    def is_approximate(self, worker_id: str) -> bool:
        return worker_id in self._predicted

    def is_synced(self, worker_id: str) -> bool:
        """Whether the worker's pages can be credited: in step with its events, or approximate."""
        pub = self._publishers.get(worker_id)
        return worker_id in self._predicted or (pub is not None and pub.is_synced)

    # --- events ---------------------------------------------------------------------------
    def apply_batch(self, batch: KVEventBatchEvent) -> None:
        self.num_batches += 1
        worker_id = batch.worker_id
        if self._predicted.pop(worker_id, None) is not None:  # it publishes after all: exact from now
            pub = self._publisher(worker_id, batch.host_id)
            pub.can_dump, pub.wants_dump = True, True
        pub = self._publisher(worker_id, batch.host_id)
        pub.last_heard = self.clock()
        if pub.wants_dump or pub.is_dumping:  # replayed on top of the dump
            self._hold(pub, batch)
            return
        last = pub.last_event_id
        if last is not None and batch.event_id <= last:
            if batch.event_id != 1:  # late: a dump that overtook it reflects it already
                self.num_stale += 1
                return
            self.num_restarts += 1  # ids start over: a new process (or batch 1 behind its dump: the
            self._purge(pub)  # same state either way, once batch 2 follows)
            pub.last_event_id = last = None
        if batch.event_id == 1 and last is None:  # a fresh publisher: this is its whole history
            self._apply(pub, batch.events)
            pub.last_event_id = 1
        elif last is not None and (batch.event_id == last + 1 or not pub.can_dump):
            self.num_gaps += batch.event_id != last + 1
            self._apply(pub, batch.events)
            pub.last_event_id = batch.event_id
        else:  # a gap, or first heard of mid-stream: resync
            if last is not None:
                self.num_gaps += 1
            if pub.can_dump:
                pub.wants_dump = True
                self._hold(pub, batch)
            else:
                self._apply(pub, batch.events)
                pub.last_event_id = batch.event_id

    def take_dump_requests(self) -> list[str]:
        """Publishers to ask for a dump now (each is then in flight until :meth:`apply_dump` or
        :meth:`dump_failed`); silent publishers that are no worker are asked too (are they there?)."""
        now = self.clock()
        wanted = []
        for pub in self._publishers.values():
            if not pub.is_worker and not pub.is_dumping and not pub.wants_dump \
                    and now - pub.last_heard >= self.publisher_ttl:
                pub.wants_dump, pub.can_dump = True, True
            if pub.wants_dump and not pub.is_dumping and pub.retry_at <= now:
                pub.wants_dump, pub.is_dumping = False, True
                wanted.append(pub.publisher_id)
        return wanted

    def apply_dump(self, reply: KVDumpReply) -> None:
        """A publisher's whole state as of ``reply.event_id``; the batches held meanwhile follow."""
        pub = self._publishers.get(reply.worker_id)
        if pub is None or not pub.is_dumping:  # it left meanwhile (or nobody asked)
            return
        if pub.host_id != reply.host_id:
            pub = self._publisher(reply.worker_id, reply.host_id)
        self._predicted.pop(reply.worker_id, None)
        pub.is_dumping = pub.wants_dump = False
        pub.num_dump_failures, pub.retry_at, pub.last_heard = 0, 0.0, self.clock()
        self._purge(pub)
        self._apply(pub, reply.events)
        pub.last_event_id = reply.event_id
        self.num_resyncs += 1
        held, pub.held = sorted(pub.held, key=lambda b: b.event_id), []
        for batch in held:
            if batch.event_id > reply.event_id:
                self.num_batches -= 1  # counted when it came
                self.apply_batch(batch)

    def dump_failed(self, publisher_id: str, *, no_responders: bool) -> None:
        """The dump was not answered. Nobody serves the subject: a worker that never published
        becomes approximate, a publisher that did is followed as it comes, one that is no worker is
        gone. Else (timeout, error) it is asked again later, waiting twice as long each time."""
        pub = self._publishers.get(publisher_id)
        if pub is None:
            return
        self.num_dump_failures += 1
        pub.is_dumping = False
        if not no_responders:
            pub.num_dump_failures += 1
            pub.wants_dump = True
            pub.retry_at = self.clock() + min(self.retry_s * 2 ** (pub.num_dump_failures - 1), RETRY_MAX_S)
            return
        pub.can_dump = False
        if not pub.is_worker:
            self._publishers.pop(publisher_id, None)
            self._forget(pub)
        elif pub.last_event_id is None and not pub.held:
            self._predicted.setdefault(publisher_id, OrderedDict())
        else:
            held, pub.held = sorted(pub.held, key=lambda b: b.event_id), []
            for batch in held:
                self._apply(pub, batch.events)
                pub.last_event_id = batch.event_id

    # --- approximate mode -----------------------------------------------------------------
    def predict(self, worker_id: str, page_hashes: Iterable[int]) -> None:
        """The router sent these pages' prompt to an approximate-mode worker: count them as held there."""
        predicted = self._predicted.get(worker_id)
        if predicted is None:
            return
        expires = self.clock() + self.approx_ttl
        for h in page_hashes:
            predicted[h] = expires
            predicted.move_to_end(h)
        while len(predicted) > MAX_PREDICTED_PAGES:
            predicted.popitem(last=False)

    def expire(self) -> int:
        """Drop predictions past their TTL (they are ordered by expiry); how many went."""
        now, num = self.clock(), 0
        for predicted in self._predicted.values():
            while predicted and next(iter(predicted.values())) <= now:
                predicted.popitem(last=False)
                num += 1
        return num

    # --- lookups --------------------------------------------------------------------------
    def match(self, worker_id: str, host_id: str, page_hashes: Iterable[int]) -> Match:
        """The leading run of ``page_hashes`` the worker holds (device) or its host's kv_store holds
        (host, disk), each page counted in the best tier that has it."""
        return self.match_all([(worker_id, host_id)], page_hashes)[0]

    def match_all(self, workers: Sequence[tuple[str, str]], page_hashes: Iterable[int]) -> list[Match]:
        """:meth:`match` for several ``(worker id, host id)`` at once, in one walk over the pages that
        stops where the longest run does. ``page_hashes`` may be lazy (``prompt.PromptPages``): a cold
        prompt is hashed no further than its first pages."""
        counts = [[0, 0, 0] for _ in workers]
        walking = []  # (index, own pages, store pages, predicted): the workers whose run goes on
        for i, (worker_id, host_id) in enumerate(workers):
            predicted = self._predicted.get(worker_id)
            if predicted is not None:
                walking.append((i, None, (), predicted))
                continue
            own, stores = self._sources(worker_id, host_id)
            if own is not None or stores:
                walking.append((i, own or {}, stores, None))
        now = self.clock()
        # pages hashed so far, then more on demand (a lazy PromptPages), read in chunks
        computed, extend = (page_hashes.computed, page_hashes.extend) if hasattr(page_hashes, "computed") \
            else (list(page_hashes), None)
        i, ahead = 0, 8
        while walking:
            if i == len(computed):
                if extend is None or not extend(ahead):
                    break
                ahead *= 2
            chunk = computed[i:]
            if len(walking) == 1 and walking[0][3] is None and not walking[0][2]:  # one worker's own pages
                index, own = walking[0][0], walking[0][1]
                for h in chunk:
                    if not own.get(h, 0) & DEVICE:
                        walking = []
                        break
                    counts[index][0] += 1
                i += len(chunk)
                continue
            for h in chunk:
                i += 1
                going_on = []
                for entry in walking:
                    index, own, stores, predicted = entry
                    if predicted is not None:
                        tier = 0 if predicted.get(h, 0.0) > now else -1
                    elif own.get(h, 0) & DEVICE:
                        tier = 0
                    else:
                        bits = 0
                        for pages in stores:
                            bits |= pages.get(h, 0)
                        tier = 1 if bits & HOST else 2 if bits & DISK else -1
                    if tier >= 0:
                        counts[index][tier] += 1
                        going_on.append(entry)
                walking = going_on
                if not walking or (len(walking) == 1 and walking[0][3] is None and not walking[0][2]):
                    break
        return [Match(*c) for c in counts]

    def find_tail(self, worker_id: str, host_id: str, tail_hashes: Sequence[int]) -> tuple[int, int] | None:
        """``(index, tier bit)`` of the first of ``tail_hashes`` (tails of one page, longest first)
        held for the worker, or None. Approximate mode predicts no tails."""
        if worker_id in self._predicted:
            return None
        own, stores = self._sources(worker_id, host_id)
        for i, h in enumerate(tail_hashes):
            if own is not None and own.get(h, 0) & DEVICE:
                return i, DEVICE
            bits = 0
            for pages in stores:
                bits |= pages.get(h, 0)
            if bits & STORE_TIERS:
                return i, HOST if bits & HOST else DISK
        return None

    def _sources(self, worker_id: str, host_id: str) -> tuple[dict[int, int] | None, list[dict[int, int]]]:
        """The pages that count for a worker: its own (None until in step) and its host's stores'."""
        pub = self._publishers.get(worker_id)
        own = pub.pages if pub is not None and pub.is_synced else None
        stores = [self._publishers[s].pages for s in self._stores_by_host.get(host_id, ())
                  if self._publishers[s].is_synced]
        return own, stores

    def stats(self) -> dict[str, int]:
        pubs = self._publishers.values()
        return {"pages_device": self.num_pages["device"], "pages_host": self.num_pages["host"],
                "pages_disk": self.num_pages["disk"],
                "pages_predicted": sum(len(p) for p in self._predicted.values()),
                "publishers": len(self._publishers), "publishers_synced": sum(p.is_synced for p in pubs),
                "workers_approximate": len(self._predicted), "gaps": self.num_gaps, "resyncs": self.num_resyncs,
                "restarts": self.num_restarts, "stale": self.num_stale, "dump_failures": self.num_dump_failures,
                "batches": self.num_batches}

    def publisher_ids(self) -> list[str]:
        return sorted(self._publishers)

    # --- state ----------------------------------------------------------------------------
    def _publisher(self, publisher_id: str, host_id: str) -> Publisher:
        pub = self._publishers.get(publisher_id)
        if pub is None:
            pub = self._publishers[publisher_id] = Publisher(publisher_id, host_id, self.clock())
        elif pub.host_id != host_id:  # moved (a new process on another host): its pages moved too
            self._forget(pub)
            pub.host_id, pub.last_event_id = host_id, None
        return pub

    def _hold(self, pub: Publisher, batch: KVEventBatchEvent) -> None:
        if len(pub.held) >= MAX_HELD_BATCHES:  # the dump took too long: another one after it
            pub.held.clear()
            pub.wants_dump = True
        pub.held.append(batch)

    def _apply(self, pub: Publisher, events: Sequence[KVEvent]) -> None:
        for event in events:
            bit = TIER_BITS.get(event.tier)
            if bit is None:
                continue
            if bit & STORE_TIERS and not pub.is_store:
                pub.is_store = True
                self._stores_by_host.setdefault(pub.host_id, set()).add(pub.publisher_id)
            if event.kind == "stored":
                for h in event.page_hashes:
                    self._add(pub, h, bit, event.tier)
            elif event.kind == "removed":
                for h in event.page_hashes:
                    self._remove(pub, h, bit, event.tier)

    def _add(self, pub: Publisher, h: int, bit: int, tier: str) -> None:
        bits = pub.pages.get(h, 0)
        if not bits & bit:
            pub.pages[h] = bits | bit
            self.num_pages[tier] += 1

    def _remove(self, pub: Publisher, h: int, bit: int, tier: str) -> None:
        bits = pub.pages.get(h, 0)
        if bits & bit:
            if bits & ~bit:
                pub.pages[h] = bits & ~bit
            else:
                del pub.pages[h]
            self.num_pages[tier] -= 1

    def _purge(self, pub: Publisher) -> None:
        for bits in pub.pages.values():
            for tier, bit in TIER_BITS.items():
                if bits & bit:
                    self.num_pages[tier] -= 1
        pub.pages.clear()

    def _forget(self, pub: Publisher) -> None:
        self._purge(pub)
        pub.held.clear()
        if pub.is_store:
            stores = self._stores_by_host.get(pub.host_id)
            if stores is not None:
                stores.discard(pub.publisher_id)
                if not stores:
                    del self._stores_by_host[pub.host_id]
            pub.is_store = False
