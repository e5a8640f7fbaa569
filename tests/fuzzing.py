"""Structure-aware fuzzing of every public surface: the public NATS subjects and the HTTP API.

:class:`FuzzSystem` runs the real services (tokenizer, router, an aggregated worker with the
real engine, the gateway with its HTTP port) on the in-memory bus, in an event loop on a
background thread, so hypothesis drives them from plain synchronous code. Each
:class:`Surface` pairs a hypothesis strategy of raw inputs (valid-ish JSON or MessagePack
built from the schemas, any JSON value, garbage bytes) with a sender that classifies what
came back:

- ``ok``: a valid reply (decodes as the subject's reply type; an HTTP 2xx body that parses);
- ``refused``: a typed error (any error code but ``internal``; an HTTP 4xx/429/503/504 with an
  OpenAI error body);
- ``crash``: ``internal``, HTTP 500, a reply that does not parse, a missing responder;
- ``hang``: no complete answer within ``hang_timeout``.

Generations stay cheap: the worker's context is 64 tokens, and valid-ish requests mostly ask
for one to four tokens. Used by tests/actor/test_fuzz.py (a modest, derandomized count in CI)
and bench/fuzz.py (>= 10,000 inputs per surface, with a table).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import strategies as st

from bus.core import REQUEST_ID_HEADER, SEQ_HEADER, STATUS_HEADER, STREAM_HEADER
from bus.transport import PROBE
from bus.errors import ERROR_CODE_HEADER, ErrorCode
from bus.memory import MemoryNetwork, memory_bus
from bus.subjects import (
    ALL_SUBJECTS,
    CANCEL,
    KV_EVENTS,
    KV_EVENTS_DUMP,
    GENERATE,
    GENERATE_ONCE,
    HEALTH,
    TOKENIZER_CHAT,
    TOKENIZER_DECODE,
    TOKENIZER_ENCODE,
    TOKENIZER_INFO,
    WORKER_HEALTH,
    Subject,
)
from schemas.common import CancelEvent

CONTEXT = 64
"""The worker's and the gateway's context length: no generation runs longer than this."""
MAX_PAYLOAD = 1 << 20
"""The in-memory bus refuses messages over this, as nats-server does by default."""
OUTCOMES = ("ok", "refused", "crash", "hang")


# --- strategies ---------------------------------------------------------------------------------

def _json_values() -> st.SearchStrategy:
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)


ANY_JSON = _json_values()
TEXT = st.text(max_size=160)
TOKEN_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=40) | st.lists(st.integers(), max_size=8)
SMALL_MAX_TOKENS = st.integers(1, 4)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", "", "USER"]) | st.text(max_size=8)
CONTENT = (TEXT | st.none() | ANY_JSON
           | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": TEXT}),
                      max_size=3))
BIG_TEXT = st.integers(MAX_PAYLOAD + 1, MAX_PAYLOAD + 4096).map(lambda n: "a" * n)
"""A prompt over max_payload (rarely drawn: hypothesis prefers small inputs)."""


def _extra_keys(base: st.SearchStrategy) -> st.SearchStrategy:
    """``base`` dicts, sometimes with an unknown key (which must be refused, by name)."""
    extra = st.dictionaries(st.sampled_from(["max_tokens", "foo", "temperature", "prompt_ids", "n"]), ANY_JSON,
                            min_size=1, max_size=2)
    return st.one_of(base, base, base, st.tuples(base, extra).map(lambda be: {**be[1], **be[0]} if be[0] else be[1]))


def _optional(**fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields)


def _maybe_bad(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a good value, sometimes any JSON value."""
    return st.one_of(good, good, good, ANY_JSON)


SAMPLING = st.fixed_dictionaries(
    {"max_tokens": _maybe_bad(SMALL_MAX_TOKENS)},
    optional={
        "temperature": _maybe_bad(st.floats(0, 2)), "top_p": _maybe_bad(st.floats(0, 1.5)),
        "top_k": _maybe_bad(st.integers(-3, 10**13)), "min_p": _maybe_bad(st.floats(-0.5, 1.5)),
        "seed": _maybe_bad(st.integers(-5, 2**64)), "stop": _maybe_bad(st.lists(st.text(max_size=300), max_size=20)),
        "stop_token_ids": _maybe_bad(st.lists(st.integers(-3, 2**40), max_size=8)),
        "ignore_eos": st.booleans(), "logprobs": _maybe_bad(st.integers(-1, 25)),
        "skip_special_tokens": st.booleans(),
    },
)
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": TEXT}), min_size=1, max_size=3)
MESSAGES = GOOD_MESSAGES | GOOD_MESSAGES | st.lists(
    _extra_keys(st.fixed_dictionaries({"role": ROLES, "content": CONTENT})), max_size=4)
