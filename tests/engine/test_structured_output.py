"""The logits-processor chain in the real engine (SmolLM2-135M): structured output at temperature 1.0,
forced tool calls, and composition with speculative decoding, disaggregation and migration; a
grammar that fails fails its request alone.

One plain engine (the session's) and one speculating engine (n-gram drafts for sampled requests too)
serve the whole module.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from schemas.engine import SamplingParams, StructuredOutput
from schemas.tokenizer import Tool, ToolFunction
from services.agent.grammar import json_schema_constraint
from services.agent.output import merge_tool_calls
from services.agent.tool_parsers import TOOL_PARSERS
from tests.engine.conftest import make_engine

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id", "vip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["small", "old", "loud"]}, "maxItems": 2},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
"""Nested objects, enums, arrays, bounds, required fields; every instance is under ~80 tokens, so
max_tokens=160 lets each generation complete."""
PET_CONSTRAINT = json_schema_constraint(PET)
EXAMPLE = '{"name":"Rex","kind":"dog","age":3,"owner":{"id":7,"vip":true},"tags":["old"]}'
WEATHER = Tool(function=ToolFunction(name="get_weather", description="Weather in a city", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
TIME = Tool(function=ToolFunction(name="get_time", parameters={
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}))


@pytest.fixture(scope="module")
def spec_engine(model_dir):
    return make_engine(model_dir, speculative_method="ngram", num_speculative_tokens=4,
                       speculative_greedy_only=False)


@pytest.fixture(scope="module")
def pet_prompt(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe a pet as JSON, like {EXAMPLE}. Another one:"}],
        add_generation_prompt=True, tokenize=True, return_dict=False))


def assert_idle(engine) -> None:
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0


def valid_pet(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PET)
    return value


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram-drafts"])
def test_fifty_seeded_generations_at_temperature_one_all_validate(engine, spec_engine, pet_prompt, speculative):
    eng = spec_engine if speculative else engine
    drafted = eng.stats.num_drafted_tokens
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_output=PET_CONSTRAINT)
              for i in range(50)]
    # with drafts, 25 at a time: a step past SPEC_MAX_ROWS (48) decoding rows has no room for drafts
    size = 25 if speculative else 50
    outs = [o for i in range(0, 50, size) for o in eng.generate_sync([pet_prompt] * size, params[i : i + size])]
    pets = [valid_pet(o.text) for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)  # complete: the grammar ended them with EOS
    assert len({json.dumps(p, sort_keys=True) for p in pets}) > 10  # sampled, not one answer 50 times
    if speculative:
        assert eng.stats.num_drafted_tokens > drafted  # the drafts ran (and broke nothing)
    assert_idle(eng)


def test_greedy_rows_masked_only_when_the_grammar_refuses_the_argmax_give_the_same_tokens(engine, pet_prompt,
                                                                                           tokenizer):
    """A greedy constrained row gets its mask only when the grammar refuses the argmax (chain.py): the
    tokens are those of masking every step, a batch of eight included, with min_tokens and a bias."""
    chain = engine.runner.processors
    free = tokenizer.encode("Tell me about the sea.")
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=PET_CONSTRAINT),
              SamplingParams(temperature=0.0, max_tokens=120, structured_output=PET_CONSTRAINT, min_tokens=30,
                             logit_bias={28: 2.0}),
              *[SamplingParams(temperature=0.0, max_tokens=60, structured_output=json_schema_constraint(
                  {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10 + i}, "minItems": 3,
                   "maxItems": 5}))
                for i in range(6)]]
    prompts = [pet_prompt, pet_prompt] + [free] * 6
    checked, masked = chain.num_deferred_checked, chain.num_deferred_redrawn
    lazy = engine.generate_sync(prompts, params)
    checked, masked = chain.num_deferred_checked - checked, chain.num_deferred_redrawn - masked
    chain.defer_masks = False
    try:
        eager = engine.generate_sync(prompts, params)
    finally:
        chain.defer_masks = True
    for a, b in zip(lazy, eager):
        assert a.token_ids == b.token_ids, (a.text, b.text)
    valid_pet(lazy[0].text)
    assert 0 < masked < checked, (masked, checked)  # refusals were masked, and most steps needed no mask
    assert all(isinstance(json.loads(o.text), list) for o in lazy[2:])
    assert_idle(engine)


def test_greedy_is_the_same_with_speculation_for_constrained_and_penalised_requests(engine, spec_engine,
                                                                                      pet_prompt, tokenizer):
    repeat = tokenizer.encode("one two three four five six one two three four five six one two three four")
    cases = [
        (pet_prompt, SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT)),
        (pet_prompt, SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT,
                                    frequency_penalty=0.8, logit_bias={28: 3.0})),
        (repeat, SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.6, frequency_penalty=0.3)),
        (repeat, SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2, min_tokens=20)),
    ]
    prompts, params = [p for p, _ in cases], [s for _, s in cases]
    plain = engine.generate_sync(prompts, params)
    before = (spec_engine.stats.num_drafted_tokens, spec_engine.stats.num_accepted_tokens)
    speculated = spec_engine.generate_sync(prompts, params)
    for a, b in zip(plain, speculated):
        assert b.token_ids == a.token_ids, (a.text, b.text)
    valid_pet(plain[0].text)
    valid_pet(plain[1].text)
    drafted = spec_engine.stats.num_drafted_tokens - before[0]
    accepted = spec_engine.stats.num_accepted_tokens - before[1]
    assert drafted > accepted > 0, (drafted, accepted)  # drafts were verified, some accepted, some rejected
    assert len(plain[3].token_ids) >= 20


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_and_their_arguments_validate(engine, tokenizer, choice):
    parser = TOOL_PARSERS.get("hermes")
    tools = [WEATHER, TIME] if choice == "required" else [WEATHER]
    spec = parser.call_grammar(tools, parallel=False)  # (parallel calls: a call, then more or the end)
    prompt = tokenizer.encode("User: What is the weather like in Paris right now?\nAssistant:")
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=80,
                             structured_output=StructuredOutput(kind="lark", spec=spec)) for s in range(4)]
    for out in engine.generate_sync([prompt] * 4, params):
        assert out.finish_reason == "stop", out.text
        p = parser([WEATHER, TIME])
        calls = merge_tool_calls(p.feed(out.text).calls + p.finish().calls)
        assert len(calls) == 1, out.text
        for call in calls:
            tool = {t.function.name: t for t in tools}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool.function.parameters)
    assert_idle(engine)


def test_a_failing_grammar_fails_its_request_alone(engine, pet_prompt):
    """A grammar that does not compile, and one whose matcher errs mid-generation (llguidance's own
    error state, as when a limit is hit): each request fails alone, the batch's others finish."""
    broken = SamplingParams(max_tokens=20, structured_output=StructuredOutput(kind="lark", spec="start: /a(/"))
    good = SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT)
    doomed = SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT, presence_penalty=0.1)
    for rid, params in (("broken", broken), ("good", good), ("doomed", doomed), ("free", SamplingParams(
            temperature=0.0, max_tokens=12))):
        engine.add_request(rid, pet_prompt, params)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            doomed_seq = engine._seqs.get("doomed")
            if doomed_seq is not None and doomed_seq.num_output_tokens == 5:  # poke its matcher into error
                doomed_seq.logits_state.grammar.matcher._m.consume_token(pet_prompt[0])
    assert "structured output" in outs["broken"][-1].error and outs["broken"][-1].finish_reason == "abort"
    assert "structured output" in outs["doomed"][-1].error
    assert sum(len(o.new_token_ids) for o in outs["doomed"]) == 5  # nothing after the failure streamed
    assert outs["good"][-1].error is None and outs["good"][-1].finish_reason == "stop"
    valid_pet("".join(o.new_text for o in outs["good"]))
    assert outs["free"][-1].error is None and outs["free"][-1].finish_reason == "length"
    assert_idle(engine)


