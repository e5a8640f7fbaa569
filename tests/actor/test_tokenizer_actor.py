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
