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


def _pool_pages(engine, seqs) -> torch.Tensor:
    return engine.kv_pool.data[[pid for s in seqs for pid in s.page_ids]].clone()


def test_the_last_layer_runs_only_the_sampling_rows(engine, hf_model, prompt_ids, monkeypatch):
    """A step of two decoding sequences, a prompt that completes and a chunk that does not: the
    last layer's o-proj and MLP run on the 3 sampling rows alone, their logits match HF and the
    whole-step path, and every row's K and V reach the cache in every layer as in that path."""
    import services.engine.llama as llama

    a, b, c, d = prompt_ids[0], prompt_ids[1], prompt_ids[2], prompt_ids[3]
    bm = engine.block_manager
    bm.evict_all_cached()
    seqs = [Sequence(r, p, GREEDY, max_model_len=8192) for r, p in zip("abcd", (a, b, c, d))]
    sa, sb, sc, sd = seqs
    rows_seen = []  # (layer's weight, rows) of every projection
    real_linear = llama.linear
    monkeypatch.setattr(llama, "linear", lambda x, w, *a, **k: rows_seen.append((w, x.shape[0])) or real_linear(x, w, *a, **k))
    try:
        for s in (sa, sb):
            bm.allocate(s)
            s.num_computed_tokens = 0
        forward_all_rows(engine, [sa, sb], [len(a), len(b)], 0)
        for s, t in ((sa, 42), (sb, 1337)):
            s.token_ids.append(t)
            bm.grow(s, s.num_tokens)
        for s in (sc, sd):
            bm.allocate(s)
            s.num_computed_tokens = 0
        chunk = len(d) // 2
        batch = ScheduledBatch(seqs=seqs, num_new_tokens=[1, 1, len(c), chunk], num_decode=2)
        ids, pos, meta, rows, sampling = engine.runner.prepare(batch)
        assert rows.tolist() == [0, 1, 2 + len(c) - 1] and sampling == [sa, sb, sc]
        assert meta.sample_seq_lens.tolist() == [len(a) + 1, len(b) + 1, len(c)]
        rows_seen.clear()
        with torch.inference_mode():
            narrowed = engine.model.forward(ids, pos, meta, rows)
        last = engine.model.w.layers[-1]
        T = 2 + len(c) + chunk
        assert [(w, n) for w, n in rows_seen if w is last.qkv] == [(last.qkv, T)]
        for w in (last.o, last.gate_up, last.down):
            assert [n for v, n in rows_seen if v is w] == [3]
        assert [n for v, n in rows_seen if v is engine.model.w.layers[-2].o] == [T]
        kv_narrowed = _pool_pages(engine, seqs)
        meta.sample_block_tables = meta.sample_seq_lens = None  # the whole step, then its sampling rows
        with torch.inference_mode():
            whole = engine.model.forward(ids, pos, meta, rows)
        assert torch.equal(_pool_pages(engine, seqs), kv_narrowed)
        torch.testing.assert_close(narrowed, whole, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(narrowed[0], hf_logits(hf_model, a + [42])[-1], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(narrowed[1], hf_logits(hf_model, b + [1337])[-1], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(narrowed[2], hf_logits(hf_model, c)[-1], atol=LOGIT_ATOL, rtol=0)

        # a step of prompt chunks alone samples nothing: the last layer only writes its K and V
        sd.num_computed_tokens = chunk
        batch = ScheduledBatch(seqs=[sd], num_new_tokens=[len(d) - chunk - 1], num_decode=0)
        ids, pos, meta, rows, sampling = engine.runner.prepare(batch)
        assert rows.numel() == 0 and not sampling and meta.sample_block_tables is not None
        rows_seen.clear()
        with torch.inference_mode():
            assert engine.model.forward(ids, pos, meta, rows).shape == (0, engine.model_config.vocab_size)
        assert not [w for w, _ in rows_seen if w in (last.o, last.gate_up, last.down)]
        kv_narrowed = _pool_pages(engine, [sd])
        meta.sample_block_tables = meta.sample_seq_lens = None
        with torch.inference_mode():
            engine.model.forward(ids, pos, meta, rows)
        assert torch.equal(_pool_pages(engine, [sd]), kv_narrowed)
    finally:
        for s in seqs:
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
        assert o.usage.cached_prompt_tokens == len(p) - 1  # full pages, then the warm run's tail rows
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
