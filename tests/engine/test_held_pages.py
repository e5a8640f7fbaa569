"""Waiting sequences hold their cached prefixes (services/engine/held_pages.py): the pool evicts every
page nobody waits for first, then the held pages of the sequence that runs last, tail first."""

from schemas.engine import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from tests.engine.test_block_manager import check_invariants, run_prefill

PS = 4


def conversation(c: int, num_tokens: int) -> list[int]:
    return [c * 1000 + i for i in range(num_tokens)]


def make_seq(tokens, rid="r", max_tokens=4):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_model_len=10_000)


def cached_conversations(bm, num_conversations, num_tokens):
    """Each conversation computed and released: its pages cached, the first released oldest."""
    pages = []
    for c in range(num_conversations):
        s = make_seq(conversation(c, num_tokens), f"c{c}")
        run_prefill(bm, s)
        pages.append(list(s.page_ids[: num_tokens // PS]))
        bm.free(s)
    return pages


def next_turn(c, num_tokens, extra=4):
    return make_seq(conversation(c, num_tokens) + [9000 + c] * extra, f"next{c}")


def test_waiting_prefixes_outlast_pages_nobody_waits_for_the_last_in_line_going_first():
    bm = BlockManager(16, PS)
    cached_conversations(bm, 4, 12)  # 4 x 3 pages cached, c0 the least recently used
    waiting = [next_turn(c, 12) for c in (0, 1, 2)]  # c3 has no next turn yet
    for s in waiting:
        bm.hold(s)
    assert bm.num_held_pages == 9 and bm.num_free_pages == 16  # held pages are still free
    check_invariants(bm)
    big = make_seq(range(5000, 5000 + 4 * PS * 2), "big")  # 8 pages: 4 free, c3's 3, then c2's tail
    run_prefill(bm, big)
    check_invariants(bm)
    for c in (0, 1):
        assert bm.num_matched_pages(waiting[c]) == 3, f"c{c}'s prefix was evicted"
    assert bm.num_matched_pages(waiting[2]) == 2  # the last in line lost its last page only
    assert bm.num_matched_pages(next_turn(3, 12)) == 0  # nobody waited for c3
    assert bm.holds.num_evicted == 1


def test_without_holds_the_pool_evicts_the_prefix_of_the_request_about_to_run():
    bm = BlockManager(16, PS, hold_waiting=False)
    cached_conversations(bm, 4, 12)
    waiting = [next_turn(c, 12) for c in (0, 1, 2)]
    for s in waiting:
        bm.hold(s)
    assert bm.num_held_pages == 0
    run_prefill(bm, make_seq(range(5000, 5000 + 4 * PS * 2), "big"))
    assert bm.num_matched_pages(waiting[0]) == 0  # LRU: the first in line lost everything


def test_admission_ends_the_hold_and_takes_the_held_pages():
    bm = BlockManager(16, PS)
    pages = cached_conversations(bm, 2, 12)
    s = next_turn(0, 12)
    bm.hold(s)
    assert set(bm.holds.held) == set(pages[0])
    assert bm.allocate(s) == 12
    assert s.page_ids[:3] == pages[0] and s.held_pages == [] and bm.num_held_pages == 0
    assert all(bm.pages[p].hold_count == 0 for p in pages[0])
    bm.free(s)  # released: plain cached pages again, the most recently used
    assert list(bm.cached_page_ids)[-3:] == pages[0][::-1]  # released tail first
    check_invariants(bm)


def test_a_shared_page_stays_held_while_any_waiting_sequence_holds_it():
    bm = BlockManager(16, PS)
    [shared] = cached_conversations(bm, 1, 8)  # a 2-page system prompt
    a = make_seq(conversation(0, 8) + [1, 2, 3, 4, 5], "a")
    b = make_seq(conversation(0, 8) + [6, 7, 8, 9, 10], "b")
    bm.hold(a)
    bm.hold(b)
    assert [bm.pages[p].hold_count for p in shared] == [2, 2]
    bm.release_held(a)
    assert set(bm.holds.held) == set(shared) and [bm.pages[p].hold_count for p in shared] == [1, 1]
    bm.release_held(b)
    assert bm.num_held_pages == 0 and set(bm.cached_page_ids) == set(shared)
    check_invariants(bm)


def test_a_page_owned_while_held_is_held_again_when_its_owner_lets_go():
    bm = BlockManager(16, PS)
    [pages] = cached_conversations(bm, 1, 12)
    waiter = next_turn(0, 12)
    bm.hold(waiter)
    runner = make_seq(conversation(0, 12) + [77], "runner")
    assert bm.allocate(runner) == 12  # another request takes the held pages meanwhile
    assert bm.num_held_pages == 0 and all(bm.pages[p].hold_count == 1 for p in pages)
    bm.free(runner)
    assert set(bm.holds.held) == set(pages)  # back with the waiter's hold, not in the LRU list
    check_invariants(bm)


def test_a_preempted_sequence_holds_ahead_of_every_waiting_one():
    bm = BlockManager(16, PS)
    cached_conversations(bm, 3, 8)
    late = [next_turn(c, 8) for c in (0, 1)]
    for s in late:
        bm.hold(s)
    preempted = next_turn(2, 8)
    bm.hold(preempted, first=True)
    order = list(bm.holds.eviction_order())
    assert order[-2:] == bm.matched_page_ids(preempted)[::-1]  # evicted last, its head last of all
    check_invariants(bm)


def test_a_held_page_evicted_all_the_same_is_not_released_twice():
    bm = BlockManager(6, PS)
    cached_conversations(bm, 1, 12)  # 3 pages cached
    s = next_turn(0, 12)
    bm.hold(s)
    run_prefill(bm, make_seq(range(5000, 5000 + 6 * PS), "big"))  # takes every page, held ones too
    assert bm.num_held_pages == 0 and bm.holds.num_evicted == 3
    bm.release_held(s)  # nothing left to release: no counts go negative
    assert all(p.hold_count == 0 for p in bm.pages)
    check_invariants(bm)


def test_holding_never_blocks_admission():
    bm = BlockManager(8, PS)
    cached_conversations(bm, 2, 16)  # every page cached
    for c in (0, 1):
        bm.hold(next_turn(c, 16))
    assert bm.num_held_pages == 8
    other = make_seq(range(5000, 5000 + 8 * PS - 1), "other")
    assert bm.can_allocate(other)
    run_prefill(bm, other)
    check_invariants(bm)


# --- the scheduler: a queue longer than the pool holds ------------------------------------------------

def replay(hold_waiting: bool, *, num_conversations=6, num_turns=5, num_pages=40) -> tuple[int, int]:
    """Conversations that resend their history with a new tail each turn, more than the pool holds,
    each next turn queued as soon as the last one ends (an agent loop); (cached, prompt) tokens at
    admission over turns >= 2."""
    bm = BlockManager(num_pages, PS, hold_waiting=hold_waiting)
    sched = Scheduler(bm, max_running_requests=2, max_prefill_tokens=16, chunked_prefill_size=16)
    histories = {c: conversation(c, 24) for c in range(num_conversations)}
    turns = {c: 0 for c in range(num_conversations)}
    for c in range(num_conversations):
        sched.add(make_seq(histories[c], f"{c}-0", max_tokens=2))
    cached = prompt = 0
    for _ in range(10_000):
        if not sched.num_unfinished:
            break
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            bm.index_computed_pages(s)
            if s.num_computed_tokens < s.num_tokens:
                continue
            s.token_ids.append(7000 + s.num_output_tokens)
            if s.num_output_tokens < s.max_output_tokens:
                continue
            c = int(s.request_id.split("-")[0])
            if turns[c]:
                cached, prompt = cached + s.num_cached_tokens, prompt + s.num_prompt_tokens
            sched.remove(s)
            check_invariants(bm)
            turns[c] += 1
            if turns[c] < num_turns:
                histories[c] = list(s.token_ids) + [8000 + c * 10 + turns[c]] * 6
                sched.add(make_seq(histories[c], f"{c}-{turns[c]}", max_tokens=2))
    assert not sched.num_unfinished and all(t == num_turns for t in turns.values())
    return cached, prompt


def test_a_queue_longer_than_the_pool_keeps_the_prefixes_of_the_requests_that_run_next():
    held, prompt = replay(True)
    lru, prompt_lru = replay(False)
    assert prompt == prompt_lru
    # 6 conversations of up to 16 pages in 40: the ideal (each turn's new tail only) is 81.8%. LRU loses
    # each prefix just before its turn (the cyclic pattern it is worst at): 8.0%; held: 42.0%
    assert lru / prompt < 0.1
    assert held / prompt > 0.35
