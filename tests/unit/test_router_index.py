"""The router's KV index over fake KV events and a fake clock (no bus): events, gaps, resync, join and
leave, tiers, approximate mode."""

from __future__ import annotations

from schemas.kv_store import KVDumpReply, KVEvent, KVEventBatchEvent
from services.engine.page_hash import page_hashes
from services.router.index import KVIndex, Match

PROMPT = list(range(200))
HASHES = page_hashes(PROMPT[:192], 16)  # 12 pages


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ev(kind: str, hashes, tier: str = "device") -> KVEvent:
    return KVEvent(kind=kind, tier=tier, page_hashes=list(hashes), parent_hashes=[0] * len(hashes))


def batch(publisher: str, event_id: int, *events: KVEvent, host: str = "h1") -> KVEventBatchEvent:
    return KVEventBatchEvent(worker_id=publisher, host_id=host, event_id=event_id, events=list(events))


def dump(publisher: str, event_id: int, *events: KVEvent, host: str = "h1") -> KVDumpReply:
    return KVDumpReply(worker_id=publisher, host_id=host, event_id=event_id, events=list(events))


def make_index(**kwargs) -> tuple[KVIndex, FakeClock]:
    clock = FakeClock()
    return KVIndex(clock=clock, **kwargs), clock


def joined(index: KVIndex, *workers: str, host: str = "h1") -> None:
    """Workers that joined and were dumped empty (as a fresh worker is)."""
    for w in workers:
        index.worker_joined(w, host)
    assert sorted(index.take_dump_requests()) == sorted(workers)
    for w in workers:
        index.apply_dump(dump(w, 0, host=host))


def device(index: KVIndex, worker: str, host: str = "h1") -> int:
    return index.match(worker, host, HASHES).num_device_pages


# --- events ------------------------------------------------------------------------------
def test_stored_and_removed_pages_give_the_leading_run():
    index, _ = make_index()
    joined(index, "w1", "w2")
    index.apply_batch(batch("w1", 1, ev("stored", HASHES[:5])))
    index.apply_batch(batch("w2", 1, ev("stored", HASHES[:2]), ev("stored", HASHES[3:8])))
    assert index.match("w1", "h1", HASHES) == Match(num_device_pages=5)
    assert device(index, "w2") == 2  # page 2 missing: the run stops there
    index.apply_batch(batch("w1", 2, ev("removed", HASHES[3:4]), ev("stored", HASHES[3:4] * 2)))
    assert device(index, "w1") == 5  # removed then stored again, in order; a second store changes nothing
    index.apply_batch(batch("w1", 3, ev("removed", HASHES[1:2])))
    assert device(index, "w1") == 1
    assert index.stats()["pages_device"] == 4 + 7 and index.stats()["gaps"] == 0


def test_a_gap_asks_a_dump_and_the_batches_after_it_are_replayed_on_top():
    index, _ = make_index()
    joined(index, "w1")
    index.apply_batch(batch("w1", 1, ev("stored", HASHES[:3])))
    index.apply_batch(batch("w1", 3, ev("stored", HASHES[5:6])))  # 2 was lost
    assert index.stats()["gaps"] == 1 and index.take_dump_requests() == ["w1"]
    assert index.take_dump_requests() == []  # one in flight at a time
    assert device(index, "w1") == 3  # what it had still counts while the dump is on its way
    index.apply_batch(batch("w1", 4, ev("stored", HASHES[4:5])))  # held
    index.apply_batch(batch("w1", 5, ev("removed", HASHES[:1])))  # held
    # The dump says: as of batch 3 the worker holds pages 0-3 and 5 (batch 2 stored page 3 and 4, then 4 left).
    index.apply_dump(dump("w1", 3, ev("stored", HASHES[:4] + HASHES[5:6])))
    assert device(index, "w1") == 0  # batch 5 (page 0 removed) replayed after it
    index.apply_batch(batch("w1", 6, ev("stored", HASHES[:1])))
    assert device(index, "w1") == 6  # 0-3 from the dump, 4 from held batch 4, 5 from the dump
    assert index.stats()["resyncs"] == 2 and index.stats()["gaps"] == 1


def test_a_batch_older_than_the_dump_is_ignored_and_id_one_again_is_a_restart():
    index, _ = make_index()
    joined(index, "w1")
    index.apply_batch(batch("w1", 1, ev("stored", HASHES[:4])))
    index.worker_joined("w1", "h1")  # (heard again after a network split: dumped again)
    assert index.take_dump_requests() == ["w1"]
    index.apply_dump(dump("w1", 7, ev("stored", HASHES[:6])))
    index.apply_batch(batch("w1", 6, ev("removed", HASHES[:6])))  # overtaken by the dump: stale
    assert device(index, "w1") == 6 and index.stats()["stale"] == 1
    index.apply_batch(batch("w1", 1, ev("stored", HASHES[:2])))  # a new process under the same id
    assert device(index, "w1") == 2 and index.stats()["restarts"] == 1 and index.take_dump_requests() == []


