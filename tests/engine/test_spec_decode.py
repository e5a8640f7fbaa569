"""Speculative decoding: the acceptance rule, greedy identity, rollback, stops, seeds, adaptive k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.engine import SamplingParams
from services.draft.base import Drafter, Proposal
from services.draft.ngram import NgramDrafter, lookup
from services.engine.spec_decode import (
    RowCost,
    accept_greedy,
    accept_sampled,
    budget_drafts,
    choose_k,
    target_probs,
    verify,
)
from services.engine.tier_hooks import CacheTierHooks
from tests.engine.conftest import make_engine

# ---- the acceptance rule on its own -------------------------------------------------------


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("draft_kind", ["model_q", "ngram_right", "ngram_wrong", "model_q_far"])
def test_rejection_sampling_follows_the_target_distribution(draft_kind):
    """Every token the verifier emits is distributed as the target's p, whatever q proposed
    (as vLLM tests its rejection sampler): first token, and the next one after an acceptance."""
    torch.manual_seed(1234)
    rng = np.random.default_rng(7)
    vocab, n = 6, 30000
    params = SamplingParams(temperature=0.8, max_tokens=8)
    logits = torch.tensor([[1.0, 0.5, 0.2, -0.3, -1.0, 0.9], [0.1, 1.4, -0.5, 0.3, 0.0, -2.0]])
    p = target_probs(logits, params)  # [2, V]
    if draft_kind == "model_q":
        q = torch.softmax(torch.tensor([[0.3, 0.3, 1.0, 0.0, -0.5, 0.2]]), dim=-1)
    elif draft_kind == "model_q_far":  # a drafter that mostly proposes what p rarely draws
        q = torch.softmax(torch.tensor([[-3.0, -3.0, -3.0, 2.0, 3.0, -3.0]]), dim=-1)
    else:
        q = None
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    for _ in range(n):
        if q is not None:
            d = int(rng.choice(vocab, p=q[0].double().numpy() / q[0].double().sum().item()))
        else:  # n-gram: the same proposal every time, q = 1 on it
            d = 0 if draft_kind == "ngram_right" else 4
        out = accept_sampled(p, [d], q, params, first_offset=0)
        assert 1 <= len(out) <= 2
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    p_np = p.double().numpy()
    assert _tv(first, p_np[0]) < 0.02, (first / n, p_np[0])
    if second.sum() > 2000:
        assert _tv(second, p_np[1]) < 0.03


def test_target_probs_is_the_plain_samplers_distribution():
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, max_tokens=4)
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, -1.0, 3.0]])
    p = target_probs(logits, params)[0]
    assert torch.isclose(p.sum(), torch.tensor(1.0))
    assert (p[[2, 3, 4]] == 0).all()  # outside top-3 {5, 0, 1}
    # the same cut drawn many times by the plain sampler never leaves the support
    from kernels import sample

    torch.manual_seed(0)
    draws = sample(
        logits.repeat(2000, 1), torch.full((2000,), 0.7), torch.full((2000,), 3, dtype=torch.int32),
        torch.full((2000,), 0.9), torch.zeros(2000), torch.full((2000,), -1, dtype=torch.int64),
        torch.zeros(2000, dtype=torch.int64),
    )
    assert set(draws.tolist()) <= {i for i in range(6) if p[i] > 0}


def test_greedy_acceptance_is_longest_prefix_plus_target_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 2, 9]):
        logits[row, tok] = 5.0
    assert accept_greedy(logits, [3, 7, 2]) == [3, 7, 2, 9]
    assert accept_greedy(logits, [3, 1, 2]) == [3, 7]
    assert accept_greedy(logits, [0, 7, 2]) == [3]
    assert verify(logits[:1], [], None, SamplingParams(temperature=0.0), 0) == [3]


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8)
    runs = {tuple(verify(logits, [1, 2, 3], None, params, 5)) for _ in range(5)}
    assert len(runs) == 1


def test_choose_k_follows_the_cost_model():
    assert choose_k(0.9, 4, 0.0) == 4
    assert choose_k(0.0, 4, 0.0) == 0
    assert choose_k(0.5, 8, 0.0) == 4  # 0.5**4 = 0.0625 >= 0.05 > 0.5**5
    assert choose_k(0.5, 8, 0.2) == 2  # a costly drafter drafts less (0.25 >= 0.25 > 0.125)
    assert all(choose_k(a / 10, 4, 0.0) <= choose_k((a + 1) / 10, 4, 0.0) for a in range(10))


def _throughput(rates, counts, plain, cost, other=0.0):
    tokens = plain + sum(r**j for r, c in zip(rates, counts) for j in range(1, c + 1))
    return tokens / (other + cost.seconds(plain + sum(counts)))


def test_draft_rows_are_free_while_the_step_reads_weights():
    # knee at 20 rows: every draft with a chance of acceptance rides along, a hopeless one does not
    cost = RowCost(memory_s=0.020, row_s=0.001)
    assert budget_drafts([0.9, 0.5, 0.0], [4, 4, 4], 3, cost, 48) == [4, 4, 0]
    # ... and the row cap holds, best drafts first: 0.9, 0.81, 0.729 before 0.5
    assert budget_drafts([0.9, 0.5], [4, 4], 2, cost, 5) == [3, 0]


def test_draft_rows_past_the_compute_knee_must_pay_their_share():
    # a step bound by compute from its first row: a draft row costs what a plain row costs, so it
    # pays only if it is sure to be accepted
    compute = RowCost(memory_s=0.0, row_s=0.001)
    assert budget_drafts([0.99, 0.6], [4, 4], 8, compute, 48) == [0, 0]
    assert budget_drafts([1.0, 0.6], [4, 4], 8, compute, 48) == [4, 0]
    # 8 sequences at the dev VM's measure (knee ~11 rows): high acceptance still speculates
    vm = RowCost(memory_s=0.019, row_s=0.0017)
    counts = budget_drafts([0.9] * 8, [4] * 8, 8, vm, 48)
    assert 3 <= sum(counts) < 32 and max(counts) - min(counts) <= 1  # first drafts of all before second ones
    assert budget_drafts([0.3] * 8, [4] * 8, 8, vm, 48) == [1, 1, 1, 0, 0, 0, 0, 0]  # free rows only
    # time outside the projections (attention at long contexts) makes each row a smaller share
    assert budget_drafts([0.9, 0.6], [4, 4], 8, compute, 48, other_s=0.008) == [4, 1]


def test_draft_budget_maximizes_expected_tokens_per_second():
    # against every allocation of small cases (a prefix of each sequence's drafts)
    import itertools
    import random

    rnd = random.Random(7)
    for _ in range(200):
        n = rnd.randint(1, 3)
        rates = [rnd.choice([0.0, 0.2, 0.5, 0.8, 0.95, 1.0]) for _ in range(n)]
        lengths = [rnd.randint(0, 3) for _ in range(n)]
        plain = n + rnd.randint(0, 6)
        cost = RowCost(memory_s=rnd.uniform(0.0, 0.02), row_s=rnd.uniform(0.0005, 0.004))
        other = rnd.choice([0.0, rnd.uniform(0.0, 0.03)])
        got = budget_drafts(rates, lengths, plain, cost, 48, other_s=other)
        best = max(_throughput(rates, c, plain, cost, other)
                   for c in itertools.product(*(range(k + 1) for k in lengths)))
        assert _throughput(rates, got, plain, cost, other) >= best * (1 - 1e-9), (rates, lengths, plain, cost, got)


def test_row_cost_is_measured_from_one_row_and_many():
    seen = []

    def projection_seconds(rows):
        seen.append(rows)
        return 0.020 if rows == 1 else 0.064

    cost = RowCost.measure(projection_seconds, rows=32)
    assert seen == [1, 32] and cost == RowCost(memory_s=0.020, row_s=0.002)
    assert cost.seconds(4) == 0.020 and cost.seconds(20) == 0.040


def test_row_cost_is_measured_holding_the_core_lease(spec_engine):
    """Engines sharing a host's cores (kvbus up's 1P1D on a small host) start together: each times
    its projections inside the lease, so neither measures the other's work."""

    class Lease:
        held = False

        def __enter__(self):
            self.held = True
            return self

        def __exit__(self, *exc):
            self.held = False

    lease, seen = Lease(), []
    speculator = spec_engine.speculator
    saved = speculator.core_lease, speculator.projection_seconds
    speculator.core_lease = lease
    speculator.projection_seconds = lambda rows: seen.append((rows, lease.held)) or 0.01 * rows
    try:
        cost = speculator.measure_row_cost()
    finally:
        speculator.core_lease, speculator.projection_seconds = saved
    assert seen == [(1, True), (32, True)] and not lease.held
    assert cost == RowCost(memory_s=0.01, row_s=0.01)


