"""Prefill-only requests export their prompt pages; another engine continues from them."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from schemas.engine import SamplingParams
from services.engine import RequestError
from tests.engine.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def prefill_sync(engine, rid, prompt, params=GREEDY):
    engine.add_prefill_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finished for o in outs] == [True] and len(outs[0].new_token_ids) == 1
    result = engine.take_prefill_result(rid)
    assert result is not None and engine.take_prefill_result(rid) is None
    return result


def decode_sync(engine, rid, prompt, result, params=GREEDY):
    engine.add_prefilled_request(rid, prompt, result.first_token_id, result.kv, params,
                                 num_cached_tokens=result.num_cached_tokens, first_logprob=result.first_logprob,
                                 kv_scales=result.kv_scales)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("evict", [True, False], ids=["pages-written", "prefix-cache-hit"])
def test_prefill_then_import_matches_hf(engine, prompt_ids, hf_greedy, evict):
    for i in (3, 1, 8):  # ~250-token, short and chat prompts
        engine.block_manager.evict_all_cached()
        prompt = prompt_ids[i]
        result = prefill_sync(engine, f"p{i}", prompt)
        pages = engine.block_manager.pages_for(len(prompt))
        assert tuple(result.kv.shape) == (pages, 30, 2, 16, 3, 64) and result.kv_scales == []
        assert result.first_token_id == hf_greedy[i][0]
        assert engine.block_manager.num_used_pages == 0  # released to the prefix cache
        if evict:
            engine.block_manager.evict_all_cached()
            engine.kv_pool.data.normal_()  # no stale KV can help the import
        outs = decode_sync(engine, f"d{i}", prompt, result)
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy[i]
        assert outs[-1].usage.prompt_tokens == len(prompt)
        assert engine.block_manager.num_used_pages == 0


def test_imported_pages_enter_the_prefix_cache(engine, prompt_ids):
    engine.block_manager.evict_all_cached()
    prompt = prompt_ids[3]
    result = prefill_sync(engine, "p", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    engine.block_manager.evict_all_cached()
    decode_sync(engine, "d", prompt, result, SamplingParams(temperature=0.0, max_tokens=2))
    [again] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    # every prompt page, then the rows of the decode's tail: all but the last token
    assert again.usage.cached_prompt_tokens == len(prompt) - 1


def test_first_token_can_finish_the_request(engine, prompt_ids):
    prompt = prompt_ids[0]
    result = prefill_sync(engine, "p", prompt)
    eos = next(iter(engine.eos_token_ids))
    engine.add_prefilled_request("d", prompt, eos, result.kv, GREEDY)
    [out] = engine.step()
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == [eos]
    engine.add_prefilled_request("d2", prompt, result.first_token_id, result.kv,
                                 SamplingParams(temperature=0.0, max_tokens=1))
    [out] = engine.step()
    assert out.finish_reason == "length" and out.usage.completion_tokens == 1
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0


def test_bad_imports_are_request_errors(engine, prompt_ids):
    prompt = prompt_ids[0]
    result = prefill_sync(engine, "p", prompt)
    with pytest.raises(RequestError, match="must be"):
        engine.add_prefilled_request("x", prompt + [5] * 16, result.first_token_id, result.kv)
    with pytest.raises(RequestError, match="holds"):
        engine.add_prefilled_request("x", prompt, result.first_token_id, result.kv.half())
    with pytest.raises(RequestError, match="scales"):
        engine.add_prefilled_request("x", prompt, result.first_token_id, result.kv, kv_scales=[1.0, 1.0])
    with pytest.raises(RequestError, match="first_token_id"):
        engine.add_prefilled_request("x", prompt, -1, result.kv)
    # the id is free again after every refusal
    engine.add_prefilled_request("x", prompt, result.first_token_id, result.kv,
                                 SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.step()[0].finished


def test_abort_an_imported_request(engine, prompt_ids):
    prompt = prompt_ids[3]
    result = prefill_sync(engine, "p", prompt)
    engine.add_prefilled_request("d", prompt, result.first_token_id, result.kv, GREEDY)
    engine.step()
    engine.step()
    engine.abort("d")
    outs = engine.step()
    assert outs[-1].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0


def test_async_prefill_and_generate_prefilled(engine, prompt_ids):
    prompt = prompt_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=2)
    [ref] = engine.generate_sync([prompt], params)  # matching transformers is the slow tests' job

    async def main():
        result = await engine.prefill(prompt, params)
        engine.block_manager.evict_all_cached()
        outs = [o async for o in engine.generate_prefilled(
            prompt, result.first_token_id, result.kv, params, first_logprob=result.first_logprob,
            num_cached_tokens=result.num_cached_tokens, kv_scales=result.kv_scales)]
        return result, outs

    result, outs = asyncio.run(main())
    assert result.first_logprob is not None and result.first_logprob.token_id == result.first_token_id
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    assert outs[0].logprobs == [result.first_logprob] == ref.logprobs[:1]
    assert all(len(o.logprobs) == 1 for o in outs)


def test_first_token_of_an_import_streams_before_the_forward_pass(engine, prompt_ids, monkeypatch):
    # 1P1D: a decode engine's first output is the token the prefill worker sampled; it must reach
    # the stream at once, not after the step's forward pass (which computes the second token)
    prompt = prompt_ids[2]
    result = prefill_sync(engine, "early-pre", prompt)
    engine.block_manager.evict_all_cached()
    gate, released = threading.Event(), []
    run = engine.runner.run

    def gated(batch):  # the forward pass waits until the test saw the first output (or 60 s)
        released.append(gate.wait(60))
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", gated)

    async def main():
        outs = []
        async for out in engine.generate_prefilled(prompt, result.first_token_id, result.kv, GREEDY,
                                                   num_cached_tokens=result.num_cached_tokens,
                                                   kv_scales=result.kv_scales):
            outs.append(out)
            gate.set()
        return outs

    outs = asyncio.run(main())
    assert released[0] is True  # the first output arrived while the first forward pass waited
    assert outs[0].new_token_ids == [result.first_token_id]
    assert sum(len(o.new_token_ids) for o in outs) == MAX_NEW_TOKENS
    assert not engine.has_unfinished()


@pytest.mark.parametrize("pages", ["arrive", "never", "misfit"])
def test_first_token_streams_before_the_pages_arrive(engine, prompt_ids, pages):
    """1P1D: the decode worker streams the prefill worker's first token while the pages are still
    in transit (kv=None); they arrive later (provide_kv), or not at all or wrongly shaped, and the
    request computes its prompt here instead. Token for token the same either way."""
    prompt = prompt_ids[2]
    [ref] = engine.generate_sync([prompt], GREEDY)
    result = prefill_sync(engine, "pre", prompt)
    engine.block_manager.evict_all_cached()
    free = engine.block_manager.num_free_pages

    async def main():
        outs = []
        stream = engine.generate_prefilled(prompt, result.first_token_id, None, GREEDY,
                                           num_cached_tokens=result.num_cached_tokens, request_id="d")
        outs.append(await anext(stream))  # streamed before any page is here
        assert engine.num_waiting == 1 and engine.num_running == 0
        assert engine.block_manager.num_free_pages == free  # it holds no pages while it waits
        kv = {"arrive": result.kv, "never": None, "misfit": result.kv[:-1]}[pages]
        assert engine.provide_kv("d", kv, result.kv_scales)
        assert not engine.provide_kv("d", kv, result.kv_scales)  # once
        outs += [o async for o in stream]
        return outs

    outs = asyncio.run(main())
    assert outs[0].new_token_ids == [result.first_token_id]
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    assert engine.stats.num_prefill_tokens >= (0 if pages == "arrive" else len(prompt))
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0


def test_pages_for_a_request_gone_meanwhile_are_dropped(engine, prompt_ids):
    prompt = prompt_ids[2]
    result = prefill_sync(engine, "pre", prompt)

    async def main():
        done = [o async for o in engine.generate_prefilled(  # finished at its first token
            prompt, result.first_token_id, None, SamplingParams(temperature=0.0, max_tokens=1), request_id="one")]
        assert done[-1].finished and not engine.provide_kv("one", result.kv, result.kv_scales)
        stream = engine.generate_prefilled(prompt, result.first_token_id, None, GREEDY, request_id="gone")
        await anext(stream)
        await stream.aclose()  # the caller left: aborted while its pages were in transit
        deadline = asyncio.get_running_loop().time() + 60
        while engine.has_unfinished() or engine.handoff.awaiting:  # the abort reaches the engine thread
            assert asyncio.get_running_loop().time() < deadline, "the abort was never processed"
            await asyncio.sleep(0.01)
        return engine.provide_kv("gone", result.kv, result.kv_scales)

    assert asyncio.run(main()) is False
    assert engine.num_waiting == 0 and engine.block_manager.num_used_pages == 0


@pytest.mark.slow
def test_fp8_pages_carry_their_scales(model_dir, prompt_ids):
    from tests.engine.conftest import make_engine

    eng = make_engine(model_dir, kv_cache_dtype="fp8_e4m3", kv_fp8_scale=0.5, kv_cache_memory=0.02)
    prompt = prompt_ids[1]
    [ref] = eng.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    eng.block_manager.evict_all_cached()
    result = prefill_sync(eng, "p", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert result.kv.dtype == torch.float8_e4m3fn and result.kv_scales == [0.5, 0.5]
    eng.block_manager.evict_all_cached()
    outs = decode_sync(eng, "d", prompt, result, SamplingParams(temperature=0.0, max_tokens=8))
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids


# ---- only the missing pages cross: the receiver holds a prefix (skip_pages / kv_first_page) ----

def _warm_prefix(engine, prompt, num_pages):
    """Leave exactly the prompt's first ``num_pages`` pages in the engine's prefix cache."""
    engine.block_manager.evict_all_cached()
    if num_pages:  # (ends on a page boundary: no tail, the partial page a finished request leaves)
        engine.generate_sync([prompt[: num_pages * 16]], SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.block_manager.num_cached_pages == num_pages


@pytest.mark.parametrize("held,skip,chunk", [(7, 7, None), (10, 7, None), (2, 10, None), (0, 10, 48)],
                         ids=["held-as-counted", "held-more", "gap-recomputed", "gap-in-chunks"])
def test_only_the_missing_pages_are_imported(model_dir, prompt_ids, held, skip, chunk):
    """The decode side counted ``skip`` held pages; by admission it holds ``held``. The output is
    the same either way; a shrunken prefix (held < skip) is recomputed up to the imported pages."""
    from tests.engine.conftest import make_engine

    eng = make_engine(model_dir, kv_cache_memory=0.05, **({"chunked_prefill_size": chunk} if chunk else {}))
    prompt = prompt_ids[3]  # 189 tokens: 11 full pages before the last token's
    pages = eng.block_manager.pages_for(len(prompt))
    [ref] = eng.generate_sync([prompt], GREEDY)
    eng.block_manager.evict_all_cached()
    eng.add_prefill_request("p", prompt, GREEDY, skip_pages=skip)
    while eng.has_unfinished():
        eng.step()
    result = eng.take_prefill_result("p")
    assert tuple(result.kv.shape) == (pages - skip, 30, 2, 16, 3, 64)
    assert result.first_token_id == ref.token_ids[0]

    _warm_prefix(eng, prompt, held)
    before = eng.stats.num_prefill_tokens
    eng.add_prefilled_request("d", prompt, result.first_token_id, result.kv, GREEDY, kv_first_page=skip)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    gap = max(skip - held, 0) * 16
    computed = eng.stats.num_prefill_tokens - before
    # a gap is computed as prefill; without one only the first generated token's row runs
    assert computed == (gap if gap else 1)
    assert eng.scheduler.num_import_gaps == (1 if gap else 0)
    assert not eng.has_unfinished() and eng.block_manager.num_used_pages == 0
    # every prompt page is in the prefix cache afterwards, imported or recomputed alike (then the
    # rows of the decode's tail: all but the last token)
    [again] = eng.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert again.usage.cached_prompt_tokens == len(prompt) - 1


def test_skip_pages_out_of_range_are_request_errors(engine, prompt_ids):
    prompt = prompt_ids[0]
    limit = (len(prompt) - 1) // 16
    for bad in (-1, limit + 1):
        with pytest.raises(RequestError, match="skip_pages"):
            engine.add_prefill_request("x", prompt, GREEDY, skip_pages=bad)
    result = prefill_sync(engine, "p", prompt)
    with pytest.raises(RequestError, match="skip_pages"):
        engine.add_prefilled_request("x", prompt, result.first_token_id, result.kv, kv_first_page=limit + 1)
    if limit:  # the whole prompt's pages do not fit a kv that should start later
        with pytest.raises(RequestError, match="must be"):
            engine.add_prefilled_request("x", prompt, result.first_token_id, result.kv, kv_first_page=1)
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0


def test_abort_while_the_gap_is_computed(model_dir, prompt_ids):
    from tests.engine.conftest import make_engine

    eng = make_engine(model_dir, kv_cache_memory=0.05, chunked_prefill_size=32)
    prompt = prompt_ids[3]
    eng.add_prefill_request("p", prompt, GREEDY, skip_pages=10)
    while eng.has_unfinished():
        eng.step()
    result = eng.take_prefill_result("p")
    eng.block_manager.evict_all_cached()
    eng.add_prefilled_request("d", prompt, result.first_token_id, result.kv, GREEDY, kv_first_page=10)
    eng.step()
    eng.step()  # two 32-token chunks of the 160-token gap
    seq = eng._seqs["d"]
    assert seq.imported_kv is not None and seq.num_computed_tokens == 64
    eng.abort("d")
    assert eng.step()[-1].finish_reason == "abort"
    assert not eng.has_unfinished() and eng.block_manager.num_used_pages == 0
