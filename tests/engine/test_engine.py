"""Engine behaviour on the default model: streaming, abort, stops, sampling, usage, errors."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from schemas.engine import InvalidSamplingParams, RequestOutput, SamplingParams
from services.config import ConfigError
from services.engine import EngineConfig, RequestError

GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16)


def assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_pages == 0
    assert all(p.ref_count == 0 for p in engine.block_manager.pages)


async def collect(engine, prompt, params, request_id=None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


def test_async_stream_is_incremental_and_matches_sync(engine, tokenizer, prompt_ids):
    prompt = prompt_ids[1]
    [ref] = engine.generate_sync([prompt], GREEDY16)
    outs = asyncio.run(collect(engine, prompt, GREEDY16))
    assert all(len(o.new_token_ids) == 1 for o in outs) and len(outs) == 16
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    assert [o.finished for o in outs] == [False] * 15 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 16
    text = "".join(o.new_text for o in outs)
    assert text == tokenizer.decode(ref.token_ids, skip_special_tokens=True) == ref.text
    assert_idle(engine)


def test_concurrent_async_streams_batch_together(engine, prompt_ids):
    prompts = prompt_ids[:4]
    refs = [engine.generate_sync([p], GREEDY16)[0].token_ids for p in prompts]
    steps_before = engine.stats.num_steps

    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY16) for p in prompts))

    results = asyncio.run(main())
    for outs, ref in zip(results, refs):
        assert [t for o in outs for t in o.new_token_ids] == ref
    assert engine.stats.num_steps - steps_before < 2 * 16  # not one request after another
    assert_idle(engine)


def test_leaving_the_stream_early_aborts_and_frees_pages(engine, prompt_ids):
    async def main():
        seen = 0
        async for out in engine.generate(prompt_ids[3], SamplingParams(temperature=0.0, max_tokens=50)):
            seen += 1
            if seen == 3:
                break
        # the abort is processed by the engine loop's next step
        for _ in range(100):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return seen

    assert asyncio.run(main()) == 3
    assert_idle(engine)


def test_sync_abort_running_and_waiting(engine, prompt_ids):
    engine.add_request("run", prompt_ids[3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_pages > 0
    engine.add_request("queued", prompt_ids[0], GREEDY16)
    engine.abort("run")
    engine.abort("queued")
    engine.abort("never-existed")
    outs = engine.step()
    by_id = {o.request_id: o for o in outs}
    assert by_id["run"].finished and by_id["run"].finish_reason == "abort"
    assert by_id["run"].usage.completion_tokens == 2
    assert by_id["queued"].finish_reason == "abort"
    assert_idle(engine)
    # the id can be reused once finished
    engine.add_request("run", prompt_ids[0], SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.step()[0].finished


def test_stop_string_cuts_text_and_never_streams_it(engine, prompt_ids):
    prompt = prompt_ids[1]
    [ref] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=40))
    words = ref.text.split()
    stop = words[len(words) // 2]
    cut = ref.text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=(stop, "never-matches-zzz"))
    outs = asyncio.run(collect(engine, prompt, params))
    text = "".join(o.new_text for o in outs)
    assert text == ref.text[:cut]
    assert outs[-1].finish_reason == "stop"
    assert all(stop not in "".join(o.new_text for o in outs[: i + 1]) for i in range(len(outs)))
    assert len(outs) < 40


def test_stop_token_ids_and_max_tokens(engine, prompt_ids):
    [ref] = engine.generate_sync([prompt_ids[2]], SamplingParams(temperature=0.0, max_tokens=20))
    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    [out] = engine.generate_sync([prompt_ids[2]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_id,)))
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    [short] = engine.generate_sync([prompt_ids[2]], SamplingParams(temperature=0.0, max_tokens=3))
    assert short.token_ids == ref.token_ids[:3] and short.finish_reason == "length"


def test_eos_stops_unless_ignored(engine, prompt_ids):
    outs = engine.generate_sync(prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))
    i = next(i for i, o in enumerate(outs) if o.finish_reason == "stop")  # some prompts end with EOS
    ref = outs[i].token_ids
    assert ref[-1] in engine.eos_token_ids and len(ref) < 64
    [more] = engine.generate_sync(
        [prompt_ids[i]], SamplingParams(temperature=0.0, max_tokens=len(ref) + 5, ignore_eos=True)
    )
    assert more.token_ids[: len(ref)] == ref and len(more.token_ids) == len(ref) + 5
    assert more.finish_reason == "length"


def test_logprobs(engine, hf_model, prompt_ids):
    prompt = prompt_ids[0]
    [out] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok == lp.top_token_ids[0]
        assert lp.logprob == pytest.approx(lp.top_logprobs[0]) and len(lp.top_logprobs) == 3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert out.logprobs[0].logprob == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-4)
    [zero] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    assert zero.logprobs[0].top_token_ids == [] and zero.logprobs[0].logprob < 0
    [none] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert none.logprobs is None


def test_seeded_sampling_is_reproducible_alone_and_batched(engine, prompt_ids):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=1234, max_tokens=12)
    [a] = engine.generate_sync([prompt_ids[0]], params)
    [b] = engine.generate_sync([prompt_ids[0]], params)
    assert a.token_ids == b.token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batched = engine.generate_sync([prompt_ids[1], prompt_ids[0], prompt_ids[2]], [others, params, others])
    assert batched[1].token_ids == a.token_ids
    [c] = engine.generate_sync([prompt_ids[0]], SamplingParams(temperature=0.9, seed=99, max_tokens=12))
    assert c.token_ids != a.token_ids  # another seed, another sample (12 tokens at T=0.9)


def test_top_k_one_is_greedy(engine, prompt_ids):
    [g] = engine.generate_sync([prompt_ids[4]], GREEDY16)
    [k1] = engine.generate_sync([prompt_ids[4]], SamplingParams(temperature=1.5, top_k=1, max_tokens=16))
    assert g.token_ids == k1.token_ids


def test_usage_counts_cached_prompt_tokens(engine, prompt_ids):
    engine.block_manager.evict_all_cached()
    prompt = prompt_ids[3]  # ~250 tokens
    [cold] = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    [warm] = engine.generate_sync([prompt + [13, 14, 15]], SamplingParams(temperature=0.0, max_tokens=2))
    assert cold.usage.prompt_tokens == len(prompt) and cold.usage.cached_prompt_tokens == 0
    # its full pages, then the rows of cold's tail as far as the tokens agree: the whole prompt
    assert warm.usage.cached_prompt_tokens == len(prompt)
    assert warm.usage.completion_tokens == 2


def test_text_prompt_equals_token_prompt(engine, tokenizer):
    text = "The capital of France is"
    [a] = engine.generate_sync([text], GREEDY16)
    [b] = engine.generate_sync([tokenizer.encode(text)], GREEDY16)
    assert a.token_ids == b.token_ids and a.usage.prompt_tokens == len(tokenizer.encode(text))


def test_bad_requests_raise_request_error(engine):
    with pytest.raises(RequestError):
        engine.add_request("e1", [], GREEDY16)
    with pytest.raises(RequestError):
        engine.add_request("e2", [engine.model_config.vocab_size], GREEDY16)
    with pytest.raises(RequestError):
        engine.add_request("e3", [-1], GREEDY16)
    with pytest.raises(RequestError, match="context length"):
        engine.add_request("e4", [1] * engine.max_model_len, GREEDY16)
    engine.add_request("dup", [1, 2, 3], GREEDY16)
    with pytest.raises(RequestError, match="already"):
        engine.add_request("dup", [1, 2, 3], GREEDY16)
    engine.abort("dup")
    engine.step()
    assert issubclass(RequestError, ValueError)
    assert_idle(engine)


def test_sampling_params_validation_and_wire_form():
    for bad in (
        dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.5),
        dict(max_tokens=0), dict(logprobs=21), dict(seed=-1), dict(stop=("",)), dict(stop_token_ids=(-3,)),
    ):
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**bad)
    assert issubclass(InvalidSamplingParams, ValueError)
    p = SamplingParams(temperature=0.5, stop=("\n\n",), seed=3, logprobs=2)
    assert msgspec.json.decode(msgspec.json.encode(p), type=SamplingParams) == p
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 2.0}', type=SamplingParams)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


def test_engine_config_validation():
    for bad in (
        dict(page_size=0), dict(dtype="float8"), dict(kv_cache_dtype="int4"), dict(device="tpu"),
        dict(kv_cache_memory=0.0), dict(mem_fraction=1.5), dict(max_running_requests=0),
        dict(max_prefill_tokens=0), dict(chunked_prefill_size=-1), dict(max_model_len=1),
    ):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
    assert EngineConfig().effective_mem_fraction == 0.25
    with pytest.raises(dataclasses_frozen_error()):
        EngineConfig().page_size = 8


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_engine_config_fields_are_cli_friendly():
    import dataclasses
    import typing

    from services.config import field_docs

    docs = field_docs(EngineConfig)
    hints = typing.get_type_hints(EngineConfig)
    simple = {str, int, float, bool, str | None, int | None, float | None}
    for f in dataclasses.fields(EngineConfig):
        assert hints[f.name] in simple, f.name
        assert docs.get(f.name), f"{f.name} has no docstring"


def test_garbage_in_free_pages_never_leaks(engine, prompt_ids):
    """Never-written pool memory can hold NaN; padded and stale slots must not matter."""
    prompts = [prompt_ids[0], prompt_ids[1], prompt_ids[3]]  # different lengths: padded decode rows
    refs = [o.token_ids for o in engine.generate_sync(prompts, GREEDY16)]
    engine.block_manager.evict_all_cached()
    engine.kv_pool.data.fill_(float("nan"))
    outs = engine.generate_sync(prompts, GREEDY16)
    assert [o.token_ids for o in outs] == refs
    engine.block_manager.evict_all_cached()
    engine.kv_pool.data.zero_()
