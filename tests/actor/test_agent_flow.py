"""Tools end to end on the in-memory bus with the real tokenizer, router and worker (real engine).

The default model (SmolLM2-135M-Instruct) has no tool template, so kvbus renders tools in its fallback
format (docs/agents.md), and the model is not tuned for tools: asked cold, it answers in prose. Shown
the convention three times in the history, it makes the call itself under greedy decoding (checked
below against its raw tokens), so the tests here see a real call parsed from real output, and
cannot pass on an empty reply. Forcing a call (tool_choice required or named) is constrained decoding,
the engine half of issue 28: tests/actor/test_agent_engine.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from bus import errors
from bus.subjects import GENERATE, GENERATE_ONCE
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from schemas.tokenizer import ChatMessage, Tool, ToolCall, ToolCallFunction, ToolFunction
from services.agent.output import merge_tool_calls
from services.gateway import GatewayConfig
from services.router import RouterConfig
from tests.actor.test_gateway_actor import core, engine, engine_is_idle, running, worker_config  # noqa: F401

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city"}},
                   "required": ["location"]}}}
TOOLS = [Tool(function=ToolFunction(**WEATHER["function"]))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=60)
ROUTER = RouterConfig(policy="round_robin")
"""One worker: where a request goes does not matter here."""


def shown(city: str, n: int, temperature: int) -> list[dict]:
    """One earlier turn of the conversation: a question, the call, its result, the answer."""
    call = {"id": f"call_{n}", "type": "function",
            "function": {"name": "get_current_weather", "arguments": json.dumps({"location": city})}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": json.dumps({"temperature": temperature})},
            {"role": "assistant", "content": f"It is {temperature} degrees in {city}."}]


HISTORY = [*shown("London", 1, 15), *shown("Berlin", 2, 18), *shown("Rome", 3, 25),
           {"role": "user", "content": "What is the weather in Paris?"}]


def chat_messages(messages: list[dict]) -> list[ChatMessage]:
    out = []
    for m in messages:
        calls = [ToolCall(id=c["id"], function=ToolCallFunction(**c["function"])) for c in m.get("tool_calls") or ()]
        out.append(ChatMessage(role=m["role"], content=m.get("content") or ("" if m["role"] == "assistant" else None),
                               tool_calls=calls or None, tool_call_id=m.get("tool_call_id")))
    return out


@pytest.fixture
async def cluster(core, engine, worker_config):
    async with running(core, engine, worker_config, router=ROUTER) as c:
        yield c


async def test_the_model_calls_the_tool_and_nats_gets_the_call(cluster, core):
    req = GenerateRequest(messages=chat_messages(HISTORY), tools=TOOLS, sampling=GREEDY)
    reply = await cluster.client.request(GENERATE_ONCE, req, timeout=60)
    raw = core.decode_batch([reply.token_ids], True)[0]
    assert "<tool_call>" in raw, f"the model did not call the tool: {raw!r}"  # the premise of this file
    [call] = reply.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_current_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"}
    assert reply.text == "" and reply.finish_reason == "tool_calls"
    # streamed: the same call, its id and name before its arguments, the finish reason on the last chunk
    async with cluster.client.stream(GENERATE, req, timeout=60) as stream:
        chunks = [c async for c in stream]
    deltas = [d for c in chunks for d in c.tool_calls or ()]
    assert deltas[0].id and deltas[0].name == "get_current_weather" and deltas[0].arguments == ""
    [streamed] = merge_tool_calls(deltas)
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"
    assert [t for c in chunks for t in c.token_ids] == reply.token_ids
    # tool_choice none: the tools are still shown, the reply is not parsed: the call stays text
    reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(
        messages=chat_messages(HISTORY), tools=TOOLS, tool_choice="none", sampling=GREEDY), timeout=60)
    assert reply.tool_calls is None and reply.text == raw and reply.finish_reason == "stop"


@pytest.mark.parametrize("streamed", [False, True])
async def test_openai_client_tool_loop(cluster, streamed):
    """Call, tool result, answer: the official client drives the loop as an agent would."""
    messages = list(HISTORY)
    async with cluster.openai() as client:
        kwargs = dict(model="SmolLM2-135M-Instruct", tools=[WEATHER], temperature=0, max_tokens=60)
        if streamed:
            stream = await client.chat.completions.create(messages=messages, stream=True,
                                                          stream_options={"include_usage": True}, **kwargs)
            events = [e async for e in stream]
            calls: dict[int, dict] = {}
            for e in events:
                for d in (e.choices[0].delta.tool_calls or []) if e.choices else []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    call["arguments"] += d.function.arguments or ""
            assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
            assert events[-1].choices == [] and events[-1].usage.completion_tokens > 0  # include_usage
            assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == ""
            [call] = calls.values()
            call_id, name, arguments = call["id"], call["name"], call["arguments"]
        else:
            first = await client.chat.completions.create(messages=messages, **kwargs)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            [tool_call] = choice.message.tool_calls
            call_id, name, arguments = tool_call.id, tool_call.function.name, tool_call.function.arguments
        assert call_id.startswith("call_") and name == "get_current_weather"
        assert json.loads(arguments) == {"location": "Paris"}
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21})}]
        answer = await client.chat.completions.create(messages=messages, **kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "21" in choice.message.content and "Paris" in choice.message.content


async def test_bad_agent_input_is_refused_on_http_and_nats_alike(cluster):
    orphan = [*HISTORY[:1], {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]
    bad_schema = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "objekt"}}}
    cases = [
        ({"messages": orphan}, "messages[1].tool_call_id", "matches no tool call"),
        ({"messages": HISTORY, "tools": [bad_schema]}, "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"messages": HISTORY, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name", "not in tools"),
        ({"messages": HISTORY, "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema", "JSON Schema"),
    ]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        for body, param, match in cases:
            response = await http.post("/v1/chat/completions", json={**body, "max_tokens": 4})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
            assert match in response.json()["error"]["message"]
            nats = GenerateRequest(messages=chat_messages(body["messages"]),
                                   tools=[Tool(function=ToolFunction(**t["function"])) for t in body.get("tools", [])]
                                   or None, sampling=SamplingParams(max_tokens=4),
                                   tool_choice=body.get("tool_choice") if isinstance(body.get("tool_choice"), str)
                                   else None)
            if "response_format" in body or "tool_choice" in body:
                continue  # (their NATS shape: tests/unit/test_agent_mapping.py)
            with pytest.raises(errors.InvalidArgument, match=match):
                await cluster.client.request(GENERATE_ONCE, nats, timeout=60)
    await engine_is_idle(cluster)


async def test_reasoning_parser_splits_the_reply(core, engine, worker_config):
    """deepseek_r1: the reply is reasoning until </think>; SmolLM2 never writes one, so all of it is."""
    config = GatewayConfig(http_port=0, reasoning_parser="deepseek_r1")
    async with running(core, engine, worker_config, gateway=config, router=ROUTER) as cluster:
        messages = [{"role": "user", "content": "Name three colours."}]
        async with cluster.openai() as client:
            whole = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                         temperature=0, max_tokens=12)
            stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                          temperature=0, max_tokens=12, stream=True)
            events = [e async for e in stream]
        reasoning = whole.choices[0].message.model_extra["reasoning_content"]
        assert reasoning and whole.choices[0].message.content is None
        streamed = "".join((e.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for e in events)
        assert streamed == reasoning
        reply = await cluster.client.request(GENERATE_ONCE, GenerateRequest(
            messages=[ChatMessage(role="user", content="Name three colours.")],
            sampling=SamplingParams(temperature=0, max_tokens=12)), timeout=60)
        assert reply.reasoning_content == reasoning and reply.text == ""
        assert core.decode_batch([reply.token_ids], True)[0] == reasoning
