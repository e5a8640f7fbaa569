"""kvbus up's Prometheus ports: one per kv_store and engine worker, consecutive from a base, checked free."""

from __future__ import annotations

import socket

import pytest

from services.natsd import free_port
from services.up.config import UpConfig
from services.up.placement import metrics_ports
from services.up.roles import Site, plan as plan_for


def test_consecutive_ports_from_a_free_base():
    for _ in range(20):  # a base whose next port is free too (other processes may hold ports)
        base = free_port()
        try:
            got = metrics_ports(["kv_store-0", "worker-0"], base)
            break
        except RuntimeError:
            continue
    assert got == {"kv_store-0": base, "worker-0": base + 1}


def test_a_taken_port_is_refused_with_the_way_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"metrics port {port} .*--metrics-port 0"):
            metrics_ports(["worker-0"], port)
    with pytest.raises(RuntimeError, match="taken"):
        metrics_ports(["worker-0", "worker-1"], 20000, avoid={20001})
    with pytest.raises(RuntimeError):
        metrics_ports(["a", "b"], 65535)


def test_zero_gives_distinct_free_ports_and_minus_one_none():
    got = metrics_ports([f"w{i}" for i in range(5)], 0, avoid={8000})
    assert len(set(got.values())) == 5 and 8000 not in got.values()
    assert metrics_ports(["w0"], -1) == {}


def _args(**kw) -> UpConfig:
    base = dict(hicache=True, layout="disaggregated", prefill=1, decode=1, speculative="off", share_cores=True,
                kv_cache_memory=0.5, metrics_port=0)
    return UpConfig(**{**base, **kw})


def plan(config: UpConfig, nats_url: str, model_dir: str):
    """(roles, children) for ``config``."""
    planned = plan_for(config, Site(nats_url=nats_url, model_dir=model_dir, http_port=config.http_port))
    return planned.roles, planned.children


def test_plan_gives_every_service_but_the_gateway_a_metrics_port():
    roles, children = plan(_args(), "nats://127.0.0.1:4222", "/models/x")
    by_name = {c.name: c for c in children}
    metered = {"tokenizer-0", "kv_store-0", "router-0", "prefill-0", "decode-0"}
    assert {c.name for c in children if c.metrics_port is not None} == metered
    for name in metered:
        argv = by_name[name].argv
        assert argv[argv.index("--metrics-port") + 1] == str(by_name[name].metrics_port)
    assert "--metrics-port" not in by_name["gateway-0"].argv  # its /metrics is on the HTTP port
    _, children = plan(_args(metrics_port=-1), "nats://127.0.0.1:4222", "/models/x")
    assert all(c.metrics_port is None and "--metrics-port" not in c.argv for c in children)


def test_no_hicache_prefault_reaches_the_store_and_every_engine():
    _, children = plan(_args(), "nats://127.0.0.1:4222", "/models/x")
    assert not any("--no-hicache-prefault" in c.argv for c in children)
    _, children = plan(_args(hicache_prefault=False), "nats://127.0.0.1:4222", "/models/x")
    told = {c.name for c in children if "--no-hicache-prefault" in c.argv}
    assert told == {"kv_store-0", "prefill-0", "decode-0"}