GENERATE_BODY = _extra_keys(st.one_of(
    st.fixed_dictionaries({"prompt": _maybe_bad(TEXT)}, optional={"sampling": _extra_keys(SAMPLING)}),
    st.fixed_dictionaries({"messages": _maybe_bad(MESSAGES)}, optional={"sampling": _extra_keys(SAMPLING)}),
    st.fixed_dictionaries({"prompt_token_ids": _maybe_bad(TOKEN_IDS)}, optional={"sampling": _extra_keys(SAMPLING)}),
    _optional(prompt=TEXT, messages=MESSAGES, prompt_token_ids=TOKEN_IDS, sampling=SAMPLING, session_id=TEXT,
              model=st.sampled_from(["nope", ""]) | st.none(), stream_interval=st.integers(-2, 5),
              include_token_ids=st.booleans()),
).map(lambda body: body if "sampling" in body else {**body, "sampling": {"max_tokens": 2}}))
ENCODE_BODY = _extra_keys(st.fixed_dictionaries({"text": _maybe_bad(TEXT)},
                                              optional={"add_special_tokens": _maybe_bad(st.booleans())}))
DECODE_BODY = _extra_keys(st.fixed_dictionaries({"ids": _maybe_bad(TOKEN_IDS)},
                                              optional={"skip_special_tokens": _maybe_bad(st.booleans())}))
CHAT_BODY = _extra_keys(st.fixed_dictionaries({"messages": _maybe_bad(MESSAGES)},
                                            optional={"add_generation_prompt": _maybe_bad(st.booleans())}))
EMPTY_BODY = st.just({}) | _extra_keys(st.just({}))

OPENAI_SAMPLING = dict(
    temperature=_maybe_bad(st.floats(0, 2)),
    top_p=_maybe_bad(st.floats(0, 1.5)), top_k=_maybe_bad(st.integers(-3, 10**13)),
    min_p=_maybe_bad(st.floats(-0.5, 1.5)), seed=_maybe_bad(st.integers(-5, 2**64)),
    stop=_maybe_bad(st.text(max_size=8) | st.lists(st.text(max_size=300), max_size=20)),
    n=_maybe_bad(st.integers(0, 3)), stream=st.booleans(),
    stream_options=st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    logit_bias=st.dictionaries(st.text(max_size=5), st.floats(-200, 200), max_size=2),
    presence_penalty=st.floats(-2, 2), user=TEXT, ignore_eos=st.booleans(),
    stop_token_ids=_maybe_bad(st.lists(st.integers(-3, 2**40), max_size=8)), model=st.sampled_from(["nope"]),
)
COMPLETION_BODY = _extra_keys(st.fixed_dictionaries(
    {"prompt": _maybe_bad(TEXT | TOKEN_IDS | st.lists(TEXT, max_size=2) | st.lists(TOKEN_IDS, max_size=2)),
     "max_tokens": _maybe_bad(SMALL_MAX_TOKENS)},
    optional={**OPENAI_SAMPLING, "logprobs": _maybe_bad(st.integers(-1, 25)), "echo": st.booleans(),
              "best_of": st.integers(0, 3)}))
CHAT_COMPLETION_BODY = _extra_keys(st.fixed_dictionaries(
    {"messages": _maybe_bad(MESSAGES), "max_tokens": _maybe_bad(SMALL_MAX_TOKENS)},
    optional={**OPENAI_SAMPLING, "logprobs": _maybe_bad(st.booleans()), "top_logprobs": st.integers(-1, 25),
              "max_completion_tokens": _maybe_bad(SMALL_MAX_TOKENS), "tools": ANY_JSON,
              "response_format": ANY_JSON}))


@dataclasses.dataclass(frozen=True)
class RawInput:
    body: bytes
    content_type: str | None = None

    def __repr__(self) -> str:  # hypothesis prints failing inputs
        return f"RawInput({self.body[:300]!r}{'...' if len(self.body) > 300 else ''}, {self.content_type!r})"


def _msgpack_input(body: Any) -> RawInput:
    try:
        return RawInput(msgspec.msgpack.encode(body), "application/msgpack")
    except OverflowError:  # MessagePack holds no int past 64 bits: send that one as JSON
        return RawInput(msgspec.json.encode(body))


