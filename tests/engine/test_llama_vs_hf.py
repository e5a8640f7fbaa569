"""The runtime against transformers on the default model, fp32."""

from __future__ import annotations

import pytest
import torch

from schemas.engine import SamplingParams
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from tests.engine.conftest import _LONG, MAX_NEW_TOKENS, PROMPT_TEXTS, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
LOGIT_ATOL = 5e-4  # logits reach ~30; observed max |diff| 5e-5 (F.linear) to 2.1e-4 (oneDNN prepacked)


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def forward_all_rows(engine, seqs, num_new, num_decode):
    """Run one packed forward over ``seqs`` and return logits of every row."""
    batch = ScheduledBatch(seqs=seqs, num_new_tokens=num_new, num_decode=num_decode)
    ids, pos, meta, _rows, _ = engine.runner.prepare(batch)
    with torch.inference_mode():
        logits = engine.model.forward(ids, pos, meta, None)
    for s, n in zip(seqs, num_new):
        s.num_computed_tokens += n
    return logits


def test_prefill_logits_of_a_mixed_length_batch(engine, hf_model, prompt_ids):
    prompts = prompt_ids[:6]
    seqs = [Sequence(f"l{i}", p, GREEDY, max_model_len=8192) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.block_manager.allocate(s)
        s.num_computed_tokens = 0  # ignore any cached prefix: compute every row
    try:
        logits = forward_all_rows(engine, seqs, [len(p) for p in prompts], 0)
        row = 0
        for p in prompts:
            ref = hf_logits(hf_model, p)
            torch.testing.assert_close(logits[row : row + len(p)], ref, atol=LOGIT_ATOL, rtol=0)
            row += len(p)
    finally:
        for s in seqs:
            engine.block_manager.free(s)


def test_decode_and_mixed_step_logits(engine, hf_model, prompt_ids):
    """A step with two decoding sequences and a prefill chunk in one forward."""
    a, b, c = prompt_ids[0], prompt_ids[1], prompt_ids[2]
    bm = engine.block_manager
    bm.evict_all_cached()
    sa, sb = (Sequence(r, p, GREEDY, max_model_len=8192) for r, p in (("a", a), ("b", b)))
    sc = Sequence("c", c, GREEDY, max_model_len=8192)
    try:
        for s in (sa, sb):
            bm.allocate(s)
        forward_all_rows(engine, [sa, sb], [len(a), len(b)], 0)
        next_a, next_b = 42, 1337  # arbitrary next tokens: logits must match HF on them too
        for s, t in ((sa, next_a), (sb, next_b)):
            s.token_ids.append(t)
            bm.grow(s, s.num_tokens)
        bm.allocate(sc)
        logits = forward_all_rows(engine, [sa, sb, sc], [1, 1, len(c)], 2)
        torch.testing.assert_close(logits[0], hf_logits(hf_model, a + [next_a])[-1], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(logits[1], hf_logits(hf_model, b + [next_b])[-1], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(logits[2:], hf_logits(hf_model, c), atol=LOGIT_ATOL, rtol=0)
    finally:
        for s in (sa, sb, sc):
            bm.free(s)


def generate(engine, prompts, params=GREEDY):
    return engine.generate_sync(prompts, params)


def assert_matches(outs, refs, prompts):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert out.finish_reason == ("stop" if len(ref) < MAX_NEW_TOKENS else "length")


@pytest.mark.slow
def test_greedy_one_at_a_time_matches_hf(engine, prompt_ids, hf_greedy):
    engine.block_manager.evict_all_cached()
    outs = [generate(engine, [p])[0] for p in prompt_ids]
    assert_matches(outs, hf_greedy, prompt_ids)


@pytest.mark.slow
def test_greedy_batched_matches_hf(engine, prompt_ids, hf_greedy, monkeypatch):
    engine.block_manager.evict_all_cached()
    # every prompt computed whole, side by side in one batch: none waits for the chat prompts'
    # shared system prompt to be computed first (the scheduler's default)
    monkeypatch.setattr(engine.scheduler, "defer_shared_tokens", 10**9)
    outs = generate(engine, prompt_ids)
    assert_matches(outs, hf_greedy, prompt_ids)
    assert all(o.usage.cached_prompt_tokens == 0 for o in outs)


@pytest.mark.slow
def test_greedy_batched_with_the_shared_prefix_computed_once_matches_hf(engine, prompt_ids, hf_greedy):
    engine.block_manager.evict_all_cached()
    outs = generate(engine, prompt_ids)
    assert_matches(outs, hf_greedy, prompt_ids)
    # prompts 3 and 6 open with the same passage: 3 computes it, 6 waits a step and takes it from
    # the prefix cache; the others share nothing worth waiting for
    assert PROMPT_TEXTS[3].startswith(_LONG) and PROMPT_TEXTS[6].startswith(_LONG)
    assert outs[6].usage.cached_prompt_tokens >= 32
    assert [i for i, o in enumerate(outs) if o.usage.cached_prompt_tokens] == [6]


@pytest.mark.slow
def test_greedy_with_cached_prefix_matches_hf(engine, prompt_ids, hf_greedy):
    engine.block_manager.evict_all_cached()
    generate(engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=1))  # warm the prefix cache
    outs = generate(engine, prompt_ids)
    assert_matches(outs, hf_greedy, prompt_ids)
    for p, o in zip(prompt_ids, outs):
        assert o.usage.cached_prompt_tokens == (len(p) - 1) // 16 * 16
    assert sum(o.usage.cached_prompt_tokens for o in outs) > 300


@pytest.mark.slow
def test_greedy_with_chunked_prefill_matches_hf(model_dir, prompt_ids, hf_greedy):
    eng = make_engine(model_dir, chunked_prefill_size=24, max_prefill_tokens=40, enable_prefix_caching=False)
    chunks = []
    schedule = eng.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        chunks.extend(
            (s.request_id, s.num_computed_tokens, n) for s, n in zip(batch.seqs[batch.num_decode :], batch.num_new_tokens[batch.num_decode :])
        )
        return batch

    eng.scheduler.schedule = recording_schedule
    outs = generate(eng, prompt_ids)
    assert_matches(outs, hf_greedy, prompt_ids)
    assert max(n for *_, n in chunks) <= 24
    # the longest prompt went in chunks that continue where the last one stopped
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    rid = outs[longest].request_id
    starts = [(start, n) for r, start, n in chunks if r == rid]
    assert len(starts) >= len(prompt_ids[longest]) // 24
    assert all(a + n == b for (a, n), (b, _) in zip(starts, starts[1:]))


@pytest.mark.slow
def test_preemption_with_a_tiny_pool_matches_hf(model_dir, prompt_ids, hf_greedy):
    # 40 pages of 16 tokens: far less than 10 prompts + 64 tokens each need at once.
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4
    eng = make_engine(model_dir, kv_cache_memory=40 * page_bytes / 1024**3)
    assert eng.block_manager.num_pages == 40
    outs = generate(eng, prompt_ids)
    assert_matches(outs, hf_greedy, prompt_ids)
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_used_pages == 0
