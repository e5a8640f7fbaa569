"""A request's trace through ``kvbus up --trace`` (real processes, real nats-server): 1P2D with HiCache
(write-through, so pages reach L2 while requests run) and n-gram speculation, every service exporting
OTLP/HTTP protobuf to the receiver kvbus up started (services/traces/receiver.py decodes the payloads
with the OpenTelemetry proto package and writes the spans to the file the test reads).

- A streamed chat completion over HTTP, with the caller's own ``traceparent``: one tree under the
  caller's span, with the gateway's, tokenizer's, router's, prefill and decode workers' stages in
  order and with their attributes, the request id (``X-Request-Id``) on every span; ``kvbus trace``
  draws it.
- A NATS stream (a conversation's second turn, so its decode worker is known) whose decode worker is
  killed mid-way: the trace shows the failed attempt, the migration, the next route excluding the dead
  worker, and the new worker loading the prompt's pages back from the host tier (L2) before it decodes
  on; the gateway's log line about it carries the request id.

A tiny random model (tests/tiny_model.py) with the default model's tokenizer and chat template: these
check spans, not text.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE, GENERATE_ONCE, PREFILL, WORKER_GENERATE
from bus.tracing import HOP_REQUEST_ID, REQUEST_ID
from bus.tracing import names as n
from bus.transport import REQUEST_ID_HEADER
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from services.local_system import LocalSystem
from services.traces.spans import Span, find_trace, read_file
from tests.leaks import engine_states, pid_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ENGINES = [("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")]
# ~200 tokens: past the decode workers' 100-token local prefill, so the first request is prefilled on
# the prefill worker; a migrated request's remainder (after the pages L2 holds) is short: prefilled
# on the new decode worker, which loads the rest back from L2
PROMPT = " ".join(["the river runs through the ancient city and the city sleeps"] * 16)
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
SLACK_NS = 5_000_000
"""Spans of different processes are compared on their clocks' epoch conversions: 5 ms of slack."""


@pytest.fixture(scope="module")
def chat_tiny_model(tmp_path_factory, model_dir) -> Path:
    from tests.tiny_model import save_chat_tiny_model

    return save_chat_tiny_model(tmp_path_factory.mktemp("tiny-chat-traces"), model_dir)