def test_ngram_lookup():
    stream = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert lookup(stream, 3, 2, 4) == [4, 5, 9]
    assert lookup(stream, 10, 2, 4) == [4, 5, 9, 1, 2, 3]
    assert lookup([1, 2, 3], 3, 2, 4) == []
    assert lookup([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # the most recent occurrence
    d = NgramDrafter(min_n=2, max_n=3)
    d.open("r", stream)
    prop = d.propose("r", 2)
    assert prop == Proposal(position=9, tokens=[4, 5])
    d.commit("r", [4])
    assert d.propose("r", 2).position == 10
    d.close("r")
    assert d.propose("r", 2) is None


# ---- the engine ----------------------------------------------------------------------------

_FILE = (
    "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n\n\n"
    "def main():\n    cfg = read_config(sys.argv[1])\n    print(len(cfg))\n"
)
EXTRA_TEXTS = [
    "Repeat the following code exactly:\n" + _FILE + "\nRepeated:\n",
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. Write the list again: apple,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Copy this JSON: {\"name\": \"kvbus\", \"version\": 3, \"tags\": [\"a\", \"b\"]}\nCopy:",
    "Tell me a short story about a robot learning to paint.",
    "What are the three primary colors?",
    "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\nSELECT",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def spec_engine(model_dir):
    return make_engine(model_dir, speculative_method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def twenty_prompts(prompt_ids, tokenizer):
    chats = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for t in EXTRA_TEXTS[:2]
    ]
    prompts = list(prompt_ids) + [tokenizer.encode(t) for t in EXTRA_TEXTS] + chats
    assert len(prompts) == 20
    return prompts


def _assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_pages == 0


def _run_in_groups(engine, prompts, params, size=5):
    out = []
    for i in range(0, len(prompts), size):
        out += engine.generate_sync(prompts[i : i + size], params)
    return out


@pytest.mark.timeout(1200)
def test_greedy_identical_with_ngram_for_twenty_prompts(engine, spec_engine, twenty_prompts):
    plain = _run_in_groups(engine, twenty_prompts, GREEDY)
    before = spec_engine.stats.num_accepted_tokens
    spec = _run_in_groups(spec_engine, twenty_prompts, GREEDY)
    mismatched = [i for i, (a, b) in enumerate(zip(plain, spec)) if a.token_ids != b.token_ids]
    assert mismatched == []
    assert [a.text for a in plain] == [b.text for b in spec]
    assert [a.finish_reason for a in plain] == [b.finish_reason for b in spec]
    assert spec_engine.stats.num_accepted_tokens - before > 30  # it really speculated
    usage = [c.usage for c in spec]
    assert all(u.accepted_draft_tokens <= u.draft_tokens for u in usage)
    assert any(u.mean_accepted_length > 1.5 for u in usage)
    assert all(u.draft_tokens == 0 for u in (c.usage for c in plain))
    _assert_idle(spec_engine)


@pytest.mark.timeout(1200)
def test_greedy_identical_with_drafts_beside_twenty_decoding_sequences(engine, spec_engine, twenty_prompts):
    """Twenty sequences at once: with free rows (a step bound by reading weights) drafts ride along
    even though every sequence decodes, past the packed kernel's one-group 12 rows; with rows that
    cost a whole row's compute and acceptance below 1, the budget grants none."""
    rows_seen = []
    schedule = spec_engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch.num_decode:
            rows_seen.append((batch.num_decode, sum(batch.num_new_tokens[: batch.num_decode])))
        return batch

    speculator = spec_engine.speculator
    saved = speculator.row_cost
    spec_engine.scheduler.schedule = recording
    try:
        plain = engine.generate_sync(twenty_prompts, GREEDY)
        speculator.row_cost = RowCost(memory_s=1.0, row_s=0.0)  # every row free
        spec = spec_engine.generate_sync(twenty_prompts, GREEDY)
        assert [a.token_ids for a in plain] == [b.token_ids for b in spec]
        assert any(n >= 12 and rows > 12 for n, rows in rows_seen), rows_seen
        rows_seen.clear()
        speculator.row_cost = RowCost(memory_s=0.0, row_s=1.0)  # every row paid in full
        for seq_rate in (0.6, 0.95):  # (the engine's rate before a sequence's first verification: 0.6)
            assert budget_drafts([seq_rate] * 4, [4] * 4, 20, speculator.row_cost, 48) == [0] * 4
        spec = spec_engine.generate_sync(twenty_prompts[:12], GREEDY)
        assert [a.token_ids for a in plain[:12]] == [b.token_ids for b in spec]
        assert all(rows == n for n, rows in rows_seen if n >= 2), rows_seen
    finally:
        spec_engine.scheduler.schedule = schedule
        speculator.row_cost = saved
    _assert_idle(spec_engine)


def test_stops_apply_to_accepted_tokens_one_by_one(engine, spec_engine, tokenizer):
    prompt = tokenizer.encode(EXTRA_TEXTS[2])  # a repeated sentence: long accepted runs
    plain = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    # a stop token that falls in the middle of an accepted run, an odd max_tokens, a stop string
    stop_id = plain.token_ids[9]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[plain.text[20:26]]),
    ]
    for params in cases:
        [a] = engine.generate_sync([prompt], params)
        [b] = spec_engine.generate_sync([prompt], params)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), params
        assert b.usage.completion_tokens == len(b.token_ids)
    _assert_idle(spec_engine)


def _staggered(engine, first, second, params, join_after=4, max_steps=200):
    """``first`` decodes alone for ``join_after`` steps, then ``second`` arrives: its prefill shares
    steps with ``first``'s decode rows. Returns each request's tokens and the batches scheduled."""
    batches = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append([(s.request_id, n, s.is_decoding) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    engine.scheduler.schedule = recording
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    try:
        engine.add_request("a", first, params)
        for step in range(max_steps):
            if step == join_after:
                engine.add_request("b", second, params)
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            if step > join_after and not engine.has_unfinished():
                break
        else:
            for rid in ("a", "b"):
                engine.abort(rid)
            engine.step()
            raise AssertionError(f"not done after {max_steps} steps: {batches[-3:]}")
    finally:
        engine.scheduler.schedule = schedule
    return tokens, batches


def test_prefill_shares_a_step_with_verification_rows(engine, spec_engine, tokenizer):
    """A prompt admitted while another sequence verifies drafts is computed in that mixed step
    (the verifying rows come first, 1 + k per sequence) and samples its first token there."""
    first = tokenizer.encode(EXTRA_TEXTS[0])  # copies code: drafts accepted from its first steps
    second = tokenizer.encode(EXTRA_TEXTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=30)
    plain, _ = _staggered(engine, first, second, params)
    spec, batches = _staggered(spec_engine, first, second, params)
    mixed = [b for b in batches if any(n > 1 and d for _, n, d in b) and any(not d for _, _, d in b)]
    assert mixed, "no step verified drafts while another prompt prefilled"
    assert spec == plain
    assert len(spec["b"]) == 30
    _assert_idle(spec_engine)


def test_greedy_only_speculation_leaves_sampled_requests_to_plain_decoding(model_dir, engine, tokenizer):
    """speculative_greedy_only (kvbus up's default): greedy requests draft, sampled ones do not, so a
    seeded sampled request gives the same tokens as without speculation, whatever ran beside it."""
    code, fox = tokenizer.encode(EXTRA_TEXTS[0]), tokenizer.encode(EXTRA_TEXTS[2])
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    seeded = SamplingParams(temperature=0.6, seed=7, max_tokens=24)  # speculated, these draws differ
    plain_greedy, plain_seeded = engine.generate_sync([code, fox], [greedy, seeded])
    only = make_engine(model_dir, speculative_method="ngram", speculative_greedy_only=True)
    g, s = only.generate_sync([code, fox], [greedy, seeded])
    assert g.token_ids == plain_greedy.token_ids and g.usage.draft_tokens > 0
    assert s.token_ids == plain_seeded.token_ids and s.usage.draft_tokens == 0
    _assert_idle(only)


class _Recorder(CacheTierHooks):
    """A write-through tier that records every page the block manager offers it (stored or
    written back); it holds nothing, so nothing is ever loaded back."""

    is_tier = True

    def __init__(self):
        self.stored: list[int] = []

    def on_stored(self, page_hash, parent_hash, page_id):
        self.stored.append(page_hash)
        return False

    def write_back(self, page_hash, parent_hash, token_ids, page_id):
        self.stored.append(page_hash)
        return False

    def write_back_sync(self, page_hash, parent_hash, token_ids, page_id):
        self.stored.append(page_hash)


def _trace(engine, prompt, params):
    """Per token count: (pages held, computed tokens, indexed hashes) after every step."""
    bm = engine.block_manager
    engine.add_request("trace", prompt, params)
    states = {}
    while engine.has_unfinished():
        engine.step()
        seq = engine._seqs.get("trace")
        if seq is not None and seq.page_ids:
            states[seq.num_tokens] = (len(seq.page_ids), seq.num_computed_tokens, frozenset(bm.hash_to_page_id))
    return states


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page_size", [4])
def test_rollback_leaves_pages_and_prefix_cache_as_a_plain_run(model_dir, tokenizer, page_size):
    """After every step of a run with rejections, the pages held, the computed length and the
    prefix cache equal a plain run's at the same length; rejected pages never reach the tier hooks."""
    eng = make_engine(model_dir, page_size=page_size, speculative_method="ngram", num_speculative_tokens=6)
    prompt = tokenizer.encode(EXTRA_TEXTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=48)
    runs = {}
    for name in ("plain", "spec"):
        eng.block_manager.evict_all_cached()
        eng.block_manager.hooks = rec = _Recorder()
        eng.set_drafter(NgramDrafter(min_n=1, max_n=3) if name == "spec" else None)
        before = (eng.stats.num_drafted_tokens, eng.stats.num_accepted_tokens)
        runs[name] = (_trace(eng, prompt, params), list(rec.stored), frozenset(eng.block_manager.hash_to_page_id))
        if name == "spec":
            drafted = eng.stats.num_drafted_tokens - before[0]
            accepted = eng.stats.num_accepted_tokens - before[1]
            assert 0 < accepted < drafted  # there were rejections
        _assert_idle(eng)
    plain, spec = runs["plain"], runs["spec"]
    for n, state in spec[0].items():
        assert state == plain[0][n], n
    assert sorted(spec[1]) == sorted(plain[1])  # the same pages offered to the lower tier
    assert spec[2] == plain[2]  # the same prefix cache at the end


def test_seeded_sampling_is_reproducible_with_speculation(spec_engine, tokenizer):
    prompt = tokenizer.encode(EXTRA_TEXTS[2])
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    [a] = spec_engine.generate_sync([prompt], params)
    other = tokenizer.encode(EXTRA_TEXTS[3])
    b, _ = spec_engine.generate_sync([prompt, other], [params, SamplingParams(temperature=0.0, max_tokens=24)])
    assert a.token_ids == b.token_ids
    assert a.usage.draft_tokens > 0
    _assert_idle(spec_engine)


def test_sampled_logprobs_cover_every_emitted_token(spec_engine, tokenizer):
    prompt = tokenizer.encode(EXTRA_TEXTS[2])
    [c] = spec_engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=20, logprobs=2))
    assert len(c.logprobs) == 20 and [lp.token_id for lp in c.logprobs] == c.token_ids
    assert c.usage.accepted_draft_tokens > 0


class _WrongDrafter(Drafter):
    """Always proposes tokens the target would not pick: every step rejects."""

    name = "wrong"

    def __init__(self):
        self.len: dict[str, int] = {}

    def has(self, rid):
        return rid in self.len

    def open(self, rid, prompt):
        self.len[rid] = len(prompt)

    def commit(self, rid, tokens):
        self.len[rid] += len(tokens)

    def close(self, rid):
        self.len.pop(rid, None)

    def propose(self, rid, k):
        return Proposal(position=self.len[rid], tokens=[0] * k)


def test_adaptive_k_backs_off_a_drafter_that_is_always_wrong(engine, spec_engine, tokenizer):
    prompt = tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    params = SamplingParams(temperature=0.0, max_tokens=40)
    [plain] = engine.generate_sync([prompt], params)
    spec_engine.set_drafter(_WrongDrafter())
    try:
        [c] = spec_engine.generate_sync([prompt], params)
    finally:
        spec_engine.set_drafter(NgramDrafter())
    assert c.token_ids == plain.token_ids and len(c.token_ids) == 40
    assert c.usage.accepted_draft_tokens == 0 and c.usage.draft_tokens > 0
    # after the first rejections k drops to 0, with a one-token probe every few steps (the draft
    # budget still grants a probe at acceptance 0: its row is free)
    assert 4 + 3 <= c.usage.draft_tokens < 4 + 40 // 8 + 4
    _assert_idle(spec_engine)


def test_stale_proposal_is_discarded(engine, spec_engine, tokenizer):
    class Stale(_WrongDrafter):
        def propose(self, rid, k):
            return Proposal(position=self.len[rid] - 1, tokens=[0] * k)

    prompt = tokenizer.encode(EXTRA_TEXTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    [plain] = engine.generate_sync([prompt], params)
    spec_engine.set_drafter(Stale())
    try:
        [c] = spec_engine.generate_sync([prompt], params)
    finally:
        spec_engine.set_drafter(NgramDrafter())
    assert c.token_ids == plain.token_ids and len(c.token_ids) == 12 and c.usage.draft_tokens == 0


# ---- the scheduler's part (no model) -----------------------------------------------------------


def _decoding(sched, n, prompt_len=6):
    from services.engine.sequence import Sequence

    seqs = [Sequence(f"s{i}", list(range(100 * i, 100 * i + prompt_len)), SamplingParams(max_tokens=50),
                     max_model_len=1000) for i in range(n)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    for s, k in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += k
        s.token_ids.append(7)
    assert all(s.is_decoding for s in seqs)
    return seqs


def test_scheduler_grants_drafts_within_the_row_budget_and_never_preempts_for_them():
    from services.engine.block_manager import BlockManager
    from services.engine.scheduler import Scheduler

    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_running_requests=8, max_prefill_tokens=64, chunked_prefill_size=64, max_spec_rows=8)
    seqs = _decoding(sched, 3)
    for s in seqs:
        s.draft_tokens = [1, 2, 3, 4]
    batch = sched.schedule()
    assert batch.num_decode == 3 and batch.num_new_tokens == [5, 2, 1]  # 8 rows in all
    assert [len(s.draft_tokens) for s in seqs] == [4, 1, 0]
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert len(s.page_ids) == bm.pages_for(s.num_computed_tokens + n)
    # speculation off: one row each whatever the drafts
    sched2 = Scheduler(BlockManager(64, 4), max_running_requests=8, max_prefill_tokens=64, chunked_prefill_size=64)
    seqs2 = _decoding(sched2, 2)
    seqs2[0].draft_tokens = [1, 2]
    assert sched2.schedule().num_new_tokens == [1, 1]
    # a pool with one page to spare: drafts shrink to fit it, nobody is preempted
    bm3 = BlockManager(5, 4)
    sched3 = Scheduler(bm3, max_running_requests=8, max_prefill_tokens=64, chunked_prefill_size=64, max_spec_rows=12)
    a, b = _decoding(sched3, 2, prompt_len=7)  # 8 tokens each in 2 full pages; 1 page free
    a.draft_tokens = [1] * 8
    batch = sched3.schedule()
    assert not batch.preempted and batch.num_new_tokens == [5, 1]
    assert a.draft_tokens == [1] * 4 and bm3.num_free_pages == 0


def test_verification_rows_attend_as_one_extend_per_sequence():
    """A sequence's last token and its drafts are decode rows (the packed GEMM's) that attend as
    one extend: per-sequence block table and length, and cu_seqlens splitting the rows, so the
    kernel reads the sequence's KV once, not once a row."""
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import ScheduledBatch
    from services.engine.sequence import Sequence

    def seq(rid, n_tokens, pages, drafts):
        s = Sequence(rid, list(range(1, n_tokens)), SamplingParams(max_tokens=50), max_model_len=1000)
        s.token_ids.append(99)  # its first output token: decoding
        s.num_computed_tokens = n_tokens - 1
        s.page_ids, s.draft_tokens = pages, drafts
        return s

    a = seq("a", 10, [5, 2, 7, 6], [11, 12, 13])  # positions 9..12: rows 0-3
    b = seq("b", 6, [3, 4], [])                # position 5: row 4
    prompt = Sequence("c", [1, 2, 3, 4, 5], SamplingParams(max_tokens=5), max_model_len=1000)
    prompt.page_ids = [8, 9]
    batch = ScheduledBatch(seqs=[a, b, prompt], num_new_tokens=[4, 1, 5], num_decode=2)
    runner = ModelRunner(model=None, page_size=4, device=torch.device("cpu"))
    ids, pos, meta, rows, sampling = runner.prepare(batch)
    assert ids.tolist() == [99, 11, 12, 13, 99, 1, 2, 3, 4, 5]
    assert pos.tolist() == [9, 10, 11, 12, 5, 0, 1, 2, 3, 4]
    assert meta.num_decode_tokens == 5
    assert meta.decode_cu_seqlens_q.tolist() == [0, 4, 5] and meta.decode_max_seqlen_q == 4
    assert meta.decode_seq_lens.tolist() == [13, 6]
    assert meta.decode_block_tables.tolist() == [[5, 2, 7, 6], [3, 4, 0, 0]]
    assert meta.slot_mapping.tolist()[:5] == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 6 * 4 + 0, 4 * 4 + 1]
    assert rows.tolist() == [0, 1, 2, 3, 4, 9] and [s.request_id for s in sampling] == ["a", "b", "c"]
    # without drafts: a row per sequence, no cu_seqlens (the decode kernel's path)
    a.draft_tokens = []
    batch = ScheduledBatch(seqs=[a, b], num_new_tokens=[1, 1], num_decode=2)
    _, _, meta, rows, _ = runner.prepare(batch)
    assert meta.decode_cu_seqlens_q is None and meta.decode_seq_lens.tolist() == [10, 6] and rows is None
