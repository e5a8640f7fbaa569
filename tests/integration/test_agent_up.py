"""Tools through ``kvbus up`` (real processes, a real nats-server): the official ``openai`` client's
tool loop over HTTP, and the same call from a plain JSON body on NATS, as a client in any language
would send it. The conversation is tests/actor/test_agent_flow.py's: the default model makes the call
itself under greedy decoding (that file says why), so a call is parsed from real output.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from bus.subjects import GENERATE_ONCE
from services.local_system import LocalSystem
from tests.actor.test_agent_flow import HISTORY, WEATHER

pytestmark = [pytest.mark.slow, pytest.mark.integration]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def system(model_dir):
    with LocalSystem("--aggregated", model_dir=model_dir) as system:
        yield system


def test_openai_client_tool_loop_through_kvbus_up(system):
    client = openai.OpenAI(base_url=system.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=60)
    first = client.chat.completions.create(messages=HISTORY, logprobs=True, **kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_current_weather" and json.loads(call.function.arguments) == {"location": "Paris"}
    assert len(choice.logprobs.content) == first.usage.completion_tokens  # the call's tokens have logprobs
    # streamed, with usage at the end: the same call, id and name first
    events = list(client.chat.completions.create(messages=HISTORY, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    deltas = [d for e in events if e.choices for d in e.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_current_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
    assert events[-1].usage.completion_tokens == first.usage.completion_tokens
    # the tool's result goes back; the model answers with it
    messages = [*HISTORY, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    answer = client.chat.completions.create(messages=messages, **kwargs).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls and "21" in answer.message.content


def test_a_plain_json_client_gets_the_call_on_nats(system):
    """A NATS client in any language: JSON in, JSON out, OpenAI's shapes for tools and calls."""
    import nats

    body = {"messages": [{k: v for k, v in m.items() if v is not None} for m in HISTORY], "tools": [WEATHER],
            "sampling": {"temperature": 0, "max_tokens": 60}}

    async def call() -> dict:
        nc = await nats.connect(system.nats_url)
        try:
            msg = await nc.request(GENERATE_ONCE.template, json.dumps(body).encode(), timeout=120,
                                   headers={"Content-Type": "application/json"})
        finally:
            await nc.close()
        assert not msg.headers or "Kvbus-Error-Code" not in msg.headers, msg.headers
        return json.loads(msg.data)

    reply = asyncio.run(call())
    assert reply["finish_reason"] == "tool_calls" and reply["text"] == ""
    [tool_call] = reply["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"]["name"] == "get_current_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"location": "Paris"}
