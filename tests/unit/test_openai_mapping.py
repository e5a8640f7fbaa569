"""OpenAI request bodies -> GenerateRequest, and errors -> OpenAI error bodies (no bus)."""

from __future__ import annotations

import msgspec
import pytest

from bus.errors import Internal, InvalidArgument, Overloaded, Timeout, Unavailable
from schemas.engine import TokenLogprob, Usage
from schemas.tokenizer import ChatMessage
from services.gateway.config import GatewayConfig
from services.gateway.openai_mapping import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    BadParam,
    BodyTooLarge,
    chat_logprobs,
    chat_to_generate,
    completion_logprobs,
    completion_to_generate,
    decode_body,
    error_response,
    usage_info,
)
from services.gateway.openai_schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatChunkChoice,
    ChatDelta,
    CompletionRequest,
    CompletionResponse,
)
from services.gateway.pipeline import PromptTooLong, UnknownModel
from services import config as cfg
from services.config import ConfigError


def completion(**body) -> CompletionRequest:
    return decode_body(msgspec.json.encode(body), CompletionRequest)


def chat(**body) -> ChatCompletionRequest:
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def test_completion_maps_sampling_fields():
    req = completion(model="m", prompt="Hello", max_tokens=7, temperature=0, top_p=0.9, top_k=40, min_p=0.05,
                     seed=3, stop="\n", ignore_eos=True, logprobs=2, stop_token_ids=[5], session_id="s1",
                     user="ignored", metadata={"team": "a"}, store=False)
    gen = completion_to_generate(req)
    assert gen.prompt == "Hello" and gen.messages is None and gen.prompt_token_ids is None
    assert gen.model == "m" and gen.session_id == "s1"
    s = gen.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (7, 0.0, 0.9, 40, 0.05, 3)
    assert s.stop == ("\n",) and s.stop_token_ids == (5,) and s.ignore_eos and s.logprobs == 2


def test_completion_defaults_follow_openai():
    s = completion_to_generate(completion(prompt="x")).sampling
    assert s.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS == 16
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.logprobs, s.stop) == (1.0, 1.0, 0, 0.0, None, ())


@pytest.mark.parametrize("prompt,text,ids", [
    ("plain", "plain", None),
    (["one"], "one", None),
    ([1, 2, 3], None, [1, 2, 3]),
    ([[4, 5]], None, [4, 5]),
])
def test_completion_prompt_shapes(prompt, text, ids):
    gen = completion_to_generate(completion(prompt=prompt))
    assert (gen.prompt, gen.prompt_token_ids) == (text, ids)


@pytest.mark.parametrize("body,param,match", [
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
    ({"prompt": [[1], [2]]}, "prompt", "batched prompts"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1.5]}, "prompt", "must be a string"),
    ({"prompt": [True, 2]}, "prompt", "must be a string"),
    ({}, "prompt", "required"),
    ({"prompt": "x", "n": 17}, "n", r"n must be in \[1, 16\]"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
    ({"prompt": "x", "echo": True}, "echo", "echo"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", r"must be in \[-2, 2\]"),
    ({"prompt": "x", "logit_bias": {"1": 101.0}}, "logit_bias", r"must be in \[-100, 100\]"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", r"\(0, 1\]"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", r"\[0, 20\]"),
    ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
])
def test_completion_refusals_name_the_param(body, param, match):
    with pytest.raises(BadParam, match=match) as info:
        completion_to_generate(completion(**body))
    assert info.value.param == param
    status, err = error_response(info.value)
    assert status == 400 and err.error.param == param and err.error.type == "invalid_request_error"


def test_chat_maps_messages_and_logprobs():
    req = chat(model="m", messages=[
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ], max_completion_tokens=5, max_tokens=99, logprobs=True, top_logprobs=3, stop=["a", "b"])
    gen = chat_to_generate(req)
    assert gen.messages == [ChatMessage(role="system", content="Be terse."),
                            ChatMessage(role="user", content="Hi\nthere"), ChatMessage(role="assistant", content="")]
    assert gen.prompt is None and gen.prompt_token_ids is None
    assert gen.sampling.max_tokens == 5  # max_completion_tokens wins
    assert gen.sampling.logprobs == 3 and gen.sampling.stop == ("a", "b")
    assert chat_to_generate(chat(messages=[{"role": "user", "content": "x"}])).sampling.max_tokens is None
    assert chat_to_generate(chat(messages=[{"role": "user", "content": "x"}], logprobs=True)).sampling.logprobs == 0


