"""Tool-call and reasoning parsers on recorded model outputs, well-formed and not, whole and streamed.

The property every parser must have: whatever the pieces a reply arrives in, the content joined and
the calls merged are those of the whole reply at once. Each output is fed split at every character
position, one character at a time, and in seeded random pieces.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from schemas.generate import GenerateChunk, GenerateRequest, ToolChoice, ToolChoiceFunction
from schemas.tokenizer import ChatMessage, Tool, ToolFunction
from services.agent.output import ReplyParser, merge_tool_calls, reply_parser
from services.agent.reasoning import REASONING_PARSERS
from services.agent.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

WEATHER = {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
           "required": ["location"]}
TOOLS = [Tool(function=ToolFunction(name="get_current_weather", parameters=WEATHER)),
         Tool(function=ToolFunction(name="get_time", parameters={"type": "object", "properties": {}}))]

# (output, content, [(name, arguments)])
HERMES = [
    # Qwen2.5-7B-Instruct, one call
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
     '</tool_call>', "", [("get_current_weather", {"location": "Paris, France", "unit": "celsius"})]),
    # Hermes-2-Pro: a sentence, then the call
    ("I'll look up the weather for you.\n<tool_call>\n{\"arguments\": {\"location\": \"Zürich\"}, "
     "\"name\": \"get_current_weather\"}\n</tool_call>",
     "I'll look up the weather for you.", [("get_current_weather", {"location": "Zürich"})]),
    # parallel calls (Qwen2.5)
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "", [("get_current_weather", {"location": "Oslo"}), ("get_time", {})]),
    # plain answers are content, to the byte
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("  Indented, with a trailing newline\n", "  Indented, with a trailing newline\n", []),
    ("Use <b>bold</b> and a < sign; <tool is not a tag.", "Use <b>bold</b> and a < sign; <tool is not a tag.", []),
    # malformed: the JSON is broken, so the block is content
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": Paris}}\n</tool_call>',
     '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": Paris}}\n</tool_call>', []),
    # malformed: no name
    ('<tool_call>\n{"arguments": {"location": "Rome"}}\n</tool_call>',
     '<tool_call>\n{"arguments": {"location": "Rome"}}\n</tool_call>', []),
    # malformed: arguments not an object
    ('<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>', []),
    # the tag in prose, never closed: content
    ("Wrap calls in <tool_call> tags, like this.", "Wrap calls in <tool_call> tags, like this.", []),
    # cut off mid-call (max_tokens): content
    ('<tool_call>\n{"name": "get_current_weather", "argu', '<tool_call>\n{"name": "get_current_weather", "argu', []),
    # closing tag cut (a stop string, or the model forgot it): a call when its JSON is one
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", [("get_time", {})]),
    # arguments as a JSON string (some models quote them)
    ('<tool_call>{"name": "get_current_weather", "arguments": "{\\"location\\": \\"Lima\\"}"}</tool_call>', "",
     [("get_current_weather", {"location": "Lima"})]),
    # a good call, a broken one, then text
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": }</tool_call>\nDone.',
     '<tool_call>{"name": }</tool_call>\nDone.', [("get_time", {})]),
    # text after the calls
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nI asked for the time.',
     "I asked for the time.", [("get_time", {})]),
    # SmolLM2-135M-Instruct under kvbus's fallback prompt, greedy (tests/actor/test_agent_flow.py)
    ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n</tool_call>', "",
     [("get_current_weather", {"location": "Paris"})]),
    ("", "", []),
]

LLAMA3 = [
    # Llama-3.1-8B-Instruct, JSON tool calling
    ('{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "f"}}', "",
     [("get_current_weather", {"location": "San Francisco, CA", "unit": "f"})]),
    # special tokens kept: the python tag in front
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    # Llama-3.2-3B-Instruct: several calls separated by ';'
    ('{"name": "get_current_weather", "parameters": {"location": "Oslo"}}; '
     '{"name": "get_time", "parameters": {"tz": "}{[\\"quoted\\"]"}}',
     "", [("get_current_weather", {"location": "Oslo"}), ("get_time", {"tz": '}{["quoted"]'})]),
    ("\n  " + '{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    # JSON that is not a call (a structured answer): content, untouched
    ('{"answer": 42, "unit": "km"}', '{"answer": 42, "unit": "km"}', []),
    # cut off
    ('{"name": "get_time", "parameters": {"tz": ', '{"name": "get_time", "parameters": {"tz": ', []),
    # text after a call
    ('{"name": "get_time", "parameters": {}} Let me know if you need more.', "Let me know if you need more.",
     [("get_time", {})]),
    ("<|eot_id|> not a tag we know", "<|eot_id|> not a tag we know", []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
]


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run_tools(name: str, pieces: list[str], parallel: bool = True):
    parser = TOOL_PARSERS.get(name)(TOOLS, parallel=parallel, new_id=counter_ids())
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, deltas = content + out.content, deltas + out.calls
    out = parser.finish()
    content, deltas = content + out.content, deltas + out.calls
    return content, merge_tool_calls(deltas), deltas


def splits(text: str, seed: int):
    """Every 2-piece split, 1 character at a time, and a few seeded random splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name,cases", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_recorded_outputs_whole(name, cases):
    for output, content, calls in cases:
        got_content, got_calls, deltas = run_tools(name, [output])
        assert got_content == content, output
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls, output
        assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
        # OpenAI's order: a call's id and name first, then its arguments
        for i in range(len(calls)):
            mine = [d for d in deltas if d.index == i]
            assert mine[0].id and mine[0].name and mine[0].arguments == ""
            assert all(d.id is None and d.name is None for d in mine[1:])