def test_prefill_worker_samples_the_first_token_under_the_grammar(engine, pet_prompt):
    """Disaggregation: the prefill-only request's first token obeys the grammar; the importing request
    rebuilds the matcher from it and finishes the same JSON as one engine alone."""
    params = SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT, presence_penalty=0.4)
    [whole] = engine.generate_sync([pet_prompt], params)
    engine.add_prefill_request("p", pet_prompt, params)
    while engine.has_unfinished():
        engine.step()
    result = engine.take_prefill_result("p")
    assert result.first_token_id == whole.token_ids[0]
    engine.add_prefilled_request("d", pet_prompt, result.first_token_id, result.kv, params,
                                 num_cached_tokens=result.num_cached_tokens)
    ids = []
    while engine.has_unfinished():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    assert ids == whole.token_ids
    valid_pet(whole.text)
    assert_idle(engine)


def test_a_moved_stream_rebuilds_grammar_and_penalties_from_its_prior_output(engine, pet_prompt):
    """What a migration sends: prompt + the output so far with num_prior_output_tokens naming it, and
    max_tokens less it. The continuation is the undisturbed one and the whole is valid."""
    params = SamplingParams(temperature=0.0, max_tokens=160, structured_output=PET_CONSTRAINT,
                            frequency_penalty=0.5, logit_bias={28: 2.0}, logprobs=5)
    [whole] = engine.generate_sync([pet_prompt], params)
    for k in (1, 9):
        moved = SamplingParams(temperature=0.0, max_tokens=160 - k, structured_output=PET_CONSTRAINT,
                               frequency_penalty=0.5, logit_bias={28: 2.0}, num_prior_output_tokens=k)
        [rest] = engine.generate_sync([pet_prompt + whole.token_ids[:k]], moved)
        got = whole.token_ids[:k] + rest.token_ids
        if got != whole.token_ids:  # a recomputed prompt rounds differently from decoding: only a near-tie may flip
            j = next(j for j, (a, b) in enumerate(zip(whole.token_ids, got)) if a != b)
            top = dict(zip(whole.logprobs[j].top_token_ids, whole.logprobs[j].top_logprobs))
            seen = whole.token_ids[:j]
            gap = (top[whole.token_ids[j]] - 0.5 * seen.count(whole.token_ids[j])) - \
                  (top.get(got[j], float("-inf")) - 0.5 * seen.count(got[j]))  # (the bias: not on these ids)
            assert abs(gap) < 1e-3, (k, j, gap)
        valid_pet(tokenizer_free_text(engine, got))
    assert_idle(engine)


def tokenizer_free_text(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)
