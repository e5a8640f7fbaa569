import random

import pytest
import torch

from schemas.engine import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.page_hash import hash_tail, page_hashes
from services.engine.sequence import Sequence
from services.engine.tier_hooks import CacheTierHooks

PS = 4


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(), max_model_len=10_000)


def run_prefill(bm, seq):
    """Admit ``seq`` and pretend the model computed all its tokens."""
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.index_computed_pages(seq)


def check_invariants(bm):
    refs = sum(1 for p in bm.pages if p.ref_count > 0)
    held = bm.holds.held
    assert refs + len(bm.free_page_ids) + len(bm.cached_page_ids) + len(held) == bm.num_pages
    assert not set(held) & set(bm.cached_page_ids)
    for h, pid in bm.hash_to_page_id.items():
        assert bm.pages[pid].page_hash == h
    for pid in bm.cached_page_ids:
        assert bm.pages[pid].ref_count == 0 and bm.pages[pid].page_hash is not None
        assert bm.pages[pid].hold_count == 0
    for pid in held:  # held: unowned, indexed, and some waiting sequence holds it
        assert bm.pages[pid].ref_count == 0 and bm.pages[pid].page_hash is not None
        assert bm.pages[pid].hold_count > 0
    for pid in bm.free_page_ids:
        assert bm.pages[pid].ref_count == 0 and bm.pages[pid].page_hash is None and bm.pages[pid].hold_count == 0
    if bm.reuse_tails:  # every indexed page, and only those, is a partial-match source under its start
        sources = {pid: key for key, d in bm.row_sources.items() for pid in d}
        assert sources == {pid: (bm.pages[pid].parent_hash, bm.pages[pid].token_ids[0])
                           for pid in bm.hash_to_page_id.values()}


def test_allocate_and_free_return_every_page():
    bm = BlockManager(8, PS)
    seq = make_seq(range(10))
    assert bm.allocate(seq) == 0
    assert len(seq.page_ids) == 3 and bm.num_free_pages == 5
    bm.free(seq)
    assert bm.num_free_pages == 8 and seq.page_ids == [] and seq.num_computed_tokens == 0
    check_invariants(bm)


def test_prefix_reuse_shares_pages_and_counts_refs():
    bm = BlockManager(16, PS)
    a = make_seq(range(10), "a")
    run_prefill(bm, a)
    assert len(bm.hash_to_page_id) == 2  # two full pages, the partial one is not indexed
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    assert bm.allocate(b) == 8
    assert b.page_ids[:2] == a.page_ids[:2] and b.page_ids[2] != a.page_ids[2]
    assert [bm.pages[p].ref_count for p in a.page_ids[:2]] == [2, 2]
    bm.free(a)
    assert [bm.pages[p].ref_count for p in b.page_ids[:2]] == [1, 1]
    assert bm.num_cached_pages == 0  # still owned by b
    bm.free(b)
    assert bm.num_cached_pages == 2 and bm.num_free_pages == 16
    check_invariants(bm)


def test_cached_pages_survive_release_and_are_revived():
    bm = BlockManager(16, PS)
    a = make_seq(range(12), "a")
    run_prefill(bm, a)
    pages = list(a.page_ids)
    bm.free(a)
    assert bm.num_cached_pages == 3
    b = make_seq(list(range(12)) + [5], "b")
    assert bm.allocate(b) == 12
    assert b.page_ids[:3] == pages and bm.num_cached_pages == 0
    check_invariants(bm)


def test_last_token_is_always_recomputed():
    bm = BlockManager(16, PS)
    run_prefill(bm, make_seq(range(8), "a"))
    same = make_seq(range(8), "b")
    # Both pages are cached, but the last token's logits are needed.
    assert bm.allocate(same) == 4
    check_invariants(bm)


def test_hashes_follow_page_hash_module():
    bm = BlockManager(16, PS, salt="tenant")
    a = make_seq(range(9))
    run_prefill(bm, a)
    assert a.page_hashes == page_hashes(list(range(9)), PS, salt="tenant")
    assert set(bm.hash_to_page_id) == set(a.page_hashes)


