"""The kv_store's parts without an engine: arena seqlock, L2 index and LRU, L3 files, policies."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.config import ConfigError
from services.kv_store.arena import Arena, ArenaLayout
from services.kv_store.config import KVStoreConfig
from services.kv_store.disk import DiskTier
from services.kv_store.index import SlotIndex
from services.kv_store.policies import admit_to_l3, make_write_policy
from services.kv_store.store import StoreCore

PB, PS = 256, 4


def page(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, PB, dtype=np.uint8)


@pytest.fixture
def arena():
    a = Arena.create(ArenaLayout(4, PB, PS), tag="test")
    yield a
    a.close()


def test_arena_round_trip_and_verification(arena):
    other = Arena.attach(arena.name, arena.layout)  # a second mapping, as an engine has
    arena.write(1, 77, [1, 2, 3, 4], page(1))
    out = np.zeros(PB, np.uint8)
    assert other.read_into(1, 77, [1, 2, 3, 4], out) and np.array_equal(out, page(1))
    assert not other.read_into(1, 78, [1, 2, 3, 4], out)  # another hash
    assert not other.read_into(1, 77, [1, 2, 3, 5], out)  # a hash collision: the tokens differ
    arena.invalidate(1)
    assert other.slot_hash(1) is None and not other.read_into(1, 77, [1, 2, 3, 4], out)
    other.close()


def test_arena_reader_detects_a_write_in_progress(arena):
    arena.write(0, 5, [1] * PS, page(0))
    arena._words[0][0] += 1  # a writer started (odd version)
    assert not arena.read_into(0, 5, [1] * PS, np.zeros(PB, np.uint8))


def test_arena_segment_is_owner_only(arena):
    import os
    import stat

    mode = os.stat(f"/dev/shm/{arena.name}").st_mode
    assert stat.S_IMODE(mode) == 0o600


def shm_bytes(arena) -> int:
    """Memory the segment holds now (tmpfs allocates a page at its first touch)."""
    import os

    return os.stat(f"/dev/shm/{arena.name}").st_blocks * 512


def test_prefault_commits_the_arena_and_keeps_what_it_holds():
    a = Arena.create(ArenaLayout(40, 64 << 10, PS), tag="test")  # 2.5 MiB of slots
    try:
        a.write(3, 77, [1, 2, 3, 4], np.full(64 << 10, 7, np.uint8))
        assert shm_bytes(a) < a.layout.total_bytes // 4  # only what was touched
        assert a.prefault(chunk=1 << 20) == a.layout.total_bytes  # in several chunks
        assert shm_bytes(a) >= a.layout.total_bytes - 4096
        out = np.zeros(64 << 10, np.uint8)
        assert a.read_into(3, 77, [1, 2, 3, 4], out) and (out == 7).all()
        assert a.slot_hash(5) is None and not a.slot_data(5).any()  # an empty slot stays empty
        import threading

        stop = threading.Event()
        stop.set()
        assert a.prefault(stop) == 0
    finally:
        a.close()
    assert a.prefault() == 0  # closed: nothing to do, no error


def test_the_store_commits_l2_in_the_background_unless_told_not_to():
    core = StoreCore(KVStoreConfig(hicache_size=0.002, memory_reserve=0.0))
    core.attach("e", "k", PB, PS, PB)
    core.prefault_thread.join(60)
    assert not core.prefault_thread.is_alive()
    assert shm_bytes(core.arena) >= core.arena.layout.total_bytes - 4096
    core.close()
    lazy = StoreCore(KVStoreConfig(hicache_size=0.002, memory_reserve=0.0, hicache_prefault=False))
    lazy.attach("e", "k", PB, PS, PB)
    assert lazy.prefault_thread is None and shm_bytes(lazy.arena) < lazy.arena.layout.total_bytes // 4
    lazy.close()


def test_index_lru_and_accounting():
    idx = SlotIndex(3)
    for slot, h in zip((idx.take_free(), idx.take_free(), idx.take_free()), (10, 11, 12)):
        idx.lease("e", slot)
        assert idx.commit("e", slot, h, 0)
    idx.check()
    idx.touch(10)
    assert idx.pop_lru()[0] == 11  # 10 was used since
    s = idx.take_free()
    assert s is None
    idx.lease("e", 1)
    assert not idx.commit("e", 1, 12, 0)  # a duplicate: the slot goes back to the free list
    assert not idx.commit("x", 2, 99, 0)  # not leased by x
    idx.check()


def test_index_random_operations_never_lose_a_slot():
    rng = random.Random(0)
    idx = SlotIndex(16)
    for _ in range(2000):
        op = rng.random()
        owner = rng.choice("ab")
        if op < 0.4:
            s = idx.take_free()
            if s is None:
                popped = idx.pop_lru()
                s = popped[1].slot if popped else None
            if s is not None:
                idx.lease(owner, s)
        elif op < 0.7 and idx.leases.get(owner):
            s = next(iter(idx.leases[owner]))
            idx.commit(owner, s, rng.randrange(50), 0)
        elif op < 0.8:
            idx.release(owner, list(idx.leases.get(owner, ())))
        elif op < 0.85:
            idx.release_owner(owner)
        else:
            idx.touch(rng.randrange(50))
        idx.check()


def test_policies():
    wb, wt, sel = (make_write_policy(n, 2) for n in ("write_back", "write_through", "write_through_selective"))
    assert (wb.on_stored(1), wb.on_evict(1)) == (False, True)
    assert wt.on_stored(1)
    assert [sel.on_hit(1), sel.on_hit(1), sel.on_hit(1)] == [False, True, False]
    with pytest.raises(ValueError):
        make_write_policy("nope")
    assert admit_to_l3(2, 2) and not admit_to_l3(1, 2) and admit_to_l3(0, 0)


def test_disk_round_trip_reindex_and_corruption(tmp_path):
    disk = DiskTier(tmp_path, "k", PB, max_pages=3)
    disk.write(1, 0, [1, 2, 3, 4], page(1))
    disk.write(2, 1, [5, 6, 7, 8], page(2))
    again = DiskTier(tmp_path, "k", PB, max_pages=3)  # a restart
    parent, tokens, data = again.read(2)
    assert (parent, tokens) == (1, [5, 6, 7, 8]) and np.array_equal(np.frombuffer(data, np.uint8), page(2))
    path = again.dir / f"{1:016x}.kvp"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert again.read(1) is None and again.num_corrupted == 1 and not path.exists() and 1 not in again
    for h in range(10, 14):  # LRU bound
        again.write(h, 0, [h] * PS, page(h))
    assert len(again) == 3 and len(list(again.dir.glob("*.kvp"))) == 3


def test_store_spills_to_disk_and_promotes_back(tmp_path):
    core = StoreCore(KVStoreConfig(hicache_size=3 * PB / 1024**3, memory_reserve=0.0,
                                   hicache_storage_dir=str(tmp_path), hicache_l3_admit_hits=0))
    arena = core.attach("e", "k", PB, PS, PB)
    assert arena.layout.num_slots == 3
    for h in range(1, 6):  # 5 pages through 3 slots: 2 spill to L3
        (slot,) = core.lease("e", 1)
        arena.write(slot, h, [h] * PS, page(h))
        assert core.commit("e", [(slot, h, h - 1)]) == [h]
    assert core.counters["spilled_disk"] == 2 and 1 in core.disk
    found = core.lookup([1, 2, 3])  # 1 and 2 come back from disk
    assert [h for h, _ in found] == [1, 2, 3]
    out = np.zeros(PB, np.uint8)
    assert arena.read_into(found[0][1], 1, [1] * PS, out) and np.array_equal(out, page(1))
    core.index.check()
    core.close()
    restarted = StoreCore(KVStoreConfig(hicache_size=3 * PB / 1024**3, memory_reserve=0.0,
                                        hicache_storage_dir=str(tmp_path)))
    restarted.attach("e", "k", PB, PS, PB)
    assert len(restarted.disk) >= 2 and [h for h, _ in restarted.lookup([1])] == [1]  # survives a restart
    restarted.close()


def test_store_refuses_more_than_memory_allows():
    with pytest.raises(ConfigError, match="does not fit"):
        StoreCore(KVStoreConfig(hicache_size=1e6))


def test_store_refuses_a_second_layout():
    core = StoreCore(KVStoreConfig(hicache_size=0.001, memory_reserve=0.0))
    core.attach("e1", "model-a", PB, PS, PB)
    from bus.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="layout"):
        core.attach("e2", "model-b", PB, PS, PB)
    core.close()


def test_a_larger_engine_than_the_one_that_sized_l2_is_warned_about(caplog):
    core = StoreCore(KVStoreConfig(hicache_ratio=2.0, memory_reserve=0.0))
    core.attach("small", "model-a", PB, PS, 4 * PB)
    assert core.arena.layout.num_slots == 8
    with caplog.at_level("WARNING", logger="services.kv_store.store"):
        core.attach("same", "model-a", PB, PS, 4 * PB)
        assert not caplog.records
        core.attach("large", "model-a", PB, PS, 16 * PB)
    [record] = caplog.records
    assert "large" in record.getMessage() and "--hicache-size" in record.getMessage()
    core.close()


def test_l2_holds_ratio_pools_for_every_engine_that_will_share_it():
    core = StoreCore(KVStoreConfig(hicache_ratio=2.0, hicache_engines=3, memory_reserve=0.0))
    core.attach("decode-0", "model-a", PB, PS, 4 * PB)
    assert core.arena.layout.num_slots == 2 * 4 * 3
    core.close()
    with pytest.raises(ConfigError, match="hicache_engines must be >= 1"):
        KVStoreConfig(hicache_engines=0)


def test_a_ratio_size_past_half_the_free_memory_is_capped_with_a_warning(monkeypatch, caplog):
    import services.kv_store.store as store

    big = 64 * 1024  # pages of 64 KiB: the slots' headers (a 4 KiB block here) are small beside them
    monkeypatch.setattr(store, "available_memory_bytes", lambda: 2 * (10 * big + 4096))  # half: 10 slots
    core = StoreCore(KVStoreConfig(hicache_ratio=2.0, hicache_engines=4, memory_reserve=0.0))
    with caplog.at_level("WARNING", logger="services.kv_store.store"):
        core.attach("worker-0", "model-a", big, PS, 4 * big)  # 2 x 4 pages x 4 engines = 32 pages wanted
    assert core.arena.layout.num_slots == 10
    [record] = caplog.records
    assert "2 x 4 engines" in record.getMessage() and "--hicache-size" in record.getMessage()
    core.close()
    # an explicit size is not capped: refused when it does not fit, as before
    with pytest.raises(ConfigError, match="does not fit"):
        StoreCore(KVStoreConfig(hicache_size=32 * big / 1024**3, memory_reserve=0.0))


def test_an_engine_leases_a_few_slots_at_attach_then_up_to_the_stores_cap():
    from services.kv_store.leases import FIRST_LEASES, Attachment
    from services.kv_store.links import LocalLink

    class CountingLink(LocalLink):
        def lease(self, owner, arena_name, n, done):
            asked.append(n)
            super().lease(owner, arena_name, n, done)

    # 1024 slots, at most 1/8 of them leased to one engine at a time (leased, or taken and not committed)
    core = StoreCore(KVStoreConfig(hicache_size=1024 * PB / 1024**3, memory_reserve=0.0, lease_share=1 / 8))
    arena = core.attach("e1", "model-a", PB, PS, 64 * PB)
    asked: list[int] = []
    leases = Attachment(CountingLink(core), "e1", lease_batch=256, prefault=False)
    leases.use(arena.name, arena.layout)
    assert asked == [FIRST_LEASES] and leases.num_leased == FIRST_LEASES  # an engine that never evicts
    taken = [leases.take()]  # below half of lease_batch: asks the rest; the store's cap gives 96 more
    assert asked[-1] == 256 - FIRST_LEASES and leases.num_leased == 128 - 1 and leases.may_hold == 128
    taken += [leases.take() for _ in range(63)]  # down to 64, half of what it may hold: nothing asked
    assert len(asked) == 2 and leases.num_leased == 64

    # the copies land: a committed slot is no longer leased (one whose bytes are not the page's, as
    # here, is released; one written is stored)
    core.commit("e1", [(slot, 10_000 + slot, 0) for slot in taken])
    taken = [leases.take(), leases.take()]  # 63 < 64: asks again, and the cap has room for 64
    assert asked[-1] == 256 - 63 and leases.num_leased == 126 and leases.may_hold == 127
    assert None not in taken and core.index.num_leased == leases.num_leased + len(taken) == 128
    core.close()


def test_kv_event_subjects_are_public_with_schemas_and_stable_bytes(tmp_path):
    import json

    from bus.codec import Encoding, decode, encode
    from schemas.export import export_schemas
    from schemas.kv_store import KVEvent, KVEventBatchEvent

    names = {p.name for p in export_schemas(tmp_path)}
    assert {"kvbus.v1.kv_events.worker_id.json", "kvbus.v1.kv_events.worker_id.dump.json"} <= names
    schema = json.loads((tmp_path / "kvbus.v1.kv_events.worker_id.json").read_text())
    assert "KVEvent" in schema["$defs"]
    batch = KVEventBatchEvent(worker_id="w", host_id="h", event_id=3,
                              events=[KVEvent(kind="stored", tier="host", page_hashes=[5], parent_hashes=[4])])
    golden = (b'{"worker_id":"w","host_id":"h","event_id":3,"events":[{"kind":"stored","tier":"host",'
              b'"page_hashes":[5],"parent_hashes":[4]}]}')
    assert encode(batch, Encoding.JSON) == golden and decode(golden, KVEventBatchEvent, Encoding.JSON) == batch


def test_event_publisher_batches_runs_with_monotonic_ids():
    from services.kv_store.events import KVEventPublisher

    pub = KVEventPublisher("w", "h", max_pending=3)
    pub.record("stored", "device", [1], [0])
    pub.record("stored", "device", [2], [1])
    pub.record("removed", "device", [1], [0])
    pub.record("stored", "device", [9], [8])  # past max_pending: dropped, so consumers will see a gap later
    first = pub.take()
    assert first.event_id == 1 and [(e.kind, e.page_hashes) for e in first.events] == [("stored", [1, 2]),
                                                                                      ("removed", [1])]
    assert pub.num_dropped == 1 and pub.take() is None
    pub.record("stored", "host", [3], [2])
    assert pub.take().event_id == 2
