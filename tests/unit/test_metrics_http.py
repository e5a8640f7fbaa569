"""The engines' and kv_store's ``GET /metrics`` server: a real socket on 127.0.0.1, a free port."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from services.metrics_http import MetricsServer, start_metrics

pytestmark = pytest.mark.anyio


@pytest.fixture
async def server():
    registry = CollectorRegistry()
    counter = Counter("kvbus_test_things", "Things counted.", registry=registry)
    srv = MetricsServer(registry, "127.0.0.1", 0)
    await srv.start()
    yield srv, counter
    await srv.stop()


def sample(text: str, name: str) -> float:
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def test_metrics_served_and_live(server):
    srv, counter = server
    assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(srv.url)
        assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
        assert sample(r.text, "kvbus_test_things_total") == 0
        counter.inc(3)
        r = await client.get(srv.url + "?x=1")  # a query string is ignored
        assert sample(r.text, "kvbus_test_things_total") == 3
        head = await client.head(srv.url)
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0


async def test_other_paths_404_other_methods_405(server):
    srv, _ = server
    base = f"http://127.0.0.1:{srv.port}"
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(base + "/")).status_code == 404
        assert (await client.get(base + "/metricsx")).status_code == 404
        assert (await client.post(base + "/metrics", content=b"x")).status_code == 405
        assert (await client.get(base + "/metrics")).status_code == 200  # still serving


async def test_garbage_and_silent_clients_do_not_stop_it(server):
    srv, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"not http at all\r\n\r\n")
    await writer.drain()
    assert (await asyncio.wait_for(reader.read(), 30)).startswith(b"HTTP/1.1 400 ")
    writer.close()
    _, silent = await asyncio.open_connection("127.0.0.1", srv.port)  # connects, never speaks
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 30)
    assert reply.startswith(b"HTTP/1.1 200 OK") and b"kvbus_test_things_total 0.0" in reply
    writer.close()
    silent.close()


async def test_stop_closes_the_port():
    srv = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    await srv.start()
    port = srv.port
    await srv.stop()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_port_zero_in_config_means_no_server():
    assert await start_metrics(CollectorRegistry(), "127.0.0.1", 0, "test") is None
