"""``GET /metrics`` over plain asyncio: an actor's Prometheus registry for scrapers.

Engines and the kv_store have no HTTP server of their own; this is the smallest
one that serves a :class:`prometheus_client.CollectorRegistry` on the actor's
event loop (no thread): one request per connection, ``GET``/``HEAD /metrics``
answered with the text exposition format, any other path 404, any other method
405. Scrapes are rare and collecting reads counters the actor already keeps, so
rendering on the loop is cheap. An actor starts it with :func:`start_metrics`
(port 0 in its config: no server) and stops it when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

MAX_HEADER_LINES = 100
READ_TIMEOUT_S = 10.0
"""A client that sends no complete request head in this time is dropped."""


class MetricsServer:
    """Serves ``registry`` at ``http://host:port/metrics``; ``port`` 0 binds a free port (see ``.port``)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self.registry, self.host, self.port = registry, host, port
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                method, path = await _read_head(reader)
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"only GET and HEAD\n", "text/plain"
            elif path.split("?", 1)[0] != "/metrics":
                status, body, ctype = "404 Not Found", b"metrics are at /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except _BadRequest:
            with contextlib.suppress(ConnectionError):
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a client that went away or never spoke: nothing to answer
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class _BadRequest(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str]:
    """(method, target) of the request line; the headers are read and ignored."""
    try:
        line = await reader.readline()
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise _BadRequest
        for _ in range(MAX_HEADER_LINES):
            header = await reader.readline()
            if header in (b"\r\n", b"\n"):
                return parts[0], parts[1]
            if not header:
                raise asyncio.IncompleteReadError(header, None)
    except ValueError:  # a line past the reader's limit (64 KiB)
        raise _BadRequest from None
    raise _BadRequest


async def start_metrics(registry: CollectorRegistry, host: str, port: int, who: str) -> MetricsServer | None:
    """The server an actor's config asks for: none when ``port`` is 0, else started on it."""
    if port == 0:
        return None
    server = MetricsServer(registry, host, port)
    await server.start()
    log.info("%s: Prometheus metrics at %s", who, server.url)
    return server