def raw_inputs(bodies: st.SearchStrategy, *, msgpack_too: bool = True) -> st.SearchStrategy:
    """Bodies as JSON, as MessagePack (with its content type), any JSON value, or garbage bytes.

    NATS inputs (``msgpack_too``) also get garbage content types; HTTP ones only header values
    an HTTP client can send.
    """
    json_body = bodies.map(lambda b: RawInput(msgspec.json.encode(b)))
    content_types = st.text(max_size=30) if msgpack_too else st.sampled_from(
        ["application/json", "text/plain", "application/msgpack", "multipart/form-data", "x/y; charset=latin-1"])
    options = [json_body, json_body, json_body, ANY_JSON.map(lambda v: RawInput(msgspec.json.encode(v))),
               st.binary(max_size=256).map(RawInput),
               st.tuples(st.binary(max_size=64), content_types).map(lambda bt: RawInput(bt[0], bt[1]))]
    if msgpack_too:
        options.append(bodies.map(_msgpack_input))
    return st.one_of(*options)


def oversized(bodies_with_prompt: Callable[[str], dict]) -> st.SearchStrategy:
    return BIG_TEXT.map(lambda text: RawInput(msgspec.json.encode(bodies_with_prompt(text))))


# --- the system under test -------------------------------------------------------------------------

