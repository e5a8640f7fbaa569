"""Agent fields at the gateway (no bus): OpenAI bodies -> GenerateRequest, the checks every caller gets
(HTTP and NATS), refusals of what the engine does not serve yet, and the OpenAI reply shapes."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from schemas.engine import SamplingParams, StructuredOutput
from schemas.generate import GenerateReply, GenerateRequest, ResponseFormat, ToolCallDelta
from schemas.tokenizer import ChatMessage, Tool, ToolCall, ToolCallFunction, ToolFunction
from schemas.engine import Usage
from schemas.generate import GenerateChunk
from services.config import ConfigError
from services.gateway import engine_features
from services.gateway.agent_request import prepare
from services.gateway.config import GatewayConfig
from services.gateway.openai_format import ChatCompletions
from services.gateway.openai_mapping import BadParam, chat_to_generate, completion_to_generate, decode_body, \
    error_response
from services.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
CONFIG = GatewayConfig(http_port=0)


def chat(**body) -> ChatCompletionRequest:
    body.setdefault("messages", HISTORY)
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def gen(**body) -> GenerateRequest:
    """Through the HTTP mapping, then the checks the pipeline runs for every caller."""
    return prepare(chat_to_generate(chat(**body)), CONFIG)


def test_tools_and_history_travel_to_the_generate_request():
    req = gen(tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
              chat_template_kwargs={"enable_thinking": False})
    assert req.tools == [Tool(function=ToolFunction(**WEATHER["function"]))]
    assert req.tool_choice == "auto" and req.parallel_tool_calls is False
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert req.messages[1] == ChatMessage(role="assistant", content="", tool_calls=[
        ToolCall(id="call_1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Oslo"}'))])
    assert req.messages[2] == ChatMessage(role="tool", content='{"temp": 3}', tool_call_id="call_1")
    assert req.sampling.structured_output is None
    assert gen(tools=[WEATHER]).parallel_tool_calls is True  # OpenAI's default


# --- bad input: a 400 naming the field ---------------------------------------------------------

BAD = [
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters", "not a valid JSON Schema"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"properties": []}}}]},
     "tools[0].function.parameters", "not a valid JSON Schema"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "must describe an object"),
    ({"tools": [{**WEATHER, "function": {"name": "has space"}}]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [{**WEATHER, "type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"messages": [*HISTORY[:2], {**HISTORY[2], "tool_call_id": "call_9"}]}, "messages[2].tool_call_id",
     "matches no tool call"),
    ({"messages": [HISTORY[0], HISTORY[2]]}, "messages[1].tool_call_id", "matches no tool call"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "may not set"),
    ({"chat_template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs.not an identifier", "may not set"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", r"\[-100, 100\]"),
    ({"presence_penalty": 3}, "presence_penalty", r"\[-2, 2\]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "<= max_tokens"),
    ({"nvext": {"agent_hints": {"speculative_prefill": True}}}, "nvext.agent_hints.speculative_prefill",
     "not supported"),
    ({"nvext": {"agent_hints": {"strict_priority": 1}}}, "nvext.agent_hints.strict_priority", "not supported"),
    ({"nvext": {"agent_hints": {"priority": 1}}, "priority": 2}, "nvext.agent_hints.priority", "one of"),
]


@pytest.mark.parametrize("body,param,match", BAD)
def test_bad_agent_input_is_a_400_naming_the_field(body, param, match):
    with pytest.raises(BadParam, match=match) as info:
        gen(**body)
    assert info.value.param == param
    status, err = error_response(info.value)
    assert status == 400 and err.error.param == param


def test_nvext_unknown_fields_are_unrecognized():
    with pytest.raises(BadParam, match="Unrecognized request argument supplied: nvext.annotations") as info:
        chat(nvext={"annotations": ["x"]})
    assert info.value.param == "nvext.annotations"


def test_nats_callers_get_the_same_checks():
    tools = [Tool(function=ToolFunction(name="get_weather", parameters={"type": "objekt"}))]
    messages = [ChatMessage(role="user", content="hi")]
    with pytest.raises(BadParam, match="not a valid JSON Schema") as info:
        prepare(GenerateRequest(messages=messages, tools=tools), CONFIG)
    assert info.value.param == "tools[0].function.parameters"
    orphan = [ChatMessage(role="user", content="hi"), ChatMessage(role="tool", content="3", tool_call_id="c1")]
    with pytest.raises(BadParam) as info:
        prepare(GenerateRequest(messages=orphan), CONFIG)
    assert info.value.param == "messages[1].tool_call_id"
    with pytest.raises(BadParam, match="need messages") as info:
        prepare(GenerateRequest(prompt="x", tools=[Tool(function=ToolFunction(name="f"))]), CONFIG)
    assert info.value.param == "tools"
    with pytest.raises(ValueError, match="needs tool_call_id"):  # the wire schema itself
        ChatMessage(role="tool", content="3")


# --- the engine-side extras: honoured ones reach the worker; what is not served is refused by name ---

AGENT_EXTRAS = [
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty", "frequency_penalty"),
    ({"repetition_penalty": 1.1}, "repetition_penalty", "repetition_penalty"),
    ({"logit_bias": {"42": -100}}, "logit_bias", "logit_bias"),
    ({"min_tokens": 3}, "min_tokens", "min_tokens"),
    ({"priority": -5}, "priority", "priority"),
    ({"nvext": {"agent_hints": {"priority": 5}}}, "nvext.agent_hints.priority", "priority"),
    ({"nvext": {"agent_hints": {"osl": 512}}}, "nvext.agent_hints.osl", "osl"),
    ({"response_format": {"type": "json_object"}}, "response_format", "structured_output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}},
     "response_format", "structured_output"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "structured_output"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "structured_output"),
]
UNSERVED = [case for case in AGENT_EXTRAS if not engine_features.HONOURED[case[2]]]


@pytest.mark.parametrize("body,param,feature", UNSERVED)
def test_unserved_parameters_are_refused_by_name(body, param, feature):
    with pytest.raises(BadParam, match="not supported yet") as info:
        gen(**body)
    assert info.value.param == param
    assert engine_features.HONOURED[feature] is False


def test_what_stays_refused_is_the_routers_osl():
    assert [feature for _, _, feature in UNSERVED] == ["osl"]


@pytest.mark.parametrize("body,param,feature", AGENT_EXTRAS)
def test_honoured_features_go_through_to_the_worker(monkeypatch, body, param, feature):
    monkeypatch.setitem(engine_features.HONOURED, feature, True)
    if feature == "osl":  # the router's: the gateway has nowhere to put it until the router takes it
        return
    req = gen(**body)
    s = req.sampling
    if feature == "structured_output":
        assert s.structured_output is not None
        assert s.structured_output.kind == ("lark" if param == "tool_choice" else body["response_format"]["type"])
        if param == "tool_choice":
            assert "get_weather" in s.structured_output.spec and "<tool_call>" in s.structured_output.spec
    elif feature == "logit_bias":
        assert s.logit_bias == {42: -100.0}
    elif param == "nvext.agent_hints.priority":
        assert s.priority == -5  # Dynamo's higher-first as kvbus's lower-first
    else:
        assert getattr(s, feature) == body[feature]


def test_nats_sampling_fields_go_through_and_bad_ones_are_refused_under_their_own_names():
    req = GenerateRequest(prompt="x", sampling=SamplingParams(presence_penalty=1.0, min_tokens=2, priority=3))
    assert prepare(req, CONFIG).sampling == req.sampling
    req = GenerateRequest(prompt="x", sampling=SamplingParams(structured_output=StructuredOutput(kind="regex",
                                                                                                 spec="(a|b")))
    with pytest.raises(BadParam) as info:
        prepare(req, CONFIG)
    assert info.value.param == "sampling.structured_output"


def test_unenforceable_schemas_are_refused_before_the_engine_question():
    body = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}
    with pytest.raises(BadParam, match="cannot be enforced") as info:
        gen(**body)
    assert info.value.param == "response_format"
    with pytest.raises(BadParam, match="cannot both constrain|cannot be combined"):
        gen(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})


def test_stop_strings_and_max_completion_tokens():
    req = gen(stop=[f"s{i}" for i in range(16)], max_completion_tokens=7, max_tokens=100)
    assert len(req.sampling.stop) == 16 and req.sampling.max_tokens == 7
    with pytest.raises(BadParam, match="at most 16") as info:
        gen(stop=[f"s{i}" for i in range(17)])
    assert info.value.param == "stop"


def test_completions_take_the_sampling_extras_too():
    body = msgspec.json.encode({"prompt": "x", "min_tokens": 2, "repetition_penalty": 1.2})
    sampling = completion_to_generate(decode_body(body, CompletionRequest)).sampling
    assert (sampling.min_tokens, sampling.repetition_penalty) == (2, 1.2)


# --- replies --------------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=9)


def test_whole_reply_with_tool_calls_and_reasoning():
    fmt = ChatCompletions(None, "chatcmpl-1", "m", wants_logprobs=False)
    reply = GenerateReply(text="", token_ids=[1], finish_reason="tool_calls", usage=USAGE,
                          tool_calls=[ToolCall(id="call_1", function=ToolCallFunction(name="f", arguments="{}"))],
                          reasoning_content="thinking")
    wire = msgspec.json.decode(msgspec.json.encode(asyncio.run(fmt.whole(reply))))
    assert wire["choices"][0]["message"] == {
        "role": "assistant", "content": None, "reasoning_content": "thinking",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert wire["choices"][0]["finish_reason"] == "tool_calls"
    plain = GenerateReply(text="hi", token_ids=[1], finish_reason="stop", usage=USAGE)
    wire = msgspec.json.decode(msgspec.json.encode(asyncio.run(fmt.whole(plain))))
    assert wire["choices"][0]["message"] == {"role": "assistant", "content": "hi"}  # as before tools existed


def test_streamed_tool_call_deltas_have_openais_shape():
    fmt = ChatCompletions(None, "chatcmpl-1", "m", wants_logprobs=False)
    chunk = GenerateChunk(token_ids=[3], tool_calls=[ToolCallDelta(index=0, id="call_1", name="f"),
                                                     ToolCallDelta(index=0, arguments='{"a": 1}')],
                          reasoning_content="r")
    event = asyncio.run(fmt.piece(chunk))
    body = json.loads(event[len(b"data: "):])
    assert body["choices"][0]["delta"] == {"reasoning_content": "r", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert asyncio.run(fmt.piece(GenerateChunk(token_ids=[4]))) is None  # nothing to say yet


def test_gateway_config_checks_parser_names():
    assert GatewayConfig().tool_call_parser == "hermes" and GatewayConfig().reasoning_parser is None
    with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'; choose one of: hermes, llama3_json"):
        GatewayConfig(tool_call_parser="nope")
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        GatewayConfig(reasoning_parser="o1")
    assert GatewayConfig(reasoning_parser="qwen3", tool_call_parser="llama3_json").reasoning_parser == "qwen3"


def test_response_format_struct_is_the_wire_one():
    assert chat(response_format={"type": "text"}).response_format == ResponseFormat()


def test_calls_sent_back_with_their_stream_index_are_taken():
    """Harnesses that build the history from streamed deltas send ``index`` back (agentperf's default
    replay does, in 320 of its 348 requests): accepted, and not passed on."""
    call = {**CALL, "index": 0}
    req = gen(messages=[HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}, HISTORY[2]])
    assert req.messages[1].tool_calls == [ToolCall(id="call_1", function=ToolCallFunction(
        name="get_weather", arguments='{"city": "Oslo"}'))]
    with pytest.raises(BadParam, match="Unrecognized request argument"):
        chat(messages=[HISTORY[0], {"role": "assistant", "tool_calls": [{**CALL, "mood": 1}]}])