@pytest.mark.parametrize("body,param,match", [
    ({"messages": []}, "messages", "non-empty"),
    ({}, "messages", "non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "only text"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", r"n must be in \[1, 16\]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     r"\[0, 20\]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function",
     "missing required field `function`"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"description": "no name"}}]},
     "tools[0].function.name", "missing required field `name`"),
])
def test_chat_refusals(body, param, match):
    with pytest.raises(BadParam, match=match) as info:
        chat_to_generate(chat(**body))
    assert info.value.param == param
    # (refusals of agent fields the engine cannot serve yet: tests/unit/test_agent_mapping.py)


@pytest.mark.parametrize("type_,body,param", [
    (CompletionRequest, b'{"prompt": "x", "unknown_field": 1}', "unknown_field"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "max_token": 5}', "max_token"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x", "mood": "sad"}]}', "messages.mood"),
    (ChatCompletionRequest, b'{"messages": [], "stream": true, "stream_options": {"usage": true}}',
     "stream_options.usage"),
])
def test_unknown_fields_are_refused_by_name_as_openai_does(type_, body, param):
    with pytest.raises(BadParam, match="Unrecognized request argument supplied") as info:
        decode_body(body, type_)
    assert info.value.param == param and param in info.value.message
    assert error_response(info.value)[0] == 400


