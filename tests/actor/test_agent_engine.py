"""Issue 28's engine half through the services (in-memory bus, real tokenizer, router, workers and
engines): forced tool calls and response_format through the official client, n choices sharing the
prompt's pages (HTTP choices, NATS chunks with ``index``), and a constrained, penalised stream that
migrates mid-way and still ends in the undisturbed, valid JSON.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from bus import errors
from bus.subjects import GENERATE, GENERATE_ONCE
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest, JsonSchemaFormat, ResponseFormat
from services.gateway import GatewayConfig
from services.router import RouterConfig
from tests.actor.test_gateway_actor import (  # noqa: F401
    core,
    cut_off_at_token,
    engine,
    engine_is_idle,
    eventually,
    running,
    second_engine,
    worker_config,
)

pytestmark = pytest.mark.anyio

ROUTER = RouterConfig(policy="round_robin")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
                                         "size": {"enum": ["small", "big"]},
                                         "rivers": {"type": "array", "items": {"enum": ["Seine", "Loire", "Rhone"]},
                                                    "maxItems": 2}},
        "required": ["city", "size", "rivers"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer with a tool call."}]


@pytest.fixture
async def cluster(core, engine, worker_config):
    async with running(core, engine, worker_config, router=ROUTER) as c:
        yield c


async def test_forced_tool_calls_and_json_schema_through_the_openai_client(cluster):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    async with cluster.openai() as client:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            reply = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                parallel_tool_calls=False, max_tokens=60, temperature=0.0)
            out = reply.choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content is None, out
            [call] = out.message.tool_calls
            if choice != "required":
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
            # streamed: the grammar guarantees the call, so its arguments arrive piece by piece (OpenAI's
            # stream) after a first delta with its id and name; joined, the same call as above
            deltas = [d async for c in await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                parallel_tool_calls=False, max_tokens=60, temperature=0.0, stream=True)
                for d in (c.choices[0].delta.tool_calls or []) if c.choices]
            assert deltas[0].id and deltas[0].function.name == call.function.name
            pieces = [d.function.arguments for d in deltas[1:] if d.function.arguments]
            assert len(pieces) > 1 and "".join(pieces) == call.function.arguments, pieces
        stream = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe a city as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
            max_tokens=80, temperature=0.0, stream=True, presence_penalty=0.3, logit_bias={"28": -2})
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        jsonschema.validate(json.loads(text), CITY)
    await engine_is_idle(cluster)


async def test_n_choices_share_the_prompts_pages_on_http_and_nats(cluster, core):
    prompt = "Here is a long note about rivers and cities, " * 6 + "and now a short poem about the sea:"
    num_prompt = len(core.encode_batch([prompt], True)[0])
    full_pages = (num_prompt - 1) // 16 * 16
    sampling = SamplingParams(temperature=1.0, seed=11, max_tokens=6, n=3)
    chunks = []
    async with cluster.client.stream(GENERATE, GenerateRequest(prompt=prompt, sampling=sampling), timeout=60) as s:
        async for chunk in s:
            chunks.append(chunk)
    finals = {c.index: c for c in chunks if c.finish_reason is not None}
    assert sorted(finals) == [0, 1, 2] and all(c.usage.completion_tokens == 6 for c in finals.values())
    # choices 1 and 2 started on choice 0's worker once its prompt was in: every full page was a hit
    assert all(finals[i].usage.cached_prompt_tokens >= full_pages > 0 for i in (1, 2)), finals
    by_choice = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
    one = await cluster.client.request(GENERATE_ONCE, GenerateRequest(
        prompt=prompt, sampling=SamplingParams(temperature=1.0, seed=12, max_tokens=6)), timeout=60)
    assert one.token_ids == by_choice[1]  # choice i draws from seed + i
    async with cluster.openai() as client:
        reply = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, n=3, seed=11,
                                                max_tokens=6, temperature=1.0)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert [c.text for c in reply.choices] == [core.decode_batch([by_choice[i]], True)[0] for i in range(3)]
        assert reply.usage.prompt_tokens == num_prompt and reply.usage.completion_tokens == 18
        stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", n=2, max_tokens=4,
                                                      messages=[{"role": "user", "content": prompt}],
                                                      stream=True, stream_options={"include_usage": True})
        events = [c async for c in stream]
        assert {c.choices[0].index for c in events if c.choices} == {0, 1}
        assert sum(1 for c in events if c.choices and c.choices[0].finish_reason) == 2
        assert events[-1].usage.completion_tokens == 8
    with pytest.raises(errors.InvalidArgument, match="needs a stream"):
        await cluster.client.request(GENERATE_ONCE, GenerateRequest(prompt=prompt, sampling=sampling),
                                     timeout=60)
    await engine_is_idle(cluster)


async def test_a_constrained_stream_migrated_mid_way_ends_in_the_same_valid_json(core, engine, second_engine,
                                                                                   worker_config):
    sampling = SamplingParams(temperature=0.0, max_tokens=120, frequency_penalty=0.4, logprobs=3)
    req = GenerateRequest(messages=None, prompt="A city as JSON:", sampling=sampling,
                          response_format=ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=CITY)))
    gateway = GatewayConfig(http_port=0, worker_ttl=1.0)
    async with running(core, engine, worker_config, gateway=gateway, router=RouterConfig(worker_ttl=1.0),
                       more_engines=(second_engine,)) as cluster:
        want = await cluster.client.request(GENERATE_ONCE, req, timeout=60)
        jsonschema.validate(json.loads(want.text), CITY)
        assert len(want.token_ids) > 8
        dead = cut_off_at_token(cluster.buses, 6)
        chunks = []
        async with cluster.client.stream(GENERATE, req, timeout=60) as stream:
            async for chunk in stream:
                chunks.append(chunk)
        assert dead and cluster.gateway.pipeline.num_migrations == 1
        got = [t for c in chunks for t in c.token_ids]
        text = "".join(c.text for c in chunks)
        jsonschema.validate(json.loads(text), CITY)  # the new worker rebuilt the grammar from the 6 tokens
        if got != want.token_ids:  # a recomputed prompt rounds differently: only a near-tie may flip
            k = next(k for k, (a, b) in enumerate(zip(want.token_ids, got)) if a != b)
            top = dict(zip(want.logprobs[k].top_token_ids, want.logprobs[k].top_logprobs))
            seen = want.token_ids[:k]
            gap = (top[want.token_ids[k]] - 0.4 * seen.count(want.token_ids[k])) - \
                  (top.get(got[k], float("-inf")) - 0.4 * seen.count(got[k]))
            assert abs(gap) < 1e-3, (k, gap)
        assert chunks[-1].finish_reason == "stop"
        for w in [cluster.worker, *cluster.more_workers]:
            await eventually(lambda: not w.engine.has_unfinished(), 10.0, "aborted")
            await eventually(lambda: w.engine.block_manager.num_free_pages == cluster.free_pages, 10.0, "pages free")