def test_a_publisher_heard_of_mid_stream_gets_no_credit_until_its_dump():
    index, _ = make_index()
    index.apply_batch(batch("w1", 41, ev("stored", HASHES[:4])))  # a router that just (re)started
    assert device(index, "w1") == 0 and not index.is_synced("w1")
    index.worker_joined("w1", "h1")  # its heartbeat follows: the dump is asked once
    assert index.take_dump_requests() == ["w1"]
    index.apply_batch(batch("w1", 42, ev("stored", HASHES[4:5])))
    assert device(index, "w1") == 0
    index.apply_dump(dump("w1", 41, ev("stored", HASHES[:4])))
    assert device(index, "w1") == 5 and index.is_synced("w1")
    assert index.stats()["gaps"] == 0  # first sight is no gap


def test_a_batch_with_id_one_needs_no_dump():
    index, _ = make_index()
    index.apply_batch(batch("w9", 1, ev("stored", HASHES[:2])))
    assert device(index, "w9") == 2 and index.take_dump_requests() == []


def test_a_worker_that_leaves_is_purged_and_rejoins_empty():
    index, _ = make_index()
    joined(index, "w1", "w2")
    index.apply_batch(batch("w1", 1, ev("stored", HASHES)))
    index.apply_batch(batch("w2", 1, ev("stored", HASHES[:3])))
    index.worker_left("w1")
    assert device(index, "w1") == 0 and index.stats()["pages_device"] == 3
    assert index.publisher_ids() == ["w2"]
    index.worker_joined("w1", "h1")
    assert index.take_dump_requests() == ["w1"] and not index.is_synced("w1")
    index.apply_dump(dump("w1", 0))
    assert device(index, "w1") == 0 and index.is_synced("w1")


def test_a_dump_of_a_worker_that_left_meanwhile_is_dropped():
    index, _ = make_index()
    index.worker_joined("w1", "h1")
    assert index.take_dump_requests() == ["w1"]
    index.worker_left("w1")
    index.apply_dump(dump("w1", 3, ev("stored", HASHES)))
    assert index.publisher_ids() == [] and index.stats()["pages_device"] == 0


def test_a_dump_that_fails_is_asked_again_later_twice_as_late_each_time():
    index, clock = make_index(retry_s=1.0)
    index.worker_joined("w1", "h1")
    assert index.take_dump_requests() == ["w1"]
    index.dump_failed("w1", no_responders=False)
    clock.now += 0.99
    assert index.take_dump_requests() == []
    clock.now += 0.01
    assert index.take_dump_requests() == ["w1"]
    index.dump_failed("w1", no_responders=False)
    clock.now += 1.99
    assert index.take_dump_requests() == []
    clock.now += 0.01
    assert index.take_dump_requests() == ["w1"]
    index.apply_dump(dump("w1", 0))
    assert index.is_synced("w1") and index.stats()["dump_failures"] == 2


# --- tiers -------------------------------------------------------------------------------
def test_host_and_disk_pages_of_a_kv_store_count_for_every_worker_on_its_host():
    index, _ = make_index()
    joined(index, "w1", "w2")
    joined(index, "w3", host="h2")
    index.apply_batch(batch("w1", 1, ev("stored", HASHES[:2])))
    index.apply_batch(batch("store-h1", 1, ev("stored", HASHES[:6], "host"), ev("stored", HASHES[6:9], "disk")))
    # w1: its own 2 pages, then the store's host pages 2-5 and disk pages 6-8; the best tier counts
    assert index.match("w1", "h1", HASHES) == Match(num_device_pages=2, num_host_pages=4, num_disk_pages=3)
    assert index.match("w2", "h1", HASHES) == Match(num_host_pages=6, num_disk_pages=3)
    assert index.match("w3", "h2", HASHES) == Match()  # another host's store is no use
    # a page the store spills from memory to disk: removed from host, stored on disk
    index.apply_batch(batch("store-h1", 2, ev("removed", HASHES[3:4], "host"), ev("stored", HASHES[3:4], "disk")))
    assert index.match("w2", "h1", HASHES) == Match(num_host_pages=5, num_disk_pages=4)
    stats = index.stats()
    assert (stats["pages_device"], stats["pages_host"], stats["pages_disk"]) == (2, 5, 4)