def test_salt_isolates_caches():
    bm1 = BlockManager(16, PS, salt="x")
    run_prefill(bm1, make_seq(range(9)))
    other = BlockManager(16, PS, salt="y")
    assert set(bm1.hash_to_page_id).isdisjoint(page_hashes(list(range(9)), PS, salt="y"))
    assert other.allocate(make_seq(range(9))) == 0


def test_lru_evicts_unreferenced_tail_first():
    evicted = []

    class Hooks(CacheTierHooks):
        def on_removed(self, h, p, *, clean):
            evicted.append((h, p))

        def load_back(self, hashes, tokens, page_ids):
            raise AssertionError("not called")

    bm = BlockManager(6, PS, hooks=Hooks())
    a = make_seq(range(12), "a")  # 3 full pages
    run_prefill(bm, a)
    a_pages, a_hashes = list(a.page_ids), list(a.page_hashes)
    bm.free(a)
    b = make_seq(range(100, 112), "b")
    run_prefill(bm, b)
    bm.free(b)
    assert bm.num_cached_pages == 6 and len(bm.free_page_ids) == 0
    # Needs 2 pages: a's are the least recently released; its tail goes first.
    c = make_seq(range(200, 208), "c")
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert evicted == [(a_hashes[2], a_pages[2]), (a_hashes[1], a_pages[1])]
    assert a_hashes[2] not in bm.hash_to_page_id and a_hashes[0] in bm.hash_to_page_id
    assert bm.num_evictions == 2
    # a's first page is still a hit.
    d = make_seq(list(range(4)) + [1, 2], "d")
    assert bm.allocate(d) == 4
    check_invariants(bm)


def test_can_allocate_counts_revived_pages_as_used():
    bm = BlockManager(4, PS)
    a = make_seq(range(12), "a")
    run_prefill(bm, a)
    bm.free(a)  # 3 cached + 1 free
    # 16 tokens = 4 pages: 3 revived from cache + 1 new: fits exactly.
    b = make_seq(list(range(12)) + [1, 2, 3, 4], "b")
    assert bm.can_allocate(b)
    assert not bm.can_allocate(b, reserve=1)
    # A different 16-token prompt needs 4 new pages: it may evict all 3.
    c = make_seq(range(50, 66), "c")
    assert bm.can_allocate(c)
    bm.allocate(b)
    assert not bm.can_allocate(c)
    check_invariants(bm)


def test_concurrent_duplicate_is_not_indexed_twice():
    bm = BlockManager(16, PS)
    a, b = make_seq(range(9), "a"), make_seq(range(9), "b")
    bm.allocate(a)
    bm.allocate(b)  # a is not computed yet: no hit
    assert set(a.page_ids).isdisjoint(b.page_ids)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.index_computed_pages(s)
    assert len(bm.hash_to_page_id) == 2
    assert all(bm.hash_to_page_id[h] in a.page_ids for h in a.page_hashes)
    bm.free(b)
    assert len(bm.free_page_ids) == 16 - 3  # b's copies are plain free pages
    bm.free(a)
    assert bm.num_cached_pages == 2
    check_invariants(bm)


def test_grow_for_decode():
    bm = BlockManager(3, PS)
    s = make_seq(range(4))
    bm.allocate(s)
    assert len(s.page_ids) == 1
    s.token_ids.append(7)
    assert bm.num_pages_needed(s, 5) == 1 and bm.can_grow(s, 5)
    bm.grow(s, 5)
    assert len(s.page_ids) == 2
    bm.grow(s, 8)  # still fits in 2 pages
    assert len(s.page_ids) == 2
    assert not bm.can_grow(s, 13)
    check_invariants(bm)


def test_generated_tokens_are_indexed_when_their_page_fills():
    bm = BlockManager(8, PS)
    s = make_seq(range(6))
    run_prefill(bm, s)
    assert s.num_indexed_pages == 1
    s.token_ids += [1, 2]
    bm.grow(s, 8)
    s.num_computed_tokens = 8
    bm.index_computed_pages(s)
    assert s.num_indexed_pages == 2 and len(bm.hash_to_page_id) == 2