class FuzzSystem:
    """The services on the in-memory bus, driven from other threads."""

    def __init__(self, model_dir, *, hang_timeout: float = 60.0):
        self.model_dir = model_dir
        self.hang_timeout = hang_timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.actors: list = []
        self.worker = None
        self.gateway = None
        self.client = None
        self.free_pages = 0

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "FuzzSystem":
        self._thread.start()
        self.run(self._start(), timeout=600)
        return self

    async def _start(self) -> None:
        from services.gateway import GatewayActor, GatewayConfig
        from services.router import RouterActor, RouterConfig
        from services.runner import bind_health
        from services.tokenizer import TokenizerActor, TokenizerConfig
        from services.workers import WorkerActor, WorkerConfig

        network = MemoryNetwork(max_payload=MAX_PAYLOAD)
        worker_config = WorkerConfig(model=str(self.model_dir), dtype="float32", kv_cache_memory=0.05,
                                     max_model_len=CONTEXT, heartbeat_interval=0.2)
        gateway_config = GatewayConfig(http_port=0, max_model_len=CONTEXT, max_request_bytes=2 * MAX_PAYLOAD,
                                       stream_stall_timeout=self.hang_timeout, generate_timeout=self.hang_timeout)
        for actor in (TokenizerActor(TokenizerConfig(model=str(self.model_dir))),
                      RouterActor(RouterConfig(), worker_id="router-0"),
                      WorkerActor(worker_config, worker_id="worker-0"),
                      GatewayActor(gateway_config, worker_id="gateway-0")):
            bus = memory_bus(network)
            await actor.start(bus)
            await bind_health(bus, actor)
            self.actors.append((actor, bus))
        self.worker = self.actors[2][0]
        self.gateway = self.actors[3][0]
        self.free_pages = self.worker.engine.block_manager.num_free_pages
        self.client = memory_bus(network)
        router = self.actors[1][0]
        deadline = time.monotonic() + 30
        while "worker-0" not in router.router.workers.known_ids():
            assert time.monotonic() < deadline, "the router never heard the worker"
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        async def stop():
            await self.client.close()
            for actor, bus in reversed(self.actors):
                await actor.drain(5.0)
                await bus.drain(timeout=5)
                await actor.stop()

        try:
            self.run(stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def leaks(self, timeout: float = 60.0) -> list[str]:
        """What is still held once every answer is in: engine work, pages, gateway requests, bus handlers."""
        async def check() -> list[str]:
            engine = self.worker.engine
            deadline = time.monotonic() + timeout
            while True:
                problems = []
                if engine.has_unfinished():
                    problems.append(f"engine still has {engine.num_running + engine.num_waiting} requests")
                if engine.block_manager.num_free_pages != self.free_pages:
                    problems.append(f"{self.free_pages - engine.block_manager.num_free_pages} KV pages not freed")
                if self.gateway.pipeline.num_inflight:
                    problems.append(f"gateway has {self.gateway.pipeline.num_inflight} requests in flight")
                if not problems or time.monotonic() > deadline:
                    return problems
                await asyncio.sleep(0.05)

        return self.run(check(), timeout=timeout + 10)

    def alive(self) -> list[str]:
        """Roles that do not answer health (a crashed service)."""
        from schemas.common import HealthRequest

        async def check() -> list[str]:
            dead = []
            for role in ("tokenizer", "router", "worker", "gateway"):
                try:
                    if not (await self.client.request(HEALTH, HealthRequest(), timeout=10, role=role)).ready:
                        dead.append(role)
                except Exception:
                    dead.append(role)
            return dead

        return self.run(check(), timeout=60)

    # --- one input on a NATS subject ----------------------------------------------------------------
    def send_nats(self, subject: Subject, raw: RawInput, **params: str) -> tuple[str, str]:
        """(outcome, detail) for one raw message on ``subject``."""
        try:
            return self.run(self._send_nats(subject, raw, params), timeout=self.hang_timeout + 30)
        except TimeoutError:
            return "hang", "the event loop did not answer"

    async def _send_nats(self, subject: Subject, raw: RawInput, params: dict[str, str]) -> tuple[str, str]:
        transport = self.client.transport
        queue: asyncio.Queue = asyncio.Queue()
        inbox = transport.new_inbox()

        async def on_reply(msg) -> None:
            queue.put_nowait(msg)

        sub = await transport.subscribe(inbox, on_reply)
        request_id = f"fuzz-{time.monotonic_ns()}"
        headers = {REQUEST_ID_HEADER: request_id}
        if raw.content_type is not None:
            headers["Content-Type"] = raw.content_type
        finished = False
        try:
            try:
                await transport.publish(subject.format(**params), raw.body, headers, reply=inbox)
            except ValueError:
                finished = True
                return "refused", "over max_payload: refused by the client library"
            deadline = time.monotonic() + self.hang_timeout
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    return "hang", f"no answer within {self.hang_timeout:g}s"
                h = msg.headers or {}
                if h.get(STATUS_HEADER) == "503":
                    finished = True
                    return "crash", "no responders: the service is gone"
                code = h.get(ERROR_CODE_HEADER)
                if code is not None:
                    finished = True
                    if code not in {c.value for c in ErrorCode} or code == ErrorCode.INTERNAL.value:
                        return "crash", f"{code}: {h.get('Kvbus-Error-Message')}"
                    return "refused", code
                from bus.codec import Encoding, decode

                enc = Encoding.from_header(h.get("Content-Type"), subject.encoding)
                if not subject.streamed:
                    decode(msg.data, subject.reply, enc)
                    finished = True
                    return "ok", "reply"
                if h.get(STREAM_HEADER) == PROBE:  # the server asks whether we still read: ignore it
                    continue
                if h.get(STREAM_HEADER) == "end":
                    finished = True
                    return "ok", "stream"
                if h.get(STREAM_HEADER) != "chunk" or SEQ_HEADER not in h:
                    return "crash", f"a stream message without stream headers: {h}"
                decode(msg.data, subject.reply, enc)
        except Exception as exc:  # a reply that does not decode
            return "crash", f"bad reply: {exc!r}"
        finally:
            await sub.unsubscribe()
            if not finished and subject.streamed:
                await self.client.publish(CANCEL, CancelEvent(request_id=request_id))

    # --- one input on an HTTP endpoint ----------------------------------------------------------------
    def send_http(self, http, method: str, path: str, raw: RawInput | None) -> tuple[str, str]:
        import httpx

        headers = {"content-type": raw.content_type or "application/json"} if raw is not None else {}
        try:
            # an absolute URL: a relative "//x" would be read as a host by the client, never sent
            r = http.request(method, self.http_url + path, content=raw.body if raw is not None else None,
                             headers=headers,
                             timeout=self.hang_timeout)
        except httpx.TimeoutException:
            return "hang", f"no answer within {self.hang_timeout:g}s"
        except httpx.HTTPError as exc:
            return "crash", f"connection failed: {exc!r}"
        if r.status_code >= 500 and r.status_code not in (503, 504):
            return "crash", f"HTTP {r.status_code}: {r.text[:300]}"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return ("ok", "metrics") if r.status_code == 200 and b"kvbus_" in r.content else ("crash", r.text[:200])
        try:
            if r.status_code != 200:
                body = r.json()
                if path == "/health":
                    return "refused", str(r.status_code)
                error = body["error"]
                assert isinstance(error["message"], str) and isinstance(error["type"], str)
                return "refused", str(r.status_code)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
                assert events and events[-1] == "[DONE]", "the stream did not end with [DONE]"
                for event in events[:-1]:
                    data = msgspec.json.decode(event)
                    if "error" in data:
                        code = data["error"].get("code")
                        if code in (ErrorCode.INTERNAL.value, None):
                            return "crash", f"stream error: {data['error']}"
                        return "refused", f"stream error {code}"
                return "ok", "stream"
            body = r.json()
            assert isinstance(body, dict)
            return "ok", str(r.status_code)
        except Exception as exc:
            return "crash", f"unparseable HTTP {r.status_code} answer: {exc!r}: {r.text[:300]}"


# --- the surfaces ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Surface:
    name: str
    inputs: st.SearchStrategy
    send: Callable[[FuzzSystem, Any, Any], tuple[str, str]]
    """(system, http client, input) -> (outcome, detail)."""


def _nats(subject: Subject, bodies: st.SearchStrategy, extra: st.SearchStrategy | None = None,
          **params: str) -> Surface:
    inputs = raw_inputs(bodies)
    if extra is not None:
        inputs = st.one_of(inputs, extra)
    return Surface(f"nats {subject.format(**params)}", inputs,
                   lambda system, http, raw: system.send_nats(subject, raw, **params))


def _http_post(path: str, bodies: st.SearchStrategy, big: Callable[[str], dict]) -> Surface:
    inputs = st.one_of(raw_inputs(bodies, msgpack_too=False), oversized(big))
    return Surface(f"http POST {path}", inputs, lambda system, http, raw: system.send_http(http, "POST", path, raw))


def _http_get() -> Surface:
    paths = st.sampled_from(["/v1/models", "/health", "/metrics"])
    queries = st.text(st.characters(codec="ascii", min_codepoint=32, max_codepoint=126, exclude_characters="#"), max_size=40)
    inputs = st.tuples(paths, queries)
    return Surface("http GET /v1/models /health /metrics", inputs,
                   lambda system, http, pq: system.send_http(http, "GET", f"{pq[0]}?{pq[1]}", None))


def _http_other() -> Surface:
    """Unknown paths and wrong methods: a 404/405 with an OpenAI error body."""
    methods = st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"])
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/embeddings", "/",
                             "/v1", "/v1/"]) | st.text(st.characters(codec="ascii", min_codepoint=33, max_codepoint=126,
                                                                     exclude_characters="#?%"), max_size=30
                                                       ).map(lambda p: "/" + p)
    inputs = st.tuples(methods, paths).filter(lambda mp: not (mp[0] == "POST" and mp[1] in (
        "/v1/completions", "/v1/chat/completions")) and not (mp[0] == "GET" and mp[1] == "/v1/models"))
    return Surface("http other methods/paths", inputs,
                   lambda system, http, mp: system.send_http(http, mp[0], mp[1], RawInput(b"{}")))


