"""One request the engine cannot serve fails alone; the batch it was in goes on unchanged.

Bad parameters are refused where the request is built (SamplingParams bounds); these tests
also force a bad value past that check, as a message from an older or buggy sender would
arrive, to show that the step itself contains the failure.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from schemas.engine import MAX_TOP_K, InvalidSamplingParams, SamplingParams
from services.engine import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=8)


def _forced(**fields) -> SamplingParams:
    """SamplingParams holding values its own checks refuse (a sender that skipped them)."""
    params = SamplingParams(temperature=0.7, max_tokens=8)
    for name, value in fields.items():
        msgspec.structs.force_setattr(params, name, value)
    return params


def assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("bad", [
    dict(top_k=10**12), dict(top_k=MAX_TOP_K + 1), dict(temperature=math.inf), dict(temperature=math.nan),
    dict(stop=("x",) * 17), dict(stop=("y" * 257,)), dict(stop_token_ids=tuple(range(257))),
    dict(stop_token_ids=(2**40,)), dict(max_tokens=2**70),
])
def test_sampling_params_bounds_refuse_what_the_sampler_cannot_take(bad):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**bad)
    name = next(iter(bad))
    with pytest.raises(msgspec.ValidationError, match=name):
        msgspec.json.decode(msgspec.json.encode(_forced(**bad)), type=SamplingParams)


def test_huge_top_k_is_off_not_an_overflow(engine, prompt_ids):
    """top_k >= the vocabulary means off: the largest allowed one and one forced past the bound both sample."""
    largest = SamplingParams(temperature=0.7, top_k=MAX_TOP_K, seed=1, max_tokens=8)
    outs = engine.generate_sync([prompt_ids[0]] * 2, [largest, _forced(top_k=10**12, seed=1)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8
    assert_idle(engine)


def test_sampling_failure_fails_one_request_the_batch_goes_on(engine, prompt_ids):
    prompts = prompt_ids[:3]
    alone = engine.generate_sync(prompts, [GREEDY, SEEDED, GREEDY])
    ids = ["good-0", "good-1", "bad", "good-2"]
    params = [GREEDY, SEEDED, _forced(seed=2**64), GREEDY]
    for rid, prompt, p in zip(ids, [prompts[0], prompts[1], prompts[2], prompts[2]], params):
        engine.add_request(rid, prompt, p)
    tokens = {rid: [] for rid in ids}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "abort"
    assert "bad" in final["bad"].error and "sampler" in final["bad"].error
    assert tokens["bad"] == []
    assert [tokens[r] for r in ("good-0", "good-1", "good-2")] == [a.token_ids for a in alone]
    assert all(final[r].error is None for r in ("good-0", "good-1", "good-2"))
    assert_idle(engine)


def test_async_stream_of_the_failed_request_raises_request_error(engine, prompt_ids):
    async def run(prompt, params, rid):
        return [out async for out in engine.generate(prompt, params, request_id=rid)]

    async def main():
        return await asyncio.gather(run(prompt_ids[0], GREEDY, "a-good"),
                                    run(prompt_ids[1], _forced(seed=2**64), "a-bad"), return_exceptions=True)

    good, bad = asyncio.run(main())
    assert isinstance(bad, RequestError) and "a-bad" in str(bad)
    assert not isinstance(good, BaseException) and good[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in good) == 8
    assert engine.block_manager.num_used_pages == 0
