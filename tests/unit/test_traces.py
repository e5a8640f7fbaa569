"""Traces without a system: the request recorder (bus/tracing), the engine timelines, the OTLP/HTTP
receiver fed by OpenTelemetry's own exporter, the file and Jaeger readers, the waterfall and
``kvbus trace``, and the flags ``kvbus up --trace`` gives the services."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

import bus.tracing as tracing
from bus.subjects import DEBUG_ECHO, GENERATE
from bus.tracing import names as n
from bus.tracing.logs import RequestIdFilter
from bus.tracing.setup import RequestIdOnEverySpan, TracingConfig, traces_url
from bus.transport import REQUEST_ID_HEADER
from services import config as cfg
from services.engine.timeline import Timelines
from services.traces import jaeger
from services.traces.receiver import SpanFile, make_server
from services.traces.spans import Span, find_trace, last_trace, read_file
from services.traces.waterfall import render
from tests.spans import exporter  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "jaeger_trace.json"


# --- the recorder -----------------------------------------------------------------------------------
def test_a_request_trace_records_stages_spans_after_the_fact_and_errors(exporter):
    root = tracing.RequestTrace.start("root", {}, request_id="req-1", attributes={"a": 1, "none": None})
    with root.stage("tokenize") as stage:
        assert tracing.request_id() == "req-1"  # current inside the stage, with the request id
        inner = tracing.RequestTrace.current()
        inner.set({"kvbus.tokens": 3})
    t0 = time.monotonic()
    decode = root.record("decode", t0, t0 + 0.25, {"kvbus.steps": 4},
                         events=[("decode.steps", t0 + 0.1, {"kvbus.steps": 2})])
    decode.record("speculation", t0, t0 + 0.25, {n.DRAFTER: "ngram"})
    with pytest.raises(tracing_errors().InvalidArgument):
        with root.stage("route"):
            raise tracing_errors().InvalidArgument("bad")
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"root", "tokenize", "decode", "speculation", "route"}
    assert spans["root"].attributes == {"a": 1, tracing.REQUEST_ID: "req-1"}
    assert spans["tokenize"].attributes["kvbus.tokens"] == 3  # (set through the current span inside the stage)
    assert stage.span.get_span_context().span_id == spans["tokenize"].context.span_id
    assert all(s.attributes[tracing.REQUEST_ID] == "req-1" for s in spans.values())
    d = spans["decode"]
    assert d.start_time == tracing.to_epoch_ns(t0) and d.end_time - d.start_time == 250_000_000
    assert [e.name for e in d.events] == ["decode.steps"] and d.events[0].timestamp == tracing.to_epoch_ns(t0 + 0.1)
    assert spans["speculation"].parent.span_id == d.context.span_id
    assert spans["route"].status.status_code == trace.StatusCode.ERROR
    assert spans["route"].attributes[tracing.ERROR_CODE] == "invalid_argument"
    assert {s.parent.span_id for name, s in spans.items() if name in ("tokenize", "decode", "route")} == \
        {spans["root"].context.span_id}


def tracing_errors():
    import bus.errors

    return bus.errors


def test_nothing_is_recorded_outside_a_trace_and_no_trace_costs_nothing(exporter):
    headers: dict[str, str] = {}
    with tracing.client_span("background request", headers) as span:  # a heartbeat, a draft proposal
        assert not span.is_recording()
    assert "traceparent" not in headers
    with tracing.server_span(DEBUG_ECHO.template, {REQUEST_ID_HEADER: "bg"}) as span:  # no caller's trace
        assert not span.is_recording() and tracing.request_id() == "bg"  # (the logs still get the id)
    with tracing.server_span(GENERATE.template, {REQUEST_ID_HEADER: "entry"}) as span:  # an entry starts one
        assert span.is_recording()
        child_headers: dict[str, str] = {}
        with tracing.client_span("hop", child_headers):
            pass
        assert child_headers["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
        assert "kvbus.request_id=entry" in child_headers["baggage"]
        with tracing.untraced():
            quiet: dict[str, str] = {}
            tracing.inject(quiet)
            assert "traceparent" not in quiet and "kvbus.request_id=entry" in quiet["baggage"]
    assert [s.name for s in exporter.get_finished_spans()] == ["hop", GENERATE.template]
    none = tracing.NO_TRACE
    assert not none.is_recording and none.open("x") is none and none.record("x", 0, 1) is none
    with none.stage("x") as s:
        assert s is none
    none.set({"a": 1}), none.event("e"), none.error("internal", "x"), none.end()
    assert len(exporter.get_finished_spans()) == 2


def test_a_callers_baggage_is_dropped_but_for_the_request_id(exporter):
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "baggage": "user.secret=abc,kvbus.request_id=outer", REQUEST_ID_HEADER: "hop-1"}
    with tracing.server_span(DEBUG_ECHO.template, headers, **{tracing.REQUEST_ID: "hop-1"}) as span:
        out: dict[str, str] = {}
        tracing.inject(out)
    assert out["baggage"] == "kvbus.request_id=outer"
    assert span.attributes[tracing.REQUEST_ID] == "outer" and span.attributes[tracing.HOP_REQUEST_ID] == "hop-1"
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"


def test_parent_based_sampling_follows_the_callers_decision(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))  # the gateway samples nothing
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    with tracing.server_span(GENERATE.template, {}) as span:
        assert not span.is_recording()
        assert not tracing.RequestTrace.current().is_recording  # the no-op recorder
        unsampled: dict[str, str] = {}
        tracing.inject(unsampled)
    assert int(unsampled["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # the decision travels: not sampled
    sampled = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.server_span(GENERATE.template, sampled) as span:
        assert span.is_recording()  # a caller's sampled trace is honoured
    assert [s.name for s in exporter.get_finished_spans()] == [GENERATE.template]


def test_the_request_id_is_on_every_log_line_of_a_request(exporter):
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    with tracing.server_span(DEBUG_ECHO.template, {REQUEST_ID_HEADER: "rid-7"}):
        assert RequestIdFilter().filter(record)
    assert record.kvbus_request == " [rid-7]"
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    RequestIdFilter().filter(outside)
    assert outside.kvbus_request == ""


def test_tracing_config():
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces" == traces_url("http://h:4318/v1/traces/")
    assert cfg.build(TracingConfig, {"trace_sample_ratio": "0.25"}).trace_sample_ratio == 0.25
    with pytest.raises(cfg.ConfigError, match="trace-sample-ratio"):
        cfg.build(TracingConfig, {"trace_sample_ratio": "1.5"})
    assert cfg.build(TracingConfig, {}, env={"KVBUS_OTLP_ENDPOINT": "http://j:4318"}).otlp_endpoint == "http://j:4318"


# --- the engine's timelines -------------------------------------------------------------------------
class _Seq:
    def __init__(self, rid: str):
        self.request_id, self.arrival_time = rid, 1.0
        self.num_output_tokens = self.num_drafted_tokens = self.num_accepted_tokens = 0
        self.detok = SimpleNamespace(add=lambda token: False, take=lambda finished: "x")


def test_timelines_count_steps_and_summarise_every_n_decode_steps():
    timelines = Timelines(event_every=4)
    a, b = _Seq("a"), _Seq("b")
    tl = timelines.track("a")
    engine = SimpleNamespace(last_batch=None, scheduler=SimpleNamespace(loading=[]))
    engine.last_batch = SimpleNamespace(seqs=[a, b], num_new_tokens=[30, 30], num_decode=0)  # both prefill
    timelines.after_step(engine, 10.0, 10.5)
    assert tl.admitted_at == 10.0 and tl.prefill_from == 10.0 and tl.prefill_end == 10.5
    assert tl.num_prefill_tokens == 30 and tl.seq is a and tl.arrived_at == 1.0
    assert a.detok.add(5) is False and tl.num_detok_calls == 1  # its detokenizer is timed from now on
    for step in range(9):  # decoding beside b: a batch of 2, then (b gone) of 1
        a.num_output_tokens += 1
        seqs = [a, b] if step < 5 else [a]
        engine.last_batch = SimpleNamespace(seqs=seqs, num_new_tokens=[1] * len(seqs), num_decode=len(seqs))
        timelines.after_step(engine, 11.0 + step, 11.5 + step)
    assert tl.num_decode_steps == 9 and tl.first_decode_at == 11.0 and tl.last_step_end == 19.5
    assert (tl.batch_min, tl.batch_max, tl.batch_sum) == (1, 2, 5 * 2 + 4)
    assert [(e[0], e[1], e[2], e[3]) for e in tl.events] == [(14.5, 4, 4, 2.0), (18.5, 8, 8, 1.25)]
    timelines.untrack("a")
    assert not timelines


# --- the receiver, fed by OpenTelemetry's own exporter --------------------------------------------------
@pytest.fixture
def receiver(tmp_path):
    sink = SpanFile(tmp_path / "spans.jsonl")
    server = make_server("127.0.0.1", 0, sink)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", sink
    server.shutdown()
    server.server_close()


def test_the_receiver_decodes_otlp_protobuf_into_the_file(receiver, monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    url, sink = receiver
    provider = TracerProvider(resource=Resource.create({"service.name": "kvbus-test"}))
    provider.add_span_processor(RequestIdOnEverySpan())
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=traces_url(url))))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    root = tracing.RequestTrace.start("root", {}, request_id="req-9")
    t0 = time.monotonic()
    root.record("decode", t0, t0 + 0.01, {n.NUM_STEPS: 16, n.BATCH_SIZE_MEAN: 1.5, "flags": [1, 2]},
                events=[(n.STEP_EVENT, t0 + 0.005, {n.NUM_STEPS: 16})])
    with pytest.raises(tracing_errors().Overloaded):
        with root.stage("route"):
            raise tracing_errors().Overloaded("busy")
    root.end()
    provider.shutdown()
    spans = {s.name: s for s in read_file(sink.path)}
    assert set(spans) == {"root", "decode", "route"} and sink.num_spans == 3
    decode, route, top = spans["decode"], spans["route"], spans["root"]
    assert decode.service == "kvbus-test" and decode.parent_id == top.span_id and top.parent_id is None
    assert decode.attributes == {n.NUM_STEPS: 16, n.BATCH_SIZE_MEAN: 1.5, "flags": [1, 2],
                                 tracing.REQUEST_ID: "req-9"}
    assert decode.end_ns - decode.start_ns == 10_000_000 and decode.events[0][0] == n.STEP_EVENT
    assert route.status == "error" and route.status_message == "busy" and route.attributes["error.type"] == "overloaded"
    assert find_trace(spans.values(), "req-9") and last_trace(spans.values())[0].trace_id == top.trace_id
    import httpx

    assert httpx.post(url + "/v1/traces", content=b"\xff\x00garbage",
                      headers={"Content-Type": "application/x-protobuf"}).status_code == 400
    assert httpx.post(url + "/v1/metrics", content=b"x").status_code == 404


# --- Jaeger's query API and the waterfall ----------------------------------------------------------------
def test_a_trace_from_jaeger_reads_as_the_same_tree():
    spans = jaeger.parse_trace(json.loads(FIXTURE.read_text()))
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    [root] = by_name["POST /v1/chat/completions"]
    assert root.service == "kvbus-gateway" and root.kind == "server" and root.status == "unset"
    assert root.parent_id == "b7ad6b7169203331" and root.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert root.attributes[n.RESPONSE_FINISH_REASONS] == ["length"]  # (a JSON string in Jaeger)
    assert isinstance(root.attributes[n.USAGE_OUTPUT_TOKENS], int) and root.attributes[n.TTFT_S] > 0
    assert "span.kind" not in root.attributes and "otel.scope.name" not in root.attributes
    rid = root.request_id
    assert rid.startswith("chatcmpl-") and all(s.request_id == rid for s in spans)
    ids = {s.span_id: s for s in spans}
    [decode] = [s for s in by_name[n.DECODE] if s.service == "kvbus-decode"]
    assert decode.events and all(e[0] == n.STEP_EVENT for e in decode.events)
    assert len(decode.events) == decode.attributes[n.NUM_STEPS] // decode.attributes["kvbus.step_event_every"]
    chain = [decode]
    while chain[-1].parent_id in ids:
        chain.append(ids[chain[-1].parent_id])
    assert [s.name for s in chain][-2:] == [n.WORKER, root.name]
    text = render(spans)
    order = [next(i for i, line in enumerate(text.splitlines()) if f" {name} [" in line) for name in
             (n.CHAT_TEMPLATE, n.ROUTE, n.REMOTE_PREFILL, n.PREFILL, n.KV_SEND, n.KV_RECEIVE, n.DECODE, n.STREAM_OUT)]
    assert order == sorted(order), text
    assert text.splitlines()[0].startswith(f"trace {root.trace_id}  request {rid}")


@pytest.fixture
def fake_jaeger():
    doc = json.loads(FIXTURE.read_text())
    trace_id = doc["data"][0]["traceID"]
    rid = next(t["value"] for s in doc["data"][0]["spans"] for t in s["tags"] if t["key"] == tracing.REQUEST_ID)
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            if self.path == f"/api/traces/{trace_id}":
                body = json.dumps(doc).encode()
            elif self.path.startswith("/api/traces?") and rid in self.path:
                body = json.dumps({"data": doc["data"]}).encode()
            elif self.path.startswith("/api/traces?"):
                body = b'{"data": []}'
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", trace_id, rid, seen
    server.shutdown()
    server.server_close()


def test_kvbus_trace_reads_jaeger_and_the_local_file(fake_jaeger, tmp_path):
    url, trace_id, rid, seen = fake_jaeger
    assert {s.trace_id for s in jaeger.fetch_trace(url, trace_id)} == {trace_id}
    assert {s.request_id for s in jaeger.fetch_trace(url, rid)} == {rid}
    assert any("service=kvbus-gateway" in p and "tags=" in p for p in seen)
    with pytest.raises(jaeger.JaegerError, match="no trace of request nope"):
        jaeger.fetch_trace(url, "nope")
    with pytest.raises(jaeger.JaegerError, match="no trace"):
        jaeger.fetch_trace(url, "f" * 32)

    def kvbus_trace(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "trace", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    out = kvbus_trace(rid, "--jaeger-url", url, "--events")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"trace {trace_id}  request {rid}") and "· decode.steps" in out.stdout
    spans_file = tmp_path / "traces.jsonl"
    spans_file.write_text("".join(s.to_json() + "\n" for s in jaeger.parse_trace(json.loads(FIXTURE.read_text()))))
    last = kvbus_trace("--last", "--file", str(spans_file))
    assert last.returncode == 0 and last.stdout.splitlines()[0] == out.stdout.splitlines()[0]
    as_json = kvbus_trace(trace_id, "--file", str(spans_file), "--json")
    assert {Span.from_dict(json.loads(line)).trace_id for line in as_json.stdout.splitlines()} == {trace_id}
    missing = kvbus_trace("nope", "--file", str(spans_file))
    assert missing.returncode == 1 and "no trace of nope" in missing.stderr
    empty = kvbus_trace("--last", "--file", str(tmp_path / "none.jsonl"))
    assert empty.returncode == 1 and "kvbus up --trace" in empty.stderr


# --- kvbus up --trace -----------------------------------------------------------------------------------
def test_kvbus_up_passes_the_receiver_and_the_ratio_to_every_service():
    from services.cli import serve_parser
    from services.registry import actor_class
    from services.up.config import UpConfig
    from services.up.roles import Site, plan

    config = UpConfig(trace=True, trace_sample_ratio=0.5, prefill=1, decode=1)
    site = Site(nats_url="nats://127.0.0.1:4222", model_dir="/m", http_port=8000, otlp_endpoint="http://127.0.0.1:4999")
    planned = plan(config, site, cores=list(range(8)))
    for child in planned.children:
        argv = child.argv
        assert argv[argv.index("--otlp-endpoint") + 1] == "http://127.0.0.1:4999", child.name
        assert argv[argv.index("--trace-sample-ratio") + 1] == "0.5"
        role = argv[argv.index("serve") + 1]
        args = serve_parser(role, actor_class(role)).parse_args(argv[argv.index("serve") + 2:])
        assert args.otlp_endpoint == "http://127.0.0.1:4999" and args.trace_sample_ratio == "0.5"
    untraced = plan(UpConfig(prefill=1, decode=1), Site(nats_url="nats://x:1", model_dir="/m", http_port=1),
                    cores=list(range(8)))
    assert all("--otlp-endpoint" not in c.argv for c in untraced.children)
    with pytest.raises(cfg.ConfigError, match="trace-sample-ratio"):
        UpConfig(trace_sample_ratio=-0.1)
