import random

from schemas.engine import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus

PS = 4


def make(num_pages=64, **kw):
    bm = BlockManager(num_pages, PS)
    opts = dict(max_running_requests=8, max_prefill_tokens=32, chunked_prefill_size=16)
    opts.update(kw)
    return bm, Scheduler(bm, **opts)


def seq(rid, prompt_len, max_tokens=4, base=0):
    return Sequence(
        rid, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens), max_model_len=1000
    )


def fake_step(sched, batch, finished):
    """What the engine does after a forward: progress, index, sample, finish."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert s.status is SequenceStatus.RUNNING
        assert s.num_computed_tokens + n <= s.num_tokens
        # pages cover every token computed this step
        assert len(s.page_ids) * PS >= s.num_computed_tokens + n
        s.num_computed_tokens += n
        sched.bm.index_computed_pages(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1000 + s.num_output_tokens)
            if s.num_output_tokens >= s.max_output_tokens:
                sched.remove(s)
                finished.append(s)
    for s in batch.out_of_pages:
        sched.remove(s)
        finished.append(s)


def run_all(sched, max_steps=1000):
    finished, batches = [], []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        batch = sched.schedule()
        batches.append((list(batch.seqs), list(batch.num_new_tokens), batch.num_decode, list(batch.preempted)))
        fake_step(sched, batch, finished)
    assert not sched.num_unfinished, "did not drain"
    return finished, batches


def test_decode_and_prefill_mix_and_requests_join_any_step():
    bm, sched = make()
    a = seq("a", 6)
    sched.add(a)
    b1 = sched.schedule()
    assert b1.seqs == [a] and b1.num_new_tokens == [6] and b1.num_decode == 0
    fake_step(sched, b1, [])
    b = seq("b", 10, base=50)
    sched.add(b)
    b2 = sched.schedule()
    assert b2.seqs == [a, b] and b2.num_new_tokens == [1, 10] and b2.num_decode == 1


def test_chunked_prefill_respects_chunk_and_budget():
    bm, sched = make(max_prefill_tokens=20, chunked_prefill_size=8)
    long, short = seq("long", 30), seq("short", 5, base=100)
    sched.add(long)
    sched.add(short)
    b1 = sched.schedule()
    assert b1.num_new_tokens == [8, 5]
    fake_step(sched, b1, [])
    b2 = sched.schedule()
    # short decodes, long continues with the next chunk
    assert [s.request_id for s in b2.seqs] == ["short", "long"] and b2.num_new_tokens == [1, 8]
    finished, _ = run_all(sched)
    assert {s.request_id for s in finished} == {"long", "short"}
    assert bm.num_free_pages == bm.num_pages


def test_budget_is_shared_across_requests():
    bm, sched = make(max_prefill_tokens=12, chunked_prefill_size=8)
    for i in range(3):
        sched.add(seq(f"r{i}", 8, base=100 * i))
    b = sched.schedule()
    assert b.num_new_tokens == [8, 4]  # third waits for budget


def test_max_running_requests():
    bm, sched = make(max_running_requests=2, max_prefill_tokens=100)
    for i in range(4):
        sched.add(seq(f"r{i}", 4, base=100 * i))
    b = sched.schedule()
    assert len(b.seqs) == 2 and len(sched.waiting) == 2
    finished, batches = run_all(sched)
    assert len(finished) == 4
    assert all(len(s) <= 2 for s, *_ in batches)


def test_no_chunking_runs_a_long_prompt_alone():
    bm, sched = make(max_prefill_tokens=10, chunked_prefill_size=0)
    sched.add(seq("short", 4))
    sched.add(seq("long", 30, base=50))
    b1 = sched.schedule()
    assert b1.num_new_tokens == [4]  # long would exceed the budget next to short
    fake_step(sched, b1, [])
    b2 = sched.schedule()
    assert [s.request_id for s in b2.seqs] == ["short", "long"] and b2.num_new_tokens == [1, 30]


def test_fcfs_head_of_line_blocks_admission():
    bm, sched = make(num_pages=6, max_prefill_tokens=100, chunked_prefill_size=100)
    sched.add(seq("big", 20))  # 5 pages
    sched.add(seq("big2", 20, base=30))  # would need 5 more
    sched.add(seq("tiny", 2, base=60))  # would fit, but must not overtake
    b = sched.schedule()
    assert [s.request_id for s in b.seqs] == ["big"]


def test_preemption_by_recompute_with_tiny_pool():
    # 10 pages of 4 tokens; 4 requests that each grow to 16 tokens (4 pages).
    bm, sched = make(num_pages=10, max_prefill_tokens=64, chunked_prefill_size=64)
    seqs = [seq(f"r{i}", 6, max_tokens=10, base=100 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    finished, batches = run_all(sched)
    assert sched.num_preemptions > 0
    assert sorted(s.request_id for s in finished) == [s.request_id for s in seqs]
    for s in finished:
        # every request produced exactly max_tokens tokens, in order, despite preemption
        assert s.output_token_ids == [1000 + i for i in range(10)]
        assert s.page_ids == []
    assert bm.num_free_pages == bm.num_pages
    # the newest admitted sequence is the first victim
    first_preempt = next(p for *_, p in batches if p)
    assert first_preempt[0].request_id == "r3"


def test_preempted_sequence_resumes_from_its_cached_pages():
    bm, sched = make(num_pages=9, max_prefill_tokens=64, chunked_prefill_size=64)
    a, b = seq("a", 12, max_tokens=12), seq("b", 12, max_tokens=12, base=100)
    sched.add(a)
    sched.add(b)
    seen_readmission = []
    finished = []
    while sched.num_unfinished:
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            if s.num_preemptions and s.num_computed_tokens > 0 and n < s.num_tokens:
                seen_readmission.append((s.request_id, s.num_computed_tokens))
        fake_step(sched, batch, finished)
    assert sched.num_preemptions > 0
    assert seen_readmission, "a preempted request should restart from cached full pages"
    assert len(finished) == 2


def test_single_sequence_that_outgrows_the_pool_is_reported():
    bm, sched = make(num_pages=2, max_prefill_tokens=64)
    s = seq("a", 6, max_tokens=100)
    sched.add(s)
    finished, _ = run_all(sched)
    assert finished == [s] and s.num_tokens == 9  # 8 tokens in 2 pages + the last one sampled
    assert bm.num_free_pages == 2


def test_mixed_batches_off_pauses_decode_during_prefill():
    bm, sched = make(enable_mixed_batches=False)
    sched.add(seq("a", 4))
    fake_step(sched, sched.schedule(), [])
    sched.add(seq("b", 4, base=10))
    b = sched.schedule()
    assert [s.request_id for s in b.seqs] == ["b"] and b.num_decode == 0
    fake_step(sched, b, [])
    b = sched.schedule()
    assert b.num_decode == 2


def test_abort_waiting_and_running_returns_pages():
    bm, sched = make()
    a, b = seq("a", 9), seq("b", 9, base=20)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule(), [])
    c = seq("c", 5, base=40)
    sched.add(c)
    sched.remove(c)  # waiting
    sched.remove(a)  # running
    assert a.status is SequenceStatus.FINISHED and c.status is SequenceStatus.FINISHED
    sched.remove(b)
    assert bm.num_free_pages == bm.num_pages and not sched.num_unfinished


def test_prefix_hit_counts_cached_prompt_tokens():
    bm, sched = make()
    a = seq("a", 10, max_tokens=1)
    sched.add(a)
    run_all(sched)
    b = seq("b", 12, max_tokens=1)  # shares a's first 8 tokens (2 full pages)
    sched.add(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 8 and batch.num_new_tokens == [4]


def test_random_workload_never_leaks_or_overcommits():
    rng = random.Random(0)
    for trial in range(20):
        bm, sched = make(
            num_pages=rng.randint(8, 30),
            max_prefill_tokens=rng.randint(4, 40),
            chunked_prefill_size=rng.choice([0, 3, 8]),
            max_running_requests=rng.randint(1, 6),
        )
        pending = [seq(f"t{trial}r{i}", rng.randint(1, 20), rng.randint(1, 12), base=rng.choice([0, 0, 500 * i]))
                   for i in range(12)]
        finished = []
        for step in range(3000):
            if pending and rng.random() < 0.3:
                sched.add(pending.pop())
            if not pending and not sched.num_unfinished:
                break
            batch = sched.schedule()
            # every page's refcount is exactly the number of running sequences holding it
            holders = {}
            for s in sched.running:
                for pid in s.page_ids:
                    holders[pid] = holders.get(pid, 0) + 1
            assert {p.page_id: p.ref_count for p in bm.pages if p.ref_count} == holders
            assert all(not s.page_ids for s in sched.waiting)
            fake_step(sched, batch, finished)
            if rng.random() < 0.05 and sched.running:
                victim = rng.choice(sched.running)
                sched.remove(victim)
                finished.append(victim)
        assert not pending and not sched.num_unfinished
        assert bm.num_free_pages == bm.num_pages
        assert all(p.ref_count == 0 for p in bm.pages)


# ---- asynchronous load-back: a sequence waits for its pages, the others keep stepping ------


def loading_setup(num_pages: int, max_running: int, b_max_tokens: int = 4):
    """Sequence b (14 tokens: 3 full pages) whose pages the host tier holds, loaded asynchronously
    (AsyncTier: the test lands each load by hand), and a scheduler over a pool of ``num_pages``."""
    from services.engine.page_hash import page_hashes
    from tests.engine.test_block_manager import AsyncTier

    b = seq("b", 14, max_tokens=b_max_tokens, base=50)
    tier = AsyncTier(page_hashes(b.token_ids, PS))
    bm = BlockManager(num_pages, PS, hooks=tier)
    bm.async_load_min_pages = 2
    sched = Scheduler(bm, max_running_requests=max_running, max_prefill_tokens=32, chunked_prefill_size=16)
    return sched, bm, tier, b


def test_a_loading_sequence_waits_while_the_others_step():
    sched, bm, tier, b = loading_setup(16, 2, b_max_tokens=2)
    a = seq("a", 5, max_tokens=8)
    sched.add(a)
    finished: list = []
    fake_step(sched, sched.schedule(), finished)  # a prefilled
    sched.add(b)
    batch = sched.schedule()
    assert b.status is SequenceStatus.LOADING and sched.loading == [b]
    assert batch.seqs == [a] and batch.num_decode == 1  # a decodes; b holds its pages, not scheduled
    sched.add(c := seq("c", 3, base=90))  # b counts toward max_running_requests: c waits
    for _ in range(3):
        fake_step(sched, batch, finished)
        batch = sched.schedule()
        assert batch.seqs == [a] and c.status is SequenceStatus.WAITING
    assert a.num_output_tokens == 4 and b.num_computed_tokens == 0
    tier.land(0)
    fake_step(sched, batch, finished)
    batch = sched.schedule()
    # Landed: b runs, computing only its last (partial) page's tokens.
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 2] and b.status is SequenceStatus.RUNNING
    assert b.num_cached_tokens == 12
    fake_step(sched, batch, finished)
    finished_all, _ = run_all(sched)
    assert {s.request_id for s in finished + finished_all} == {"a", "b", "c"}
    assert bm.num_free_pages == bm.num_pages and bm.num_loading == 0


def test_an_abort_while_loading_frees_the_pages_once_the_copy_landed():
    sched, bm, tier, b = loading_setup(16, 4)
    a = seq("a", 5, max_tokens=8)
    sched.add(a)
    fake_step(sched, sched.schedule(), [])
    sched.add(b)
    batch = sched.schedule()
    assert sched.loading == [b]
    sched.remove(b)
    assert b.status is SequenceStatus.FINISHED and sched.loading == [] and bm.num_loading == 1
    assert bm.num_free_pages == bm.num_pages - 2 - 4  # a's 2 pages; b's 4 still the tier's
    tier.land(0)
    fake_step(sched, batch, [])
    batch = sched.schedule()
    assert batch.seqs == [a] and bm.num_loading == 0
    sched.remove(a)
    assert bm.num_free_pages == bm.num_pages


def test_a_full_pool_waits_for_a_loading_sequence_instead_of_cutting_the_runner_short():
    """The only running sequence needs a page that a loading one holds: it waits a step (no
    'length' finish); once the load lands the loaded sequence is the newest and is preempted."""
    sched, bm, tier, b = loading_setup(7, 4, b_max_tokens=2)
    a = seq("a", 7, max_tokens=20)
    sched.add(a)
    finished: list = []
    fake_step(sched, sched.schedule(), finished)
    sched.add(b)
    batch = sched.schedule()
    assert sched.loading == [b] and batch.seqs == [a]
    while batch.seqs:  # a decodes until the pool is full
        fake_step(sched, batch, finished)
        batch = sched.schedule()
    assert not batch.out_of_pages and not finished and a.num_tokens == 13 and bm.num_free_pages == 0
    tier.land(0)
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.preempted == [b] and sched.waiting[0] is b
    assert b.page_ids == [] and b.num_cached_tokens == 12
    finished_all, _ = run_all(sched)
    assert {s.request_id for s in finished_all} == {"a", "b"}
    bm.wait_for_loads()
    bm.poll_loads()
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages


def test_a_load_landed_while_the_step_waited_is_taken_at_the_next_schedule():
    """The engine waits for a load when nothing else can run (BlockManager.wait_loads): what
    landed then must still be handed to the scheduler."""
    sched, bm, tier, b = loading_setup(16, 4, b_max_tokens=2)
    a = seq("a", 5, max_tokens=1)
    sched.add(a)
    sched.add(b)  # a is queued behind it: b loads asynchronously
    finished: list = []
    batch = sched.schedule()
    assert batch.seqs == [a] and sched.loading == [b]
    fake_step(sched, batch, finished)  # a is done
    assert finished == [a] and sched.schedule().is_empty
    tier.land(0)
    bm.wait_loads(1.0)  # as LLMEngine.step does when its batch is empty
    assert bm.num_loading == 0 and sched.loading == [b]
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [2]
    finished_all, _ = run_all(sched)
    assert finished_all == [b] and bm.num_free_pages == bm.num_pages


# ---- a prompt whose prefix another prompt is computing waits for it instead of computing it too ----


def test_a_prompt_sharing_an_uncomputed_prefix_waits_one_step_and_hits_the_cache():
    # Four conversations arrive together with the same 40-token system prompt: computing it four
    # times over in one step is what 1P1D's prefill worker did on the agentic replay.
    bm, sched = make(max_prefill_tokens=200, chunked_prefill_size=100)
    system = list(range(40))
    convs = [Sequence(f"c{i}", system + [1000 * (i + 1) + j for j in range(20)], SamplingParams(max_tokens=1),
                      max_model_len=1000) for i in range(4)]
    for s in convs:
        sched.add(s)
    b1 = sched.schedule()
    assert [s.request_id for s in b1.seqs] == ["c0"] and b1.num_new_tokens == [60]
    assert [s.request_id for s in sched.waiting] == ["c1", "c2", "c3"]  # order kept
    fake_step(sched, b1, [])
    b2 = sched.schedule()
    assert [s.request_id for s in b2.seqs] == ["c1", "c2", "c3"]
    assert [s.num_cached_tokens for s in b2.seqs] == [40, 40, 40] and b2.num_new_tokens == [20, 20, 20]


def test_unrelated_prompts_are_admitted_past_a_waiting_one():
    bm, sched = make(max_prefill_tokens=200, chunked_prefill_size=100)
    a = seq("a", 60)
    b = seq("b", 50)  # shares a's first 48 tokens (12 pages), none computed yet
    c = seq("c", 30, base=500)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "c"]
    assert list(sched.waiting) == [b]


def test_a_short_shared_prefix_is_computed_twice_rather_than_waited_for():
    bm, sched = make(max_prefill_tokens=200, chunked_prefill_size=100)
    a = seq("a", 40)
    b = Sequence("b", list(range(8)) + [900 + j for j in range(40)], SamplingParams(max_tokens=1),
                 max_model_len=1000)  # 8 shared tokens: under the 32-token threshold
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]


def test_the_waiting_prompt_goes_ahead_when_the_one_computing_its_prefix_is_aborted():
    bm, sched = make(max_prefill_tokens=200, chunked_prefill_size=16)
    a, b = seq("a", 80), seq("b", 80)
    sched.add(a)
    sched.add(b)
    b1 = sched.schedule()
    assert b1.seqs == [a] and b1.num_new_tokens == [16]  # chunked: a's prefix takes several steps
    fake_step(sched, b1, [])
    assert sched.schedule().seqs == [a]  # b still waits for a's next chunks
    sched.remove(a)
    b3 = sched.schedule()
    assert b3.seqs == [b] and b.num_cached_tokens == 16  # the chunk a finished before its abort


def test_without_prefix_caching_nothing_waits():
    bm = BlockManager(64, PS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_running_requests=8, max_prefill_tokens=200, chunked_prefill_size=100)
    a, b = seq("a", 60), seq("b", 60)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().seqs == [a, b]


# ---- priority (vLLM's priority policy: lower first, then arrival) --------------------------------


def prio(rid, priority, prompt_len=4, max_tokens=4, base=0):
    return Sequence(rid, [base + i for i in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, priority=priority), max_model_len=1000)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    bm, sched = make(max_running_requests=1)
    seqs = [prio("a", 0), prio("b", 5), prio("c", -3), prio("d", 0), prio("e", -3)]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["c", "e", "a", "d", "b"]
    finished, _ = run_all(sched)
    assert [s.request_id for s in finished] == ["c", "e", "a", "d", "b"]
    # equal priorities: first come, first served, as before
    bm, sched = make(max_running_requests=1)
    for s in (prio("x", 2), prio("y", 2), prio("z", 2)):
        sched.add(s)
    assert [s.request_id for s in run_all(sched)[0]] == ["x", "y", "z"]


def test_running_requests_are_not_preempted_for_a_better_waiting_one():
    bm, sched = make(max_running_requests=1)
    low = prio("low", 9, max_tokens=6)
    sched.add(low)
    sched.schedule()
    sched.add(prio("high", -9))
    batch = sched.schedule()
    assert batch.seqs == [low] and not batch.preempted and sched.waiting[0].request_id == "high"


def test_out_of_pages_preempts_the_worst_priority_even_from_the_batch_and_it_waits_first_in_its_class():
    # 4 pages of 4 tokens: b (priority 7) runs first, then a and c (priority 1) join; when a page runs
    # out, b goes though it was admitted first and already holds a row of this step's batch
    bm, sched = make(num_pages=4)
    b = prio("b", 7, prompt_len=3, max_tokens=12, base=0)
    sched.add(b)
    finished = []
    fake_step(sched, sched.schedule(), finished)
    a, c = prio("a", 1, prompt_len=3, max_tokens=12, base=100), prio("c", 1, prompt_len=3, max_tokens=12, base=200)
    late = prio("late", 7, prompt_len=3, base=300)
    for s in (a, c):
        sched.add(s)
    for _ in range(10):
        batch = sched.schedule()
        if batch.preempted:
            break
        fake_step(sched, batch, finished)
        if len(sched.running) == 3 and late not in sched.waiting:
            sched.add(late)
    assert batch.preempted == [b], batch.preempted
    assert b not in batch.seqs and a in batch.seqs and len(batch.seqs) == len(batch.num_new_tokens)
    assert [s.request_id for s in sched.waiting] == ["b", "late"]  # first among priority 7
    fake_step(sched, batch, finished)  # the batch without b is consistent (fake_step checks every row)