def test_tails_are_found_longest_first_in_the_best_place():
    index, _ = make_index()
    joined(index, "w1", "w2")
    tails = [101, 102, 103]  # hashes of the tails of one page, longest first
    index.apply_batch(batch("w1", 1, ev("stored", [102])))
    index.apply_batch(batch("store", 1, ev("stored", [101], "disk")))
    assert index.find_tail("w1", "h1", tails) == (0, 4)  # the longest: the disk's
    assert index.find_tail("w2", "h1", tails[1:]) is None  # w1's tail is not w2's
    assert index.find_tail("w1", "h1", tails[1:]) == (0, 1)


def test_a_silent_store_is_asked_and_purged_when_nobody_answers():
    index, clock = make_index(publisher_ttl=60.0)
    joined(index, "w1")
    index.apply_batch(batch("store", 1, ev("stored", HASHES[:4], "host")))
    clock.now += 59.9
    assert index.take_dump_requests() == []
    clock.now += 0.1
    assert index.take_dump_requests() == ["store"]  # the workers are followed by their heartbeats
    index.apply_dump(dump("store", 1, ev("stored", HASHES[:4], "host")))  # it is there: fresh again
    clock.now += 60.0
    assert index.take_dump_requests() == ["store"]
    index.dump_failed("store", no_responders=True)
    assert index.match("w1", "h1", HASHES) == Match() and index.publisher_ids() == ["w1"]


# --- approximate mode ----------------------------------------------------------------------
def test_a_worker_without_events_is_credited_with_what_was_routed_to_it_for_a_ttl():
    index, clock = make_index(approx_ttl=120.0)
    index.worker_joined("w1", "h1")
    assert index.take_dump_requests() == ["w1"]
    index.dump_failed("w1", no_responders=True)  # nobody serves its dump subject
    assert index.is_approximate("w1") and index.is_synced("w1")
    assert device(index, "w1") == 0
    index.predict("w1", HASHES[:8])
    clock.now += 60.0
    index.predict("w1", HASHES[:3])  # sent again: these three live longer
    assert device(index, "w1") == 8
    clock.now += 59.99
    assert device(index, "w1") == 8 and index.expire() == 0
    clock.now += 0.01  # the first prediction's pages 3-7 expire at exactly 120 s
    assert device(index, "w1") == 3
    assert index.expire() == 5 and index.stats()["pages_predicted"] == 3
    clock.now += 60.0
    assert device(index, "w1") == 0 and index.expire() == 3
    index.predict("w2", HASHES)  # an exact-mode worker: predictions are not kept
    assert index.stats()["pages_predicted"] == 0


def test_an_approximate_worker_that_starts_publishing_becomes_exact():
    index, _ = make_index()
    index.worker_joined("w1", "h1")
    index.take_dump_requests()
    index.dump_failed("w1", no_responders=True)
    index.predict("w1", HASHES)
    index.apply_batch(batch("w1", 5, ev("stored", HASHES[:2])))
    assert not index.is_approximate("w1") and not index.is_synced("w1")
    assert index.take_dump_requests() == ["w1"]
    index.apply_dump(dump("w1", 5, ev("stored", HASHES[:2])))
    assert device(index, "w1") == 2


def test_a_worker_that_publishes_but_serves_no_dump_is_followed_as_it_comes():
    index, _ = make_index()
    index.apply_batch(batch("w1", 3, ev("stored", HASHES[:2])))
    index.worker_joined("w1", "h1")
    assert index.take_dump_requests() == ["w1"]
    index.dump_failed("w1", no_responders=True)
    assert not index.is_approximate("w1") and device(index, "w1") == 2  # the held batch, applied
    index.apply_batch(batch("w1", 5, ev("stored", HASHES[2:4])))  # a gap: counted, applied, no dump
    assert device(index, "w1") == 4 and index.stats()["gaps"] == 1 and index.take_dump_requests() == []


def test_one_walk_for_many_workers_matches_each_workers_own_lookup():
    index, _ = make_index()
    joined(index, "a", "b", "c")
    joined(index, "d", host="h2")
    index.apply_batch(batch("a", 1, ev("stored", HASHES[:7])))
    index.apply_batch(batch("b", 1, ev("stored", HASHES[:2])))
    index.apply_batch(batch("store", 1, ev("stored", HASHES[:4], "host"), ev("stored", HASHES[4:10], "disk")))
    index.worker_joined("e", "h1")
    index.take_dump_requests()
    index.dump_failed("e", no_responders=True)
    index.predict("e", HASHES[:3])
    workers = [("a", "h1"), ("b", "h1"), ("c", "h1"), ("d", "h2"), ("e", "h1"), ("nobody", "h3")]
    assert index.match_all(workers, HASHES) == [
        Match(7, 0, 3), Match(2, 2, 6), Match(0, 4, 6), Match(), Match(3), Match()]
    assert index.match_all(workers, HASHES) == [index.match(w, h, HASHES) for w, h in workers]