def test_collision_is_treated_as_miss():
    bm = BlockManager(8, PS)
    a = make_seq(range(9), "a")
    run_prefill(bm, a)
    bm.pages[a.page_ids[0]].token_ids = (9, 9, 9, 9)  # simulate a hash collision
    assert bm.allocate(make_seq(range(9), "b")) == 0


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(8, PS, enable_prefix_caching=False)
    run_prefill(bm, make_seq(range(9), "a"))
    assert bm.hash_to_page_id == {}
    assert bm.allocate(make_seq(range(9), "b")) == 0


class FakeTier(CacheTierHooks):
    def __init__(self, held, fail=False):
        self.held = list(held)
        self.fail = fail
        self.loaded = []
        self.stored = []

    is_tier = True

    def on_stored(self, h, parent, p):
        self.stored.append(h)
        return False

    def lookup(self, hashes):
        n = 0
        while n < len(hashes) and n < len(self.held) and hashes[n] == self.held[n]:
            n += 1
        return n

    def load_back(self, hashes, tokens, page_ids):
        if self.fail:
            raise OSError("tier down")
        self.loaded.append((list(hashes), list(page_ids)))
        return len(page_ids)


def test_lower_tier_hits_are_loaded_back_not_recomputed():
    tokens = list(range(14))
    held = page_hashes(tokens, PS)  # 3 full pages
    tier = FakeTier(held)
    bm = BlockManager(8, PS, hooks=tier)
    s = make_seq(tokens)
    assert bm.allocate(s) == 12
    assert tier.loaded == [(held, s.page_ids[:3])]
    assert set(held) <= set(bm.hash_to_page_id)
    check_invariants(bm)


def test_lower_tier_after_partial_device_hit():
    tokens = list(range(14))
    hashes = page_hashes(tokens, PS)
    bm = BlockManager(8, PS, hooks=FakeTier([]))
    run_prefill(bm, make_seq(tokens[:5], "warm"))  # device holds page 0
    bm.hooks = tier = FakeTier(hashes[1:])
    s = make_seq(tokens, "s")
    assert bm.allocate(s) == 12
    assert tier.loaded[0][0] == hashes[1:]


def test_lower_tier_failure_falls_back_to_recompute():
    tokens = list(range(14))
    bm = BlockManager(8, PS, hooks=FakeTier(page_hashes(tokens, PS), fail=True))
    s = make_seq(tokens)
    assert bm.allocate(s) == 0
    assert len(s.page_ids) == 4 and bm.num_free_pages == 4
    check_invariants(bm)


def test_double_free_is_caught():
    bm = BlockManager(4, PS)
    s = make_seq(range(3))
    bm.allocate(s)
    pid = s.page_ids[0]
    bm.free(s)
    with pytest.raises(AssertionError):
        bm.unref(pid)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ---- asynchronous load-back: the state machine (docs/hicache.md) ---------------------------


class AsyncTier(FakeTier):
    """A tier whose loads stay in flight until the test lands them (no threads, no timing)."""

    def __init__(self, held):
        super().__init__(held)
        self.started: dict[int, tuple[list[int], list[int]]] = {}
        self.landed: list[tuple[int, int]] = []

    def start_load(self, hashes, tokens, page_ids):
        ticket = len(self.started)
        self.started[ticket] = (list(hashes), list(page_ids))
        return ticket

    def land(self, ticket, n=None):
        self.landed.append((ticket, len(self.started[ticket][1]) if n is None else n))

    def poll_loaded(self):
        out, self.landed = self.landed, []
        return out

    wait_loaded = lambda self, timeout: self.poll_loaded()  # noqa: E731


def async_bm(tokens, num_pages=8, **kw):
    tier = AsyncTier(page_hashes(tokens, PS))
    bm = BlockManager(num_pages, PS, hooks=tier, **kw)
    bm.async_load_min_pages = 2
    return bm, tier