SURFACES: list[Surface] = [
    _nats(GENERATE, GENERATE_BODY, oversized(lambda text: {"prompt": text, "sampling": {"max_tokens": 1}})),
    _nats(GENERATE_ONCE, GENERATE_BODY),
    _nats(TOKENIZER_ENCODE, ENCODE_BODY),
    _nats(TOKENIZER_DECODE, DECODE_BODY),
    _nats(TOKENIZER_CHAT, CHAT_BODY),
    _nats(TOKENIZER_INFO, EMPTY_BODY),
    _nats(HEALTH, EMPTY_BODY, role="gateway"),
    _nats(WORKER_HEALTH, EMPTY_BODY, role="worker", worker_id="worker-0"),
    _nats(KV_EVENTS_DUMP, EMPTY_BODY, worker_id="worker-0"),
    _http_post("/v1/completions", COMPLETION_BODY, lambda text: {"prompt": text, "max_tokens": 1}),
    _http_post("/v1/chat/completions", CHAT_COMPLETION_BODY,
               lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    _http_get(),
    _http_other(),
]
"""Every public subject (bus/subjects.py public=True) and every HTTP endpoint."""

assert {s.template for s in ALL_SUBJECTS if s.public} == {
    GENERATE.template, GENERATE_ONCE.template, TOKENIZER_ENCODE.template, TOKENIZER_DECODE.template,
    TOKENIZER_CHAT.template, TOKENIZER_INFO.template, HEALTH.template, WORKER_HEALTH.template,
    KV_EVENTS_DUMP.template,
    # KV events flow out of kvbus (engines and the kv_store publish, consumers subscribe); no
    # kvbus service subscribes to them yet, so there is nothing to feed garbage to.
    KV_EVENTS.template,
}, "a public subject was added: give it a fuzz surface here"


def tally() -> Counter:
    return Counter({o: 0 for o in OUTCOMES})
