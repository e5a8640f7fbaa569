"""Golden bytes: a change here breaks every peer already deployed; add fields last, with defaults."""

from __future__ import annotations

import msgspec
import pytest

from bus.codec import Encoding, decode, encode
from bus.errors import InvalidArgument
from schemas.common import CancelEvent, EchoChunk, HealthReply
from schemas.engine import StructuredOutput
from schemas.generate import GenerateChunk, GenerateRequest, ToolCallDelta
from schemas.tokenizer import (
    ChatMessage,
    ChatTemplateRequest,
    EncodeReply,
    EncodeRequest,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolFunction,
)
from schemas.transfer import TransferDescriptor, TransferTarget
from schemas.worker import RouteRequest

GOLDEN = [
    (EncodeRequest(text="hi"), b'{"text":"hi","add_special_tokens":true}',
     "82a474657874a26869b26164645f7370656369616c5f746f6b656e73c3"),
    (EncodeReply(ids=[1, 2, 3]), b'{"ids":[1,2,3]}', "81a369647393010203"),
    (ChatTemplateRequest(messages=[ChatMessage(role="user", content="x")]),
     b'{"messages":[{"role":"user","content":"x"}],"add_generation_prompt":true}',
     "82a86d657373616765739182a4726f6c65a475736572a7636f6e74656e74a178b56164645f67656e65726174696f6e5f70726f6d7074c3"),
    (CancelEvent(request_id="r1"), b'["r1"]', "91a27231"),
    (EchoChunk(index=3, data=b"ab"), b'[3,"YWI="]', "9203c4026162"),
    (HealthReply(role="t", worker_id="w", ready=True, version="0.1.0", uptime_s=1.5),
     b'{"role":"t","worker_id":"w","ready":true,"version":"0.1.0","uptime_s":1.5,"num_inflight":0,"detail":{}}',
     "87a4726f6c65a174a9776f726b65725f6964a177a57265616479c3a776657273696f6ea5302e312e30a8757074696d655f73cb3ff8"
     "000000000000ac6e756d5f696e666c6967687400a664657461696c80"),
    # the backend is a plain str (any registered backend); the built-ins' bytes are those of the old Literal
    (TransferTarget(transfer_id="t1", backend="shm", receiver_id="decode-0", host_id="h"),
     b'{"transfer_id":"t1","backend":"shm","receiver_id":"decode-0","host_id":"h","max_chunk_bytes":1048576}',
     "85ab7472616e736665725f6964a27431a76261636b656e64a373686dab72656365697665725f6964a86465636f64652d30a7686f737"
     "45f6964a168af6d61785f6368756e6b5f6279746573ce00100000"),
    (TransferDescriptor(transfer_id="t1", backend="nats", shape=[2, 3], dtype="bfloat16", num_bytes=12, checksum=7,
                        scales=[0.5]),
     b'{"transfer_id":"t1","backend":"nats","shape":[2,3],"dtype":"bfloat16","num_bytes":12,"checksum":7,'
     b'"num_chunks":1,"shm_name":null,"scales":[0.5]}',
     "89ab7472616e736665725f6964a27431a76261636b656e64a46e617473a57368617065920203a56474797065a862666c6f61743136a9"
     "6e756d5f62797465730ca8636865636b73756d07aa6e756d5f6368756e6b7301a873686d5f6e616d65c0a67363616c657391cb3fe000"
     "0000000000"),
]


@pytest.mark.parametrize("message,json_bytes,msgpack_hex", GOLDEN, ids=lambda v: type(v).__name__)
def test_golden_bytes(message, json_bytes, msgpack_hex):
    assert encode(message, Encoding.JSON) == json_bytes
    assert encode(message, Encoding.MSGPACK).hex() == msgpack_hex
    assert decode(json_bytes, type(message), Encoding.JSON) == message
    assert decode(bytes.fromhex(msgpack_hex), type(message), Encoding.MSGPACK) == message


def test_old_peer_without_new_fields_still_decodes():
    # A peer from before `num_inflight`/`detail` existed.
    old = b'{"role":"t","worker_id":"w","ready":true,"version":"0.1.0","uptime_s":1.5}'
    reply = decode(old, HealthReply, Encoding.JSON)
    assert reply.num_inflight == 0 and reply.detail == {}


def test_unknown_fields_from_newer_peers_are_ignored():
    """Between services (replies, internal requests) a newer peer's extra field is ignored: rolling upgrades."""
    old = b'{"role":"t","worker_id":"w","ready":true,"version":"0.1.0","uptime_s":1.5,"future_field":1}'
    assert decode(old, HealthReply, Encoding.JSON).worker_id == "w"
    route = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1], "future_field": 1})
    assert decode(route, RouteRequest, Encoding.MSGPACK) == RouteRequest(request_id="r", prompt_token_ids=[1])