def with_load_in_flight(make=None, **kw):
    """A block manager (``async_bm`` or ``late_bm``) whose tier holds the 3 full pages of a
    14-token prompt, and that prompt's sequence admitted with its load in flight (ticket 0)."""
    tokens = list(range(14))
    bm, tier = (make or async_bm)(tokens, **kw)
    s = make_seq(tokens)
    bm.allocate(s, may_wait=True)
    return bm, tier, s, tokens


def test_async_load_holds_pages_until_it_lands_then_indexes_them():
    tokens = list(range(14))  # 3 cacheable pages + 1 partial
    bm, tier = async_bm(tokens)
    s = make_seq(tokens)
    assert bm.allocate(s, may_wait=True) == 0
    assert s.loading_ticket == 0 and len(s.page_ids) == 4 and bm.num_free_pages == 4
    assert tier.started[0] == (page_hashes(tokens, PS), s.page_ids[:3])
    assert bm.hash_to_page_id == {} and bm.poll_loads() == []  # nothing indexed before the copy lands
    tier.land(0)
    assert bm.poll_loads() == [s]
    assert s.loading_ticket is None and s.num_computed_tokens == 12 and s.num_loaded_tokens == 12
    assert set(bm.hash_to_page_id) == set(page_hashes(tokens, PS)) and bm.num_loaded_back == 3
    bm.free(s)
    assert bm.num_free_pages == 8
    check_invariants(bm)


def test_async_load_failing_partway_computes_from_the_first_failed_page():
    bm, tier, s, tokens = with_load_in_flight()
    pages = list(s.page_ids)
    tier.land(0, 1)  # page 1 failed verification: pages 1 and 2 are computed
    assert bm.poll_loads() == [s]
    assert s.num_computed_tokens == 4 and s.page_ids == pages and s.num_indexed_pages == 1
    assert list(bm.hash_to_page_id) == page_hashes(tokens, PS)[:1]
    s.num_computed_tokens = s.num_tokens  # the model computes the rest into the same pages
    bm.index_computed_pages(s)
    bm.free(s)
    assert bm.num_free_pages == 8
    check_invariants(bm)


def test_a_sequence_freed_while_loading_returns_its_pages_only_when_the_copy_lands():
    bm, tier, s, tokens = with_load_in_flight()
    held = list(s.page_ids)
    bm.free(s)  # aborted: the copy thread may still be writing into its pages
    assert s.page_ids == [] and s.loading_ticket is None
    assert bm.num_free_pages == 4 and all(bm.pages[p].ref_count == 1 for p in held)
    tier.land(0)
    assert bm.poll_loads() == []  # nobody runs it
    assert bm.num_free_pages == 8 and bm.hash_to_page_id == {} and bm.num_loading == 0
    check_invariants(bm)


def test_a_sequence_freed_after_its_copy_landed_but_before_the_poll():
    bm, tier, s, tokens = with_load_in_flight()
    tier.land(0)
    bm.wait_loads(0)  # landed (indexed), not yet handed back
    bm.free(s)
    assert bm.poll_loads() == []
    assert bm.num_free_pages == 8 and len(bm.cached_page_ids) == 3
    check_invariants(bm)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def late_bm(tokens, num_pages=8):
    bm, tier = async_bm(tokens, num_pages)
    bm.clock, bm.load_timeout = Clock(), 1.0
    return bm, tier


def test_a_late_load_is_given_up_its_pages_computed_and_freed_when_the_copy_lands():
    bm, tier, s, tokens = with_load_in_flight(late_bm)  # 3 pages from the tier, 1 partial
    loading, last = s.page_ids[:3], s.page_ids[3]
    bm.clock.now = 1.0
    assert bm.poll_loads() == [] and s.loading_ticket == 0  # not late yet
    bm.clock.now = 1.5
    assert bm.poll_loads() == [s]
    assert s.loading_ticket is None and s.num_computed_tokens == 0 and s.num_loaded_tokens == 0
    assert not set(s.page_ids[:3]) & set(loading) and s.page_ids[3] == last and bm.num_load_timeouts == 1
    assert all(bm.pages[p].ref_count == 1 for p in loading) and bm.num_free_pages == 1  # the copy may still write them
    assert bm.num_loading == 1 and bm.poll_loads() == []  # reported once
    tier.land(0)
    assert bm.poll_loads() == []
    assert bm.num_free_pages == 4 and bm.hash_to_page_id == {} and bm.num_loading == 0  # the late copy is not used
    s.num_computed_tokens = s.num_tokens  # the model computes every page
    bm.index_computed_pages(s)
    bm.free(s)
    assert bm.num_free_pages == 8 and len(bm.hash_to_page_id) == 3
    check_invariants(bm)