@pytest.fixture(scope="module")
def system(chat_tiny_model, tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    with LocalSystem("--prefill", "1", "--decode", "2", "--hicache", "--hicache-write-policy", "write_through",
                     "--num-threads", "1", "--kv-cache-memory", "0.05", "--drain-timeout", "2",
                     "--trace", "--trace-file", str(trace_file),
                     "--engine-args", "--heartbeat-interval 0.5 --local-prefill-tokens 100",
                     model_dir=chat_tiny_model) as s:
        s.trace_file = trace_file
        yield s
        for _, wid in ENGINES:  # idle now; a restarted worker would hold kvbus up's stop for its start-up
            try:
                os.kill(pid_of(s, wid), signal.SIGKILL)
            except (LookupError, ProcessLookupError, psutil.Error):  # gone, or exiting
                pass


async def ready(system) -> None:
    bus = await connect(BusConfig(nats_url=system.nats_url, request_timeout=30))
    try:
        deadline = time.monotonic() + 120
        while not all((await engine_states(bus, ENGINES)).values()):
            assert time.monotonic() < deadline, "the engines did not answer ready"
            await asyncio.sleep(0.2)
    finally:
        await bus.close()


async def spans_of(system, request_id: str, *wanted: tuple[str, str | None]) -> list[Span]:
    """The trace of ``request_id`` once it holds a span of each ``(name, service)`` in ``wanted`` (service
    None: any). Every process exports through its own batching processor, so the spans of one request reach
    the file in the order their processes flush, not the order they ended: wait for each one a test reads."""
    deadline = time.monotonic() + 30
    while True:
        spans = find_trace(read_file(system.trace_file), request_id)
        seen = {(s.name, s.service) for s in spans}
        have = seen | {(name, None) for name, _ in seen}
        missing = [w for w in wanted if w not in have]
        if spans and not missing:
            return spans
        assert time.monotonic() < deadline, f"the trace of {request_id} lacks {missing}: {sorted(seen)}"
        await asyncio.sleep(0.2)


class Tree:
    def __init__(self, spans: list[Span]):
        self.spans = spans
        self.by_id = {s.span_id: s for s in spans}
        self.children: dict[str, list[Span]] = {}
        for s in sorted(spans, key=lambda s: s.start_ns):
            if s.parent_id is not None:
                self.children.setdefault(s.parent_id, []).append(s)

    def named(self, name: str, service: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.name == name and (service is None or s.service == service)]

    def one(self, name: str, service: str | None = None) -> Span:
        found = self.named(name, service)
        assert len(found) == 1, (name, service, [(s.name, s.service) for s in self.spans])
        return found[0]

    def kids(self, span: Span, name: str | None = None) -> list[Span]:
        return [c for c in self.children.get(span.span_id, []) if name is None or c.name == name]

    def kid(self, span: Span, name: str) -> Span:
        found = self.kids(span, name)
        assert len(found) == 1, (span.name, name, [c.name for c in self.kids(span)])
        return found[0]

    def parent(self, span: Span) -> Span:
        return self.by_id[span.parent_id]

    def is_under(self, span: Span, ancestor: Span) -> bool:
        while span.parent_id in self.by_id:
            span = self.by_id[span.parent_id]
            if span is ancestor:
                return True
        return False


def in_order(*spans: Span) -> None:
    """Each span ends before the next one starts (with cross-process slack)."""
    for a, b in zip(spans, spans[1:]):
        assert a.end_ns <= b.start_ns + SLACK_NS, f"{a.name} ends after {b.name} starts"


def within(span: Span, parent: Span) -> None:
    assert parent.start_ns - SLACK_NS <= span.start_ns and span.end_ns <= parent.end_ns + SLACK_NS, \
        f"{span.name} [{span.service}] is not within {parent.name} [{parent.service}]"


async def test_a_disaggregated_request_is_one_tree_of_its_stages(system, chat_tiny_model):
    await ready(system)
    async with httpx.AsyncClient(base_url=system.http_url, timeout=120) as http:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": traceparent}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            events = [json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 40
    spans = await spans_of(system, rid, ("POST /v1/chat/completions", "kvbus-gateway"), (n.STREAM_OUT, None),
                           ("kvbus.v1.tokenizer.chat", "kvbus-tokenizer"), ("kvbus.v1.router.route", "kvbus-router"),
                           (PREFILL.template, "kvbus-prefill"), (n.KV_SEND, None), (n.WRITE_BACK, None),
                           (WORKER_GENERATE.template, "kvbus-decode"), (n.DECODE, "kvbus-decode"))
    tree = Tree(spans)
    # one trace, the caller's, and every span carries the request id
    assert {s.trace_id for s in spans} == {CLIENT_TRACE_ID}
    assert all(s.request_id == rid for s in spans), [(s.name, s.service) for s in spans if s.request_id != rid]
    assert {s.service for s in spans} >= {"kvbus-gateway", "kvbus-tokenizer", "kvbus-router", "kvbus-prefill",
                                          "kvbus-decode"}

    # the gateway: the root (child of the caller's span) with the GenAI attributes, TTFT and TPOT
    root = tree.one("POST /v1/chat/completions")
    assert root.parent_id == CLIENT_SPAN_ID and root.kind == "server" and root.status != "error"
    a = root.attributes
    assert a[n.OPERATION_NAME] == "chat" and a[n.PROVIDER_NAME] == "kvbus" and a[n.REQUEST_STREAM] is True
    assert a[n.RESPONSE_MODEL] == a[n.REQUEST_MODEL] == chat_tiny_model.name  # the model served
    assert a[n.REQUEST_MAX_TOKENS] == 40 and a[n.REQUEST_TEMPERATURE] == 0.0 and a[n.RESPONSE_ID] == rid
    assert a[n.USAGE_INPUT_TOKENS] == usage["prompt_tokens"] and a[n.USAGE_OUTPUT_TOKENS] == 40
    assert a[n.RESPONSE_FINISH_REASONS] == ["length"]
    assert 0 < a[n.TTFT_S] < root.duration_s and 0 < a[n.TPOT_S] < a[n.TTFT_S] + root.duration_s
    assert a[n.RESPONSE_TIME_TO_FIRST_CHUNK] == a[n.TTFT_S]
    chat, route, worker, stream_out = (tree.kid(root, name) for name in
                                       (n.CHAT_TEMPLATE, n.ROUTE, n.WORKER, n.STREAM_OUT))
    in_order(chat, route, worker)
    assert stream_out.start_ns >= chat.end_ns and stream_out.end_ns <= root.end_ns
    for stage in (chat, route, worker, stream_out):
        within(stage, root)
    # tokenize and chat template: the tokenizer's span under the gateway's stage
    tokenizer = tree.one("kvbus.v1.tokenizer.chat", "kvbus-tokenizer")
    assert tree.is_under(tokenizer, chat)
    in_order(tree.kid(tokenizer, n.QUEUE), tree.kid(tokenizer, n.BATCH))
    # route: the router's decision on both sides
    router = tree.one("kvbus.v1.router.route", "kvbus-router")
    assert tree.is_under(router, route)
    decode_id = route.attributes[n.DECODE_WORKER]
    assert decode_id in ("decode-0", "decode-1") and route.attributes[n.PREFILL_WORKER] == "prefill-0"
    assert route.attributes[n.ROUTE_POLICY] == "kv" and n.PREDICTED_CACHED_TOKENS in route.attributes
    assert router.attributes[n.DECODE_WORKER] == decode_id and router.attributes[n.PROMPT_TOKENS] == \
        usage["prompt_tokens"]
    assert worker.attributes[n.ATTEMPT] == 0 and worker.attributes[n.DECODE_WORKER] == decode_id

    # the decode worker: remote prefill, KV receive, queue, decode (speculation, detokenize under it)
    decode_server = tree.one(WORKER_GENERATE.template, "kvbus-decode")
    assert tree.is_under(decode_server, worker)
    assert decode_server.attributes[n.WORKER_ID] == decode_id
    assert decode_server.attributes[HOP_REQUEST_ID] == f"{rid}-0"
    remote, receive, queue, decode = (tree.kid(decode_server, name) for name in
                                      (n.REMOTE_PREFILL, n.KV_RECEIVE, n.QUEUE, n.DECODE))
    in_order(remote, receive, queue, decode)
    # the prefill worker, under remote_prefill: queue, prefill compute, KV send (and write-through)
    prefill_server = tree.one(PREFILL.template, "kvbus-prefill")
    assert tree.is_under(prefill_server, remote)
    p_queue, prefill, send = (tree.kid(prefill_server, name) for name in (n.QUEUE, n.PREFILL, n.KV_SEND))
    in_order(p_queue, prefill, send)
    assert prefill.attributes[n.PROMPT_TOKENS] == usage["prompt_tokens"]
    assert prefill.attributes[n.COMPUTED_TOKENS] + prefill.attributes[n.CACHED_TOKENS] >= usage["prompt_tokens"]
    assert prefill.attributes[n.CACHED_TOKENS] == \
        prefill.attributes[n.DEVICE_CACHED_TOKENS] + prefill.attributes[n.LOADED_TOKENS]
    assert send.attributes[n.BACKEND] == "shm" and send.attributes[n.BYTES] > 0
    assert receive.attributes[n.BYTES] == send.attributes[n.BYTES]
    assert receive.attributes[n.PAGES] == send.attributes[n.PAGES] > 0
    write_back = tree.kid(prefill_server, n.WRITE_BACK)  # write-through: the prompt's pages to L2
    assert write_back.attributes[n.TIER] == "host" and write_back.attributes[n.PAGES] >= 1
    # decode: steps, batch sizes seen, step events every STEP_EVENT_EVERY steps
    d = decode.attributes
    assert d[n.NUM_TOKENS] == 40 and 1 <= d[n.NUM_STEPS] <= 40 and d[n.BATCH_SIZE_MIN] >= 1
    assert d[n.BATCH_SIZE_MIN] <= d[n.BATCH_SIZE_MEAN] <= d[n.BATCH_SIZE_MAX]
    assert len(decode.events) == d[n.NUM_STEPS] // d["kvbus.step_event_every"]
    spec = tree.kid(decode, n.SPECULATION)
    assert spec.attributes[n.DRAFTER] == "ngram" and spec.attributes[n.DRAFT_PLACEMENT] == "local"
    assert spec.attributes[n.DRAFTED_TOKENS] == usage.get("draft_tokens", spec.attributes[n.DRAFTED_TOKENS])
    assert 0 <= spec.attributes[n.ACCEPTED_TOKENS] <= spec.attributes[n.DRAFTED_TOKENS]
    detok = tree.kid(decode, n.DETOKENIZE)
    assert 0 < detok.attributes[n.BUSY_S] <= detok.duration_s + 0.01
    for stage in (remote, receive, queue, decode):
        within(stage, decode_server)

    # the waterfall in the terminal, from the same file
    out = subprocess.run([sys.executable, "-m", "services.cli", "trace", rid, "--file", str(system.trace_file)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"trace {CLIENT_TRACE_ID}  request {rid}")
    order = [next(i for i, line in enumerate(lines) if f" {name} [" in line) for name in
             (n.CHAT_TEMPLATE, n.ROUTE, n.WORKER, n.REMOTE_PREFILL, n.KV_SEND, n.KV_RECEIVE, n.DECODE)]
    assert order == sorted(order), out.stdout
    assert "drafter=ngram" in out.stdout and f"decode={decode_id}" in out.stdout


async def test_a_request_whose_decode_worker_dies_migrates_and_its_trace_says_so(system):
    await ready(system)
    bus = await connect(BusConfig(nats_url=system.nats_url, request_timeout=120))
    session = f"conv-{uuid.uuid4().hex[:8]}"
    rid = f"migrate-{uuid.uuid4().hex[:12]}"
    got: list[int] = []
    try:
        # the conversation's first turn tells which decode worker holds it (its trace's route); the
        # next turn of the session goes there, and that worker dies under it
        warm = f"warm-{uuid.uuid4().hex[:12]}"
        await bus.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, session_id=session, sampling=SamplingParams(
            temperature=0.0, max_tokens=4)), headers={REQUEST_ID_HEADER: warm})
        warm_route = Tree(await spans_of(system, warm, (n.ROUTE, None))).one(n.ROUTE)
        victim = warm_route.attributes[n.DECODE_WORKER]
        req = GenerateRequest(prompt=PROMPT, session_id=session,
                              sampling=SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
        async with bus.stream(GENERATE, req, timeout=120, headers={REQUEST_ID_HEADER: rid}) as chunks:
            async for chunk in chunks:
                if not got:
                    pid = pid_of(system, victim)
                    os.kill(pid, signal.SIGSTOP)  # not one chunk more, however fast the rest would be
                    os.kill(pid, signal.SIGKILL)
                got += chunk.token_ids
    finally:
        await bus.close()
    assert len(got) == 150
    survivor = next(wid for _, wid in ENGINES[1:] if wid != victim)
    spans = await spans_of(system, rid, (GENERATE.template, "kvbus-gateway"), (n.STREAM_OUT, None),
                           (n.MIGRATION, None), (n.LOAD_BACK, "kvbus-decode"), (n.DECODE, "kvbus-decode"))
    tree = Tree(spans)
    assert all(s.request_id == rid for s in spans)
    root = tree.one(GENERATE.template, "kvbus-gateway")
    assert root.parent_id is None and root.status != "error" and root.attributes[n.CONVERSATION_ID] == session
    assert root.attributes[n.OPERATION_NAME] == "text_completion" and root.attributes[n.REQUEST_STREAM] is True
    assert root.attributes[n.USAGE_OUTPUT_TOKENS] == 150 and root.attributes[n.RESPONSE_FINISH_REASONS] == ["length"]
    routes, workers = tree.kids(root, n.ROUTE), tree.kids(root, n.WORKER)
    assert routes[0].attributes[n.ROUTE_REASON] == "session" and routes[0].attributes[n.DECODE_WORKER] == victim
    migration = tree.kid(root, n.MIGRATION)
    assert [w.attributes[n.ATTEMPT] for w in workers] == [0, 1]
    first, second = workers
    assert first.attributes[n.DECODE_WORKER] == victim and first.status == "error"
    assert first.attributes[n.ERROR_TYPE] == "unavailable"
    assert second.attributes[n.DECODE_WORKER] == survivor and second.status != "error"
    assert second.attributes[n.TOKENS_SO_FAR] == migration.attributes[n.TOKENS_SO_FAR] > 0
    assert migration.attributes[n.FROM_WORKER] == victim and migration.attributes[n.TO_WORKER] == survivor
    assert routes[-1].attributes[n.ATTEMPT] == 1 and routes[-1].attributes["kvbus.route.excluded"] == [victim]
    in_order(routes[0], first)
    assert first.end_ns <= migration.start_ns + SLACK_NS
    in_order(routes[-1], second)
    assert second.start_ns <= migration.end_ns + SLACK_NS  # it ends at the new worker's first chunk
    # the survivor: the pages the dead worker and the prefill worker wrote through to L2 load back,
    # the short remainder is computed, and decoding goes on
    server = next(s for s in tree.named(WORKER_GENERATE.template, "kvbus-decode") if tree.is_under(s, second))
    assert server.attributes[n.WORKER_ID] == survivor and server.attributes[HOP_REQUEST_ID] == f"{rid}-1"
    queue, load_back, prefill, decode = (tree.kid(server, name) for name in
                                         (n.QUEUE, n.LOAD_BACK, n.PREFILL, n.DECODE))
    in_order(queue, prefill, decode)
    within(load_back, server)
    assert load_back.attributes[n.TIER] == "host" and load_back.attributes[n.PAGES] >= 10
    assert load_back.attributes[n.BYTES] > 0
    assert prefill.attributes[n.LOADED_TOKENS] == load_back.attributes[n.NUM_TOKENS] > 0
    assert prefill.attributes[n.COMPUTED_TOKENS] <= 100
    assert decode.attributes[n.NUM_TOKENS] == 150 - second.attributes[n.TOKENS_SO_FAR]
    # and the request id on the gateway's log line about the migration
    line = next(line for line in system.lines if "migrating" in line and rid in line)
    assert f"[{rid}]:" in line, line