def test_unknown_fields_in_public_requests_are_refused_by_name():
    """A client's misplaced field (``max_tokens`` outside ``sampling``) must not be silently dropped."""
    with pytest.raises(InvalidArgument, match="unknown field `future_field`"):
        decode(b'{"text":"a","future_field":1}', EncodeRequest, Encoding.JSON)
    with pytest.raises(InvalidArgument, match=r"GenerateRequest .*on kvbus.v1.generate: .*unknown field `max_tokens`"):
        decode(b'{"prompt":"a","max_tokens":5}', GenerateRequest, Encoding.JSON, "kvbus.v1.generate")
    with pytest.raises(InvalidArgument, match=r"unknown field `max_token`.*\$\.sampling"):
        decode(b'{"prompt":"a","sampling":{"max_token":5}}', GenerateRequest, Encoding.JSON)


@pytest.mark.parametrize("data", [b"", b"[", b'{"text": 3}', b'{"add_special_tokens": true}', b"null"])
def test_malformed_is_invalid_argument(data):
    with pytest.raises(InvalidArgument, match="EncodeRequest"):
        decode(data, EncodeRequest, Encoding.JSON)


def test_structs_are_frozen():
    with pytest.raises(AttributeError):
        EncodeRequest(text="a").text = "b"


def test_deadline_fields_go_last_and_old_peers_still_decode():
    """The deadline on the worker hops: last field, default None (a peer from before knows nothing of it)."""
    from schemas.engine import SamplingParams
    from schemas.worker import WorkerGenerateRequest

    msg = WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(), deadline_s=2.5)
    assert encode(msg, Encoding.JSON).endswith(b',"prefill_host_id":null,"deadline_s":2.5}')
    assert encode(msg, Encoding.MSGPACK).hex().endswith("aa646561646c696e655f73cb4004000000000000")
    old = b'{"request_id":"r","prompt_token_ids":[1,2],"sampling":{},"prefill_worker_id":null,"stream_interval":1}'
    assert decode(old, WorkerGenerateRequest, Encoding.JSON).deadline_s is None


def test_agent_fields_go_last_and_old_peers_still_decode():
    """A chunk from a gateway before tools (no tool_calls, no reasoning_content) and sampling from before
    the engine-side fields decode with their defaults."""
    from schemas.engine import SamplingParams

    old = b'{"text":"a","token_ids":[1],"finish_reason":"stop","usage":null,"logprobs":null,"timings":null}'
    chunk = decode(old, GenerateChunk, Encoding.JSON)
    assert chunk.tool_calls is None and chunk.reasoning_content is None
    sampling = decode(b'{"max_tokens":3}', SamplingParams, Encoding.JSON)
    assert (sampling.presence_penalty, sampling.repetition_penalty, sampling.logit_bias, sampling.min_tokens,
            sampling.structured_output, sampling.priority) == (0.0, 1.0, None, 0, None, 0)
    # after the fields that were there before them (later ones may follow)
    assert b'"skip_special_tokens":true,"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,' \
        b'"logit_bias":null,"min_tokens":0,"structured_output":null,"priority":0' in encode(SamplingParams(),
                                                                                           Encoding.JSON)


def test_migration_and_choice_fields_go_last_and_old_peers_still_decode():
    """A moved stream's num_prior_output_tokens and n (issue 28's engine half): last, with defaults, so a
    worker or gateway from before decodes what a newer one sends without them."""
    from schemas.engine import SamplingParams
    from schemas.worker import WorkerGenerateRequest

    before = (b'{"max_tokens":3,"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,'
              b'"logit_bias":null,"min_tokens":0,"structured_output":null,"priority":0}')
    sampling = decode(before, SamplingParams, Encoding.JSON)
    assert (sampling.num_prior_output_tokens, sampling.n) == (0, 1)
    assert encode(SamplingParams(), Encoding.JSON).endswith(b',"priority":0,"num_prior_output_tokens":0,"n":1}')
    moved = SamplingParams(max_tokens=3, num_prior_output_tokens=7)
    msg = WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=moved)
    assert decode(encode(msg, Encoding.MSGPACK), WorkerGenerateRequest, Encoding.MSGPACK).sampling == moved
    assert encode(moved, Encoding.MSGPACK).hex().endswith("b76e756d5f7072696f725f6f75747075745f746f6b656e7307a16e01")
    old_chunk = b'{"text":"a","token_ids":[1],"finish_reason":null,"tool_calls":null,"reasoning_content":null}'
    assert decode(old_chunk, GenerateChunk, Encoding.JSON).index == 0
    assert encode(GenerateChunk(text="a", index=2), Encoding.JSON).endswith(b',"reasoning_content":null,"index":2}')