def test_a_late_load_after_an_l1_prefix_keeps_the_prefix():
    tokens = list(range(14))
    bm, tier = late_bm(tokens)
    run_prefill(bm, make_seq(tokens[:5], "warm"))  # L1 holds page 0
    tier.held = page_hashes(tokens, PS)[1:]  # the tier holds pages 1 and 2
    s = make_seq(tokens, "s")
    bm.allocate(s, may_wait=True)
    assert s.loading_ticket is not None and tier.started[0][1] == s.page_ids[1:3]
    prefix = s.page_ids[0]
    bm.clock.now = 2.0
    assert bm.poll_loads() == [s]
    assert s.page_ids[0] == prefix and s.num_computed_tokens == 4
    tier.land(0)
    bm.poll_loads()
    check_invariants(bm)


def test_a_late_load_waits_for_room_and_a_copy_that_lands_then_is_used():
    # the sequence holds the whole pool: no room for fresh pages
    bm, tier, s, tokens = with_load_in_flight(late_bm, num_pages=4)
    bm.clock.now = 5.0
    assert bm.poll_loads() == [] and s.loading_ticket == 0 and bm.num_load_timeouts == 0
    tier.land(0)
    assert bm.poll_loads() == [s] and s.num_computed_tokens == 12 and s.num_loaded_tokens == 12
    bm.free(s)
    assert bm.num_free_pages == 4
    check_invariants(bm)


def test_a_sequence_freed_after_its_load_was_given_up():
    bm, tier, s, tokens = with_load_in_flight(late_bm)
    bm.clock.now = 2.0
    assert bm.poll_loads() == [s]
    bm.free(s)  # aborted before it ran: its fresh pages go back now, the loading ones when the copy lands
    assert bm.num_free_pages == 5
    tier.land(0)
    bm.poll_loads()
    assert bm.num_free_pages == 8 and bm.num_loading == 0
    check_invariants(bm)


def test_random_loads_lands_give_ups_and_aborts_never_lose_a_page():
    """Seeded random admissions, landings (some short), clock jumps past the timeout, finishes and
    aborts in every state: the pages always add up, and all come back at the end."""
    rng = random.Random(7)
    bases = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    known = {h for b in bases for h in page_hashes(b, PS)}

    class Tier(AsyncTier):
        def lookup(self, hashes):
            n = 0
            while n < len(hashes) and hashes[n] in known:
                n += 1
            return n

    tier = Tier([])
    bm = BlockManager(24, PS, hooks=tier)
    bm.async_load_min_pages, bm.clock, bm.load_timeout = 1, Clock(), 1.0
    waiting, running, inflight = [], [], {}  # inflight: ticket -> its page count
    for i in range(600):
        op = rng.random()
        if op < 0.3:
            base = bases[rng.randrange(3)]
            own = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 6))]
            seq = make_seq(base[: rng.randrange(5, 25)] + own, f"r{i}")
            if bm.can_allocate(seq):
                bm.allocate(seq, may_wait=True)
                if seq.loading_ticket is not None:
                    waiting.append(seq)
                    inflight[seq.loading_ticket] = len(tier.started[seq.loading_ticket][1])
                else:
                    running.append(seq)
        elif op < 0.5 and inflight:
            ticket = rng.choice(sorted(inflight))
            tier.land(ticket, rng.randrange(inflight.pop(ticket) + 1))
        elif op < 0.65:
            bm.clock.now += rng.choice([0.0, 0.5, 2.0])
            for seq in bm.poll_loads():
                waiting.remove(seq)
                running.append(seq)
        elif op < 0.85 and running:
            seq = running.pop(rng.randrange(len(running)))
            seq.num_computed_tokens = seq.num_tokens  # the model computed the rest
            bm.index_computed_pages(seq)
            bm.free(seq)
        elif waiting or running:
            pool = waiting if waiting and (not running or rng.random() < 0.5) else running
            bm.free(pool.pop(rng.randrange(len(pool))))  # an abort
        check_invariants(bm)
        held = {p for s in waiting + running for p in s.page_ids}
        assert all(bm.pages[p].ref_count >= 1 for p in held)
    assert bm.num_load_timeouts > 0 and bm.num_loads_cancelled > 0 and bm.num_loaded_back > 0
    for ticket, count in inflight.items():
        tier.land(ticket, count)
    for seq in bm.poll_loads():
        waiting.remove(seq)
        running.append(seq)
    for seq in waiting + running:
        bm.free(seq)
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages
    check_invariants(bm)


