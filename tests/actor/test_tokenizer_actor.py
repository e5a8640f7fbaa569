"""The tokenizer actor on the in-memory bus, checked against transformers itself."""

from __future__ import annotations

import asyncio

import pytest

from bus import errors
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import TOKENIZER_CHAT, TOKENIZER_DECODE, TOKENIZER_ENCODE, TOKENIZER_INFO
from schemas.tokenizer import (
    ChatMessage,
    ChatTemplateRequest,
    DecodeRequest,
    EncodeRequest,
    TokenizerInfoRequest,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolFunction,
)
from services.tokenizer import TokenizerActor, TokenizerConfig, TokenizerCore

pytestmark = pytest.mark.anyio

TEXTS = [
    "Hello, world!",
    "Paris is the capital of France.",
    "  leading spaces and trailing  ",
    "Ünïcödé, emoji 🤖 and CJK 你好",
    "def f(x):\n    return x * 2\n",
    "",
]
CONVERSATIONS = [
    [ChatMessage(role="user", content="What is the capital of France?")],
    [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Hi")],
    [ChatMessage(role="user", content="2+2?"), ChatMessage(role="assistant", content="4"),
     ChatMessage(role="user", content="and 3+3?")],
]


@pytest.fixture(scope="module")
def core(model_dir):
    return TokenizerCore(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
async def buses(core):
    network = MemoryNetwork()
    server, client = memory_bus(network), memory_bus(network)
    actor = TokenizerActor(TokenizerConfig(max_input_chars=10_000), core=core)
    await actor.start(server)
    yield actor, client
    await server.drain(timeout=5)
    await actor.stop()
    await client.close()


async def test_encode_decode_round_trip_matches_transformers(buses, hf_tokenizer):
    actor, client = buses
    for text in TEXTS:
        ids = (await client.request(TOKENIZER_ENCODE, EncodeRequest(text=text))).ids
        assert ids == hf_tokenizer(text)["input_ids"]
        back = (await client.request(TOKENIZER_DECODE, DecodeRequest(ids=ids))).text
        assert back == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert back.strip() == text.strip()


async def test_chat_template_matches_transformers(buses, hf_tokenizer):
    actor, client = buses
    for conversation in CONVERSATIONS:
        messages = [{"role": m.role, "content": m.content} for m in conversation]
        reply = await client.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=conversation))
        expected_prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected_ids, list):
            expected_ids = expected_ids["input_ids"]
        assert reply.prompt == expected_prompt
        assert reply.ids == expected_ids


async def test_concurrent_requests_are_batched(buses, hf_tokenizer):
    actor, client = buses
    texts = [f"request number {i} " * (i % 7 + 1) for i in range(200)]
    before = actor.num_batches
    replies = await asyncio.gather(*(client.request(TOKENIZER_ENCODE, EncodeRequest(text=t)) for t in texts))
    assert [r.ids for r in replies] == hf_tokenizer(texts)["input_ids"]
    assert actor.num_batches - before < len(texts) / 4  # many per batch call, not one by one


async def test_info(buses, hf_tokenizer):
    actor, client = buses
    info = await client.request(TOKENIZER_INFO, TokenizerInfoRequest())
    assert info.vocab_size == len(hf_tokenizer)
    assert hf_tokenizer.eos_token_id in info.eos_token_ids
    assert info.context_length == 8192 and info.has_chat_template


async def test_bad_input_gets_invalid_argument_and_service_survives(buses):
    actor, client = buses
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        await client.request(TOKENIZER_DECODE, DecodeRequest(ids=[1, -5, 10**9]))
    with pytest.raises(errors.InvalidArgument, match="max_input_chars"):
        await client.request(TOKENIZER_ENCODE, EncodeRequest(text="x" * 10_001))
    with pytest.raises(errors.InvalidArgument, match="empty"):
        await client.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=[]))
    assert (await client.request(TOKENIZER_ENCODE, EncodeRequest(text="ok"))).ids


# --- tools in the prompt ------------------------------------------------------------------------