def test_fields_the_openai_client_may_send_are_accepted():
    """Every chat/completions argument of OpenAI's API decodes (refusals, if any, name the field)."""
    chat(messages=[{"role": "developer", "content": "x"}, {"role": "user", "content": "y", "name": "bob"},
                   {"role": "assistant", "content": "z", "refusal": None},
                   {"role": "tool", "content": "42", "tool_call_id": "call_1"}],
         max_completion_tokens=3, metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
         prompt_cache_key="p", safety_identifier="s", user="u", stream=True,
         stream_options={"include_usage": True, "include_obfuscation": False}, logit_bias=None, tool_choice="none",
         response_format={"type": "text"}, top_logprobs=None, logprobs=False)
    completion(prompt="x", best_of=1, echo=False, suffix=None, logit_bias=None, user="u", n=1)
    for name, value in [("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("audio", {}),
                        ("reasoning_effort", "low"), ("prediction", {"type": "content"}),
                        ("web_search_options", {}), ("verbosity", "low"), ("function_call", "auto")]:
        with pytest.raises(BadParam, match="not supported") as info:
            chat_to_generate(chat(messages=[{"role": "user", "content": "x"}], **{name: value}))
        assert info.value.param == name


@pytest.mark.parametrize("message,param,match", [
    ({"role": "wizard", "content": "x"}, "messages[0].role", "must be one of"),
    ({"role": "user", "content": None}, "messages[0].content", "got null"),
    ({"role": "user"}, "messages[0].content", "got null"),
    ({"role": "system", "content": None}, "messages[0].content", "got null"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id", "tool_call_id"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[0].role", "must be one of"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function",
     "missing required field"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[0].tool_calls", "only assistant messages"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}}, "messages[0].function_call",
     "deprecated"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content", "only text"),
])
def test_chat_roles_and_content_are_checked_as_openai_does(message, param, match):
    with pytest.raises(BadParam, match=match) as info:
        chat_to_generate(chat(messages=[message]))
    assert info.value.param == param
    assert error_response(info.value)[0] == 400


@pytest.mark.parametrize("body,param,match", [
    (b"{not json", None, "malformed JSON"),
    (b"", None, "empty"),
    (b"[1, 2]", None, "invalid request"),
    (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens", "Expected `int"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "Expected `bool"),
])
def test_malformed_bodies(body, param, match):
    with pytest.raises(BadParam, match=match) as info:
        decode_body(body, CompletionRequest)
    assert info.value.param == param
    assert error_response(info.value)[0] == 400


@pytest.mark.parametrize("exc,status,code,type_", [
    (InvalidArgument("bad"), 400, "invalid_argument", "invalid_request_error"),
    (PromptTooLong("the prompt has 9000 tokens; the context length is 8192"), 400, "context_length_exceeded",
     "invalid_request_error"),
    (UnknownModel("model 'x' is not served here"), 400, "model_not_found", "invalid_request_error"),
    (BodyTooLarge("too big"), 413, "request_too_large", "invalid_request_error"),
    (Overloaded("full"), 429, "overloaded", "rate_limit_error"),
    (Unavailable("no workers"), 503, "unavailable", "service_unavailable_error"),
    (Timeout("slow"), 504, "timeout", "timeout_error"),
    (Internal("oops (request id 1)"), 500, "internal", "server_error"),
])
def test_error_mapping(exc, status, code, type_):
    got_status, body = error_response(exc)
    assert got_status == status
    assert (body.error.code, body.error.type, body.error.message) == (code, type_, exc.message)
    wire = msgspec.json.decode(msgspec.json.encode(body))
    assert set(wire["error"]) == {"message", "type", "param", "code"}
    if isinstance(exc, UnknownModel):
        assert body.error.param == "model"


def test_unknown_exception_hides_its_text():
    status, body = error_response(RuntimeError("secret internals"))
    assert status == 500 and "secret" not in body.error.message and body.error.code == "internal"


def test_usage_carries_cached_tokens():
    info = usage_info(Usage(prompt_tokens=10, cached_prompt_tokens=8, completion_tokens=4))
    wire = msgspec.json.decode(msgspec.json.encode(info))
    assert wire == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                    "prompt_tokens_details": {"cached_tokens": 8}}


def test_logprob_shapes():
    lps = [TokenLogprob(token_id=1, logprob=-0.5, top_token_ids=[1, 2], top_logprobs=[-0.5, -1.5]),
           TokenLogprob(token_id=2, logprob=-0.25, top_token_ids=[2], top_logprobs=[-0.25])]
    texts = {1: "He", 2: "llo"}
    legacy = completion_logprobs(lps, texts, offset=3)
    assert legacy.tokens == ["He", "llo"] and legacy.token_logprobs == [-0.5, -0.25]
    assert legacy.text_offset == [3, 5] and legacy.top_logprobs == [{"He": -0.5, "llo": -1.5}, {"llo": -0.25}]
    content = chat_logprobs(lps, texts).content
    assert [c.token for c in content] == ["He", "llo"] and content[0].bytes == list(b"He")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("He", -0.5), ("llo", -1.5)]


def test_stream_bodies_keep_required_fields():
    chunk = ChatCompletionChunk(id="c", object="chat.completion.chunk", created=1, model="m",
                                choices=[ChatChunkChoice(delta=ChatDelta(content="x"))])
    wire = msgspec.json.decode(msgspec.json.encode(chunk))
    assert wire["object"] == "chat.completion.chunk" and "usage" not in wire
    assert wire["choices"][0] == {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}
    resp = CompletionResponse(id="c", object="text_completion", created=1, model="m", choices=[])
    assert msgspec.json.decode(msgspec.json.encode(resp))["object"] == "text_completion"


def test_gateway_config_checks():
    assert GatewayConfig().http_port == 8000 and GatewayConfig().http_host == "127.0.0.1"
    for bad in ({"http_port": 70000}, {"generate_timeout": 0}, {"max_concurrent_requests": 0},
                {"max_model_len": 1}, {"model_name": " "}):
        with pytest.raises(ConfigError):
            GatewayConfig(**bad)


def test_gateway_flags_do_not_clash_with_bus_flags():
    import argparse

    from bus.nats_transport import BusConfig

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, BusConfig)
    cfg.add_arguments(parser, GatewayConfig)  # raises on a duplicate flag
    args = parser.parse_args(["--http-port", "0", "--generate-timeout", "5", "--no-enable-http"])
    built = cfg.build(GatewayConfig, {k: v for k, v in vars(args).items() if k in GatewayConfig.__dataclass_fields__},
                      env={"KVBUS_MAX_CONCURRENT_REQUESTS": "3"})
    assert (built.http_port, built.generate_timeout, built.enable_http, built.max_concurrent_requests) == (0, 5.0,
                                                                                                          False, 3)


def test_usage_carries_speculative_extension_only_when_speculating():
    info = usage_info(Usage(prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=9, draft_tokens=12,
                            accepted_draft_tokens=6, mean_accepted_length=3.0))
    wire = msgspec.json.decode(msgspec.json.encode(info))
    assert wire["kvbus_speculative"] == {"draft_tokens": 12, "accepted_draft_tokens": 6, "mean_accepted_length": 3.0}
    plain = msgspec.json.decode(msgspec.json.encode(usage_info(Usage(prompt_tokens=1, cached_prompt_tokens=0,
                                                                     completion_tokens=1))))
    assert "kvbus_speculative" not in plain