def test_short_runs_and_may_wait_false_load_synchronously():
    tokens = list(range(14))
    bm, tier = async_bm(tokens)
    bm.async_load_min_pages = 4  # 3 hits: below the threshold
    s = make_seq(tokens)
    assert bm.allocate(s, may_wait=True) == 12 and s.loading_ticket is None and tier.started == {}
    bm.free(s)
    bm.evict_all_cached()
    bm.async_load_min_pages = 2
    t = make_seq(tokens, "t")
    assert bm.allocate(t) == 12 and tier.started == {}  # may_wait defaults to False
    check_invariants(bm)


# ---- tails: token-granular reuse of a finished sequence's partial last page -----------------


class FakePool:
    """A KV pool whose row ``r`` of page ``p`` holds the token written there (every layer, K and V)."""

    def __init__(self, num_pages):
        self.data = torch.full((num_pages, 2, 2, PS, 1, 3), -1.0)

    def write(self, seq, upto):
        for pos in range(upto):
            self.data[seq.page_ids[pos // PS], :, :, pos % PS] = float(seq.token_ids[pos])

    def rows(self, page_id, n):
        return [int(self.data[page_id, 0, 0, r, 0, 0]) for r in range(n)]

    def copy_rows(self, src, dst, n):  # as KVPool.copy_rows
        self.data[dst, :, :, :n] = self.data[src, :, :, :n]


def bound_bm(num_pages=16, hooks=None, **kw):
    pool = FakePool(num_pages)
    return BlockManager(num_pages, PS, hooks=hooks, copy_rows=pool.copy_rows, **kw), pool


def finish(bm, pool, seq, computed=None):
    """Admit ``seq``, compute all but its last token (a finished request's state), free it."""
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens - 1 if computed is None else computed
    pool.write(seq, seq.num_computed_tokens)
    bm.index_computed_pages(seq)
    bm.free(seq)


def test_the_next_turn_reuses_the_answer_to_its_last_token():
    bm, pool = bound_bm()
    turn1 = list(range(100, 111))  # 11 tokens: pages [0-3] [4-7], tail rows 8, 9 (token 10 never computed)
    finish(bm, pool, make_seq(turn1, "t1"))
    tail = hash_tail(page_hashes(turn1, PS)[1], turn1[8:10])
    assert tail in bm.hash_to_page_id and bm.num_cached_pages == 3
    turn2 = make_seq(turn1 + [200, 201, 202], "t2")
    assert bm.allocate(turn2) == 10  # computes from token 10 on
    assert pool.rows(turn2.page_ids[2], 2) == turn1[8:10]  # copied into a page of its own
    assert turn2.page_ids[2] != bm.hash_to_page_id[tail] and bm.num_tail_hits == 1
    bm.free(turn2)
    assert bm.num_free_pages == 16
    check_invariants(bm)


def test_a_tail_is_reused_as_far_as_the_tokens_agree_and_never_covers_the_last_one():
    bm, pool = bound_bm()
    finish(bm, pool, make_seq(range(11), "a"))  # tail: tokens 8, 9
    assert bm.allocate(make_seq(list(range(10)) + [77], "other")) == 10  # same 8, 9 then its own
    diverges = make_seq(list(range(8)) + [8, 55, 56], "diverges")
    assert bm.allocate(diverges) == 9 and pool.rows(diverges.page_ids[2], 1) == [8]  # the rows that agree
    assert bm.allocate(make_seq(range(10), "ends-in-it")) == 9  # token 9 is its last: computed
    assert bm.allocate(make_seq(list(range(8)) + [55, 9], "differs-at-once")) == 8
    assert bm.allocate(make_seq([7] + list(range(1, 11)), "other-parent")) == 0
    assert bm.num_tail_hits == 3
    check_invariants(bm)


def test_a_preempted_prefill_keeps_its_computed_rows():
    bm, pool = bound_bm()
    seq = make_seq(range(20), "s")
    finish(bm, pool, seq, computed=6)  # preempted after a 6-token chunk: page 0 and rows 4, 5
    again = make_seq(range(20), "s")
    assert bm.allocate(again) == 6
    assert pool.rows(again.page_ids[1], 2) == [4, 5]
    check_invariants(bm)


def test_tails_are_evicted_like_pages_and_off_without_prefix_caching():
    bm, pool = bound_bm(6)
    finish(bm, pool, make_seq(range(11), "a"))  # 2 pages + tail
    finish(bm, pool, make_seq(range(100, 111), "b"))  # 2 pages + tail
    assert bm.num_cached_pages == 6
    c = make_seq(range(200, 208), "c")
    bm.allocate(c)  # evicts a's tail first (released first), then a's last page
    assert bm.allocate(make_seq(list(range(10)) + [5], "a2")) == 4
    check_invariants(bm)
    for kw in (dict(enable_prefix_caching=False), dict(reuse_tails=False)):
        bm, pool = bound_bm(**kw)
        finish(bm, pool, make_seq(range(11), "a"))
        assert bm.allocate(make_seq(list(range(10)) + [5], "a2")) == (8 if kw.get("reuse_tails") is False else 0)
        assert bm.num_tail_hits == 0


class TailTier(CacheTierHooks):
    """A lower tier holding tails by hash: load_back writes the tail's tokens into the page."""

    is_tier = True

    def __init__(self, pool, tails):
        self.pool, self.tails, self.asked = pool, dict(tails), []

    def find_tail(self, hashes):
        self.asked.append(list(hashes))
        return next((i for i, h in enumerate(hashes) if h in self.tails), None)

    def load_back(self, hashes, tokens, page_ids):
        for h, toks, p in zip(hashes, tokens, page_ids):
            assert tuple(toks) == self.tails[h]
            for r, t in enumerate(toks):
                self.pool.data[p, :, :, r] = float(t)
        return len(page_ids)


def test_a_tail_evicted_from_l1_is_loaded_back_from_the_lower_tier():
    tokens = list(range(100, 111))
    hashes = page_hashes(tokens, PS)
    pool = FakePool(8)
    bm = BlockManager(8, PS, hooks=[], copy_rows=pool.copy_rows)
    tier = TailTier(pool, {hash_tail(hashes[1], tuple(tokens[8:10])): tuple(tokens[8:10])})
    bm.hooks = tier
    pool.data.fill_(-1)
    warm = make_seq(tokens[:8] + [1], "warm")  # L1 holds the two full pages, not the tail
    bm.allocate(warm)
    warm.num_computed_tokens = 8
    bm.index_computed_pages(warm)
    bm.free(warm)
    s = make_seq(tokens + [5, 6], "s")
    assert bm.allocate(s) == 10 and s.num_loaded_tokens == 2 and bm.num_tail_loads == 1
    assert pool.rows(s.page_ids[2], 2) == tokens[8:10]
    assert len(tier.asked[-1]) == 3 and tier.asked[-1][1] == hash_tail(hashes[1], tuple(tokens[8:10]))
    check_invariants(bm)


def test_an_async_load_takes_the_tail_when_it_lands():
    tokens = list(range(14))  # 3 full pages in the tier; then a tail of tokens 12, 13
    pool = FakePool(8)
    bm, tier = async_bm(tokens + [50, 51, 52], copy_rows=pool.copy_rows)
    tier.held = page_hashes(tokens, PS)
    tail_tokens = (12, 13)
    tier.find_tail = lambda hs: next((i for i, h in enumerate(hs) if h == hash_tail(tier.held[2], tail_tokens)), None)
    tier.load_back = lambda hs, toks, ps: len(ps)
    s = make_seq(tokens + [50, 51, 52])
    assert bm.allocate(s, may_wait=True) == 0 and s.loading_ticket == 0
    tier.land(0)
    assert bm.poll_loads() == [s]
    assert s.num_computed_tokens == 14 and s.num_loaded_tokens == 14 and bm.num_tail_loads == 1
    bm.free(s)
    check_invariants(bm)


def test_a_page_cut_short_keeps_the_rows_before_the_cut():
    bm, pool = bound_bm()
    first = list(range(100, 120))
    finish(bm, pool, make_seq(first, "a"))  # pages 0-3 full, tail rows 116-118
    # the next prompt keeps the answer only up to token 113 (a stop string cut it), then goes on
    cut = make_seq(first[:14] + [7, 7, 7], "b")
    assert bm.allocate(cut) == 14  # pages 0-2, then 2 rows of a's page 3
    assert pool.rows(cut.page_ids[3], 2) == [112, 113] and bm.num_tail_hits == 1
    check_invariants(bm)


def test_an_identical_prompt_computes_only_its_last_token():
    bm, pool = bound_bm()
    finish(bm, pool, make_seq(list(range(100, 108)) + [1, 2], "a"))  # 8 prompt tokens, 2 generated
    again = make_seq(range(100, 108), "b")
    assert bm.allocate(again) == 7  # page 0, then 3 rows of page 1: token 107 computes the logits
    assert pool.rows(again.page_ids[1], 3) == [104, 105, 106]
    check_invariants(bm)


class GarbageTier(TailTier):
    """Holds an exact tail but every load fails after writing garbage into the page."""

    def load_back(self, hashes, tokens, page_ids):
        for p in page_ids:
            self.pool.data[p] = -7.0
        return 0


@pytest.mark.parametrize("tier_cls", [TailTier, GarbageTier], ids=["longer-in-l2", "l2-load-fails"])
def test_a_longer_tail_in_the_lower_tier_beats_fewer_rows_in_l1(tier_cls):
    tokens = list(range(100, 112))  # pages [100-103] [104-107], then 108, 109, 110 ...
    pool = FakePool(16)
    bm = BlockManager(16, PS, hooks=[], copy_rows=pool.copy_rows)
    short = make_seq(tokens[:9] + [55, 56, 57], "short")  # leaves page 2 = 108, 55, 56 (+57 uncomputed)
    finish(bm, pool, short)
    parent = page_hashes(tokens, PS)[1]
    bm.hooks = tier_cls(pool, {hash_tail(parent, tuple(tokens[8:11])): tuple(tokens[8:11])})
    s = make_seq(tokens + [1], "s")
    got = bm.allocate(s)
    if tier_cls is TailTier:
        assert got == 11 and bm.num_tail_loads == 1 and pool.rows(s.page_ids[2], 3) == tokens[8:11]
    else:  # the failed load wrote into the page: L1's one row is copied after it, not before
        assert got == 9 and bm.num_tail_hits == 1 and pool.rows(s.page_ids[2], 1) == [108]
    check_invariants(bm)


def test_row_sources_follow_indexing_and_eviction():
    bm, pool = bound_bm(8)
    rng = random.Random(0)
    for i in range(40):
        n = rng.randrange(2, 14)
        seq = make_seq([rng.randrange(0, 3) for _ in range(n)], f"s{i}")  # few symbols: many shared starts
        if not bm.can_allocate(seq):
            continue
        finish(bm, pool, seq, computed=rng.randrange(0, n))
        check_invariants(bm)