TOOLS = [Tool(function=ToolFunction(name="get_weather", description="Weather in a city", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))]
TOOL_CONVERSATION = [
    ChatMessage(role="user", content="Weather in Oslo and Rome?"),
    ChatMessage(role="assistant", content="Checking.", tool_calls=[
        ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Oslo"}')),
        ToolCall(id="c2", function=ToolCallFunction(name="get_weather", arguments='{"city": "Rome"}'))]),
    ChatMessage(role="tool", content='{"temp": 3}', tool_call_id="c1"),
    ChatMessage(role="tool", content='{"temp": 19}', tool_call_id="c2"),
]


async def test_tools_without_a_tool_template_use_the_fallback_format(buses, core, hf_tokenizer):
    """SmolLM2's template knows no tools: they, the calls and the results are rendered as documented
    (docs/agents.md, "Templates without tools"), through the model's own template."""
    assert not core.template_takes_tools
    actor, client = buses
    reply = await client.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=TOOL_CONVERSATION, tools=TOOLS))
    tool_json = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
                 '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')
    expected = [
        {"role": "system", "content": "# Tools\n\nYou may call one or more functions to help with the user's request. "
                                      "The functions you may call are described within <tools></tools> tags:\n"
                                      f"<tools>\n{tool_json}\n</tools>\n\nTo call a function, reply with a JSON "
                                      "object giving its name and arguments within <tool_call></tool_call> tags, one "
                                      "call per block:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                                      "<arguments-json-object>}\n</tool_call>\nThe results come back within "
                                      "<tool_response></tool_response> tags."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                         '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Rome"}}\n</tool_call>'},
        {"role": "tool", "content": '<tool_response>\n{"temp": 3}\n</tool_response>\n<tool_response>\n'
                                    '{"temp": 19}\n</tool_response>'},
    ]
    assert reply.prompt == hf_tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
    # a history with calls but no tools in this request still renders the calls
    reply = await client.request(TOKENIZER_CHAT, ChatTemplateRequest(messages=TOOL_CONVERSATION))
    assert reply.prompt == hf_tokenizer.apply_chat_template(expected[1:], add_generation_prompt=True,
                                                            tokenize=False)


TOOL_TEMPLATE = (  # (transformers trims the newline after a block tag: hence {{ nl }})
    "{% set nl = '\\n' %}{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}="
    "{{ t.function.parameters | tojson }};{% endfor %}{{ nl }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }};{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{{ nl }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if enable_thinking is false %}<think></think>{% endif %}{% endif %}")


async def test_a_template_that_takes_tools_renders_them_itself(model_dir):
    core = TokenizerCore(model_dir, chat_template=TOOL_TEMPLATE)
    assert core.template_takes_tools
    prompt = core.render_chat(ChatTemplateRequest(messages=TOOL_CONVERSATION, tools=TOOLS,
                                                  chat_template_kwargs={"enable_thinking": False}))
    assert prompt == ('TOOLS:get_weather={"type": "object", "properties": {"city": {"type": "string"}}, '
                      '"required": ["city"]};\n'
                      "[user]Weather in Oslo and Rome?\n"
                      "[assistant]Checking.CALL get_weather Oslo;CALL get_weather Rome;\n"  # arguments as objects
                      '[tool]{"temp": 3}(for c1)\n[tool]{"temp": 19}(for c2)\n[assistant]<think></think>')
    with pytest.raises(errors.InvalidArgument, match="may not set 'tokenize'"):
        core.render_chat(ChatTemplateRequest(messages=TOOL_CONVERSATION, chat_template_kwargs={"tokenize": True}))


async def test_a_template_refusing_the_tool_role_gets_results_as_user_messages(model_dir):
    refusing = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}{% endfor %}")
    core = TokenizerCore(model_dir, chat_template=refusing)
    prompt = core.render_chat(ChatTemplateRequest(messages=TOOL_CONVERSATION))
    assert prompt.endswith('<user><tool_response>\n{"temp": 3}\n</tool_response>\n<tool_response>\n'
                           '{"temp": 19}\n</tool_response>')