@pytest.mark.parametrize("name,cases", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_any_split_gives_the_whole_result(name, cases):
    for seed, (output, _, _) in enumerate(cases):
        whole = run_tools(name, [output])[:2]
        for pieces in splits(output, seed):
            assert run_tools(name, pieces)[:2] == whole, (output, pieces)


def test_plain_text_streams_without_delay_except_a_possible_tag():
    parser = TOOL_PARSERS.get("hermes")(TOOLS)
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" world <tool_").content == " world"  # " <tool_" may open a call: held
    assert parser.feed("box>").content == " <tool_box>"
    assert parser.finish().content == ""


def test_parallel_tool_calls_false_keeps_the_first_call():
    output = HERMES[2][0]
    content, calls, _ = run_tools("hermes", [output], parallel=False)
    assert content == "" and [c.function.name for c in calls] == ["get_current_weather"]
    content, calls, _ = run_tools("llama3_json", [LLAMA3[2][0]], parallel=False)
    assert content == "" and [c.function.name for c in calls] == ["get_current_weather"]


def test_default_and_registry():
    assert DEFAULT_TOOL_PARSER in TOOL_PARSERS and {"hermes", "llama3_json"} <= set(TOOL_PARSERS)
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose one of: hermes, llama3_json"):
        TOOL_PARSERS.get("nope")


# --- reasoning -------------------------------------------------------------------------------

REASONING = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.", "\nThe user wants 2+2.\n",
     "The answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),  # enable_thinking=false
    ("qwen3", "<think>\n\n</think>\n\nHi!", "\n\n", "Hi!"),  # the template's empty block
    ("qwen3", "<think>cut off mid-thou", "cut off mid-thou", ""),
    ("qwen3", "I <think> therefore", "", "I <think> therefore"),
    ("qwen3", "<thinking is not the tag", "", "<thinking is not the tag"),
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\n**4**", "Okay, 2+2 is 4.\n", "**4**"),
    ("deepseek_r1", "<think>Okay.</think>Four.", "Okay.", "Four."),
    ("deepseek_r1", "No end tag at all", "No end tag at all", ""),
    ("deepseek_r1", "", "", ""),
]


