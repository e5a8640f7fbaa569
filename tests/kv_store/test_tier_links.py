"""Tier links: one protocol, chosen by name from the worker's configuration.

The tier client never asks which kind of link it has; a link that cannot answer without a
round trip answers nothing now, and the worker's prefetch (``lookup_async``) fills the mirror.
"""

from __future__ import annotations

import asyncio

import pytest

from services.kv_store.config import KVStoreConfig
from services.kv_store.links import TIER_LINKS, BusLink, LocalLink, TierLink, open_tier_link
from services.kv_store.remote import RemoteLink
from services.kv_store.store import StoreCore
from services.workers import WorkerConfig


def test_a_worker_gets_the_bus_link_on_its_host_and_the_remote_link_for_another():
    loop = asyncio.new_event_loop()
    try:
        own = open_tier_link(WorkerConfig(hicache=True), "host-a", loop)
        named = open_tier_link(WorkerConfig(hicache=True, hicache_store_host="host-a"), "host-a", loop)
        other = open_tier_link(WorkerConfig(hicache=True, hicache_store_host="host-b", hicache_staging_ratio=0.5,
                                            transfer_timeout=7.0), "host-a", loop)
    finally:
        loop.close()
    assert type(own) is BusLink and type(named) is BusLink and own.host_id == "host-a"
    assert type(other) is RemoteLink and other.store_host == "host-b" and other.host_id == "host-a"
    assert (other.staging_ratio, other.transfer_timeout) == (0.5, 7.0)
    assert [link.moves_bytes for link in (own, other)] == [False, True]
    assert TIER_LINKS.names() == ["bus", "local", "remote"]
    assert all(issubclass(TIER_LINKS.get(name), TierLink) for name in TIER_LINKS)
    with pytest.raises(ValueError, match="not an engine worker's link"):
        LocalLink.for_worker(WorkerConfig(), "host-a", None)


def test_only_a_link_that_needs_no_round_trip_answers_now():
    core = StoreCore(KVStoreConfig(hicache_size=0.01, memory_reserve=0.0, hicache_prefault=False))
    try:
        local = LocalLink(core)
        name, layout = local.attach_now(owner="e", layout_key="L", page_bytes=4096, page_size=16, pool_bytes=1 << 20)
        assert name == core.arena.name and layout.num_slots == core.arena.layout.num_slots
        assert local.lookup_now([1, 2]) == (name, [], [])
        bus = BusLink(None, "host-a", None)  # answers nothing now, without touching its (absent) bus
        assert bus.attach_now(owner="e", layout_key="L", page_bytes=4096, page_size=16, pool_bytes=1 << 20) is None
        assert bus.lookup_now([1, 2]) == ("", [], []) and bus.find_first_now([1]) == ("", None)
    finally:
        core.close()
