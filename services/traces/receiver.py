"""A local OTLP/HTTP trace receiver: what ``kvbus up --trace`` starts so that traces need no Jaeger.

Every service exports its spans to ``POST /v1/traces`` (OTLP/HTTP: protobuf, or OTLP's JSON); the
receiver decodes them with the OpenTelemetry proto package (services/traces/spans.py) and appends one
JSON line per span to a file, which ``kvbus trace`` reads. When the file passes ``max_bytes`` it is
moved to ``FILE.1`` (the one before is dropped) and a new one begins.

Run by ``kvbus up`` as ``python -m services.traces.receiver --port P --file F`` (a supervised child).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from services.traces.spans import Span, decode_otlp

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_FILE_BYTES = 256 * 1024 * 1024


class SpanFile:
    """Appends spans as JSON lines, one writer at a time, rotating past ``max_bytes``."""

    def __init__(self, path: str | Path, max_bytes: int = MAX_FILE_BYTES):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.num_spans = 0
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, spans: list[Span]) -> None:
        if not spans:
            return
        text = "".join(s.to_json() + "\n" for s in spans)
        with self._lock:
            try:
                if self.path.stat().st_size + len(text) > self.max_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            except FileNotFoundError:
                pass
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
            self.num_spans += len(spans)


def make_server(host: str, port: int, sink: SpanFile) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) taking OTLP/HTTP traces into ``sink``; port 0: a free one."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    ok_body = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/v1/traces":
                return self._answer(404, b"only POST /v1/traces (OTLP/HTTP traces)")
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                return self._answer(400 if length <= 0 else 413, b"a body of 1 B to 64 MiB is expected")
            body = self.rfile.read(length)
            try:
                spans = decode_otlp(body, self.headers.get("Content-Type", "application/x-protobuf"))
            except ValueError as exc:
                return self._answer(400, str(exc).encode())
            try:
                sink.append(spans)
            except OSError as exc:
                log.error("could not write %d spans to %s: %s", len(spans), sink.path, exc)
                return self._answer(503, b"cannot write spans")
            self._answer(200, ok_body, "application/x-protobuf")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:  # one line per export would drown kvbus up's log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.traces.receiver", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--file", required=True, help="JSON-lines file the spans are appended to")
    parser.add_argument("--max-bytes", type=int, default=MAX_FILE_BYTES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = make_server(args.host, args.port, SpanFile(args.file, args.max_bytes))
    except OSError as exc:
        print(f"trace receiver: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    log.info("OTLP/HTTP traces on http://%s:%d/v1/traces, written to %s", args.host, server.server_port, args.file)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