def run_reasoning(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = REASONING_PARSERS.get(name)()
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name,output,reasoning,content", REASONING)
def test_reasoning_whole_and_split(name, output, reasoning, content):
    assert run_reasoning(name, [output]) == (reasoning, content)
    for pieces in splits(output, 7):
        assert run_reasoning(name, pieces) == (reasoning, content), pieces


# --- both, over GenerateChunks ---------------------------------------------------------------


def chat_request(**fields) -> GenerateRequest:
    return GenerateRequest(messages=[ChatMessage(role="user", content="weather?")], **fields)


def test_reasoning_then_a_call_over_chunks():
    output = ('<think>I need the weather.</think>\n<tool_call>\n{"name": "get_current_weather", '
              '"arguments": {"location": "Paris"}}\n</tool_call>')
    for pieces in splits(output, 3):
        parser = reply_parser(chat_request(tools=TOOLS), tool_parser="hermes", reasoning_parser="qwen3",
                              new_id=counter_ids())
        chunks = [parser.chunk(GenerateChunk(text=p)) for p in pieces[:-1]]
        chunks.append(parser.chunk(GenerateChunk(text=pieces[-1], finish_reason="stop")))
        assert "".join(c.reasoning_content or "" for c in chunks) == "I need the weather."
        assert "".join(c.text for c in chunks) == ""
        [call] = merge_tool_calls(d for c in chunks for d in c.tool_calls or ())
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
            ("call_0", "get_current_weather", {"location": "Paris"})
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_which_requests_are_parsed():
    assert reply_parser(chat_request(), tool_parser="hermes", reasoning_parser=None) is None
    assert reply_parser(chat_request(tools=TOOLS, tool_choice="none"), tool_parser="hermes",
                        reasoning_parser=None) is None
    assert reply_parser(GenerateRequest(prompt="x"), tool_parser="hermes", reasoning_parser="qwen3") is None
    parser = reply_parser(chat_request(tools=TOOLS), tool_parser="hermes", reasoning_parser=None)
    assert isinstance(parser, ReplyParser) and parser.reasoning is None
    # a cut reply keeps "length" even when it made a call
    last = parser.chunk(GenerateChunk(text='<tool_call>{"name": "get_time"}</tool_call>', finish_reason="length"))
    assert last.finish_reason == "length" and last.tool_calls[0].name == "get_time"
    parser = reply_parser(chat_request(tools=TOOLS), tool_parser="hermes", reasoning_parser=None)
    assert parser.chunk(GenerateChunk(text="no call", finish_reason="stop")).finish_reason == "stop"


# --- calls a grammar guarantees (tool_choice "required" or a named function): arguments stream ------------

TRICKY = {"location": 'a "}" b', "days": [1, {"x": 2}]}
GUARANTEED = {  # (output, [(name, arguments)])
    "hermes": [
        ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
         '</tool_call>', [("get_current_weather", {"location": "Paris", "unit": "celsius"})]),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": '
         '"get_current_weather", "arguments": ' + json.dumps(TRICKY) + '}\n</tool_call>',
         [("get_time", {}), ("get_current_weather", TRICKY)]),
    ],
    "llama3_json": [
        ('{"name": "get_current_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
         [("get_current_weather", {"location": "Paris", "unit": "celsius"})]),
        ('{"name": "get_time", "parameters": {}}; {"name": "get_current_weather", "parameters": '
         + json.dumps(TRICKY) + '}', [("get_time", {}), ("get_current_weather", TRICKY)]),
    ],
}


def run_guaranteed(name: str, pieces: list[str]):
    parser = TOOL_PARSERS.get(name)(TOOLS, new_id=counter_ids(), guaranteed=True)
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(o.content for o in outs), [d for o in outs for d in o.calls]


@pytest.mark.parametrize("name", list(GUARANTEED))
def test_guaranteed_calls_stream_their_arguments_as_they_are_generated(name):
    """With the call grammar enforced, the text is calls by construction: a call's id and name go out as
    soon as its name is complete, then its arguments piece by piece (OpenAI's stream), exactly the
    model's JSON text; split anywhere, the merged calls are the whole reply's."""
    for seed, (output, calls) in enumerate(GUARANTEED[name]):
        content, deltas = run_guaranteed(name, [output])
        whole = merge_tool_calls(deltas)
        assert content == ""
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == calls
        for pieces in splits(output, seed):
            content, deltas = run_guaranteed(name, pieces)
            assert content == "" and merge_tool_calls(deltas) == whole, pieces
            for i in range(len(whole)):
                mine = [d for d in deltas if d.index == i]
                assert mine[0].id and mine[0].name and mine[0].arguments == ""
                assert all(d.id is None and d.name is None for d in mine[1:])
        # one character at a time: the last call's arguments arrive in as many pieces as they have characters
        _, deltas = run_guaranteed(name, list(output))
        pieces = [d.arguments for d in deltas if d.index == len(whole) - 1 and d.arguments]
        assert len(pieces) == len(whole[-1].function.arguments)


def test_a_guaranteed_call_cut_by_max_tokens_keeps_what_was_streamed():
    content, deltas = run_guaranteed("hermes", ['<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eu'])
    [call] = merge_tool_calls(deltas)
    assert content == "" and call.function.name == "get_time" and call.function.arguments == '{"tz": "Eu'
    # cut before its name was complete: no call, the text stays content, as with tool_choice auto
    for name, cut in [("hermes", '<tool_call>\n{"name": "get_ti'), ("llama3_json", '{"name": "get_ti')]:
        content, deltas = run_guaranteed(name, [cut])
        assert (content, deltas) == (cut, []), name
        assert run_tools(name, [cut])[:2] == (cut, [])


def test_which_requests_stream_arguments():
    assert reply_parser(chat_request(tools=TOOLS), tool_parser="hermes", reasoning_parser=None).tools.guaranteed \
        is False
    named = ToolChoice(function=ToolChoiceFunction(name="get_time"))
    for choice in ("required", named):
        req = chat_request(tools=TOOLS, tool_choice=choice)
        assert reply_parser(req, tool_parser="hermes", reasoning_parser=None).tools.guaranteed is True
