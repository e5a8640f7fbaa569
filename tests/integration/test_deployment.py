"""The deployment as it runs, on real processes: a three-node NATS cluster (deploy/nats/cluster.conf on
loopback ports), ``kvbus up`` on all three URLs (1P1D with HiCache, so every series exists), and a real
Prometheus started with the scrape config ``kvbus up --prometheus-config`` wrote.

- Prometheus: every target is up, every query of the Grafana dashboard returns data, and every
  recording and alert rule evaluates.
- NATS: the node the decode worker is connected to is killed in the middle of a stream; the stream
  completes, and every service reconnects to the nodes left.

One ``kvbus up`` serves both (a tiny random model: these count series and tokens, not judge text).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.local_system import LocalSystem
from services.natsd import free_port, wait_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NUM_NODES = 3
RATE_WINDOW = "1m"
"""What Grafana's $__rate_interval becomes in these queries (at least 4 scrapes of kvbus up's 2 s)."""


class NatsNode:
    """One nats-server of the cluster: deploy/nats/cluster.conf with loopback ports (flags win over the file)."""

    def __init__(self, index: int, cluster_ports: list[int]):
        self.name = f"nats-{index + 1}"
        self.port, self.monitor_port = free_port(), free_port()
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in cluster_ports)
        self.proc = subprocess.Popen(
            ["nats-server", "-c", str(ROOT / "deploy/nats/cluster.conf"), "-a", "127.0.0.1", "-p", str(self.port),
             "-m", str(self.monitor_port), "--cluster", f"nats://127.0.0.1:{cluster_ports[index]}",
             "--routes", routes],
            env={**os.environ, "NATS_SERVER_NAME": self.name}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def monitor(self, path: str) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.monitor_port}{path}", timeout=5).json()

    def client_names(self) -> set[str]:
        return {c.get("name", "") for c in self.monitor("/connz?limit=1024")["connections"]}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def nodes():
    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")
    cluster_ports = [free_port() for _ in range(NUM_NODES)]
    started = [NatsNode(i, cluster_ports) for i in range(NUM_NODES)]
    try:
        for node in started:
            wait_port(node.port, 10)
            wait_port(node.monitor_port, 10)
        deadline = time.monotonic() + 30
        while not all(node.monitor("/routez")["num_routes"] == NUM_NODES - 1 for node in started):
            assert time.monotonic() < deadline, "the three nodes did not form a cluster"
            time.sleep(0.1)
        assert {node.monitor("/varz")["server_name"] for node in started} == {"nats-1", "nats-2", "nats-3"}
        yield started
    finally:
        for node in started:
            node.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def chat_tiny_model(tmp_path_factory, model_dir) -> Path:
    """The tiny random Llama (tests/tiny_model.py) with the default model's tokenizer and chat template:
    kvbus up proves itself ready with a chat completion."""
    from tests.tiny_model import save_chat_tiny_model

    return save_chat_tiny_model(tmp_path_factory.mktemp("tiny-chat"), model_dir)


@pytest.fixture(scope="module")
def system(nodes, chat_tiny_model, tmp_path_factory):
    scrape_config = tmp_path_factory.mktemp("prometheus") / "kvbus-prometheus.yml"
    # float32: the migrated stream must repeat the undisturbed one's greedy text token for token, which a
    # recompute in another batch keeps in float32 but not in bfloat16 (dtype auto on some CPUs)
    with LocalSystem("--prefill", "1", "--decode", "1", "--hicache", "--num-threads", "1", "--dtype", "float32",
                     "--kv-cache-memory", "0.05", "--nats-url", ",".join(node.url for node in nodes),
                     "--prometheus-config", str(scrape_config), "--engine-args", "--heartbeat-interval 0.5",
                     model_dir=chat_tiny_model) as system:
        system.scrape_config = scrape_config
        yield system
    assert "Traceback" not in "\n".join(system.lines), system.log(200)


@pytest.fixture(scope="module")
def prometheus(system, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs Prometheus: `apt-get install -y prometheus` (bash deploy/bootstrap.sh test does)")
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={system.scrape_config}",
                             f"--storage.tsdb.path={tmp_path_factory.mktemp('tsdb')}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def stream_completion(http_url: str, max_tokens: int, on_first_chunk=None) -> tuple[str, str, dict]:
    """Stream a greedy completion over HTTP: (text, finish reason, usage); ``on_first_chunk()`` is called
    when the first chunk arrives."""
    body = {"prompt": "The river ran past the mill, and the mill", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    num_chunks, text, finish, usage = 0, "", None, None
    with httpx.stream("POST", f"{http_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                num_chunks += 1
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
                if num_chunks == 1 and on_first_chunk is not None:
                    on_first_chunk()
    assert num_chunks > 1, "not streamed"
    return text, finish, usage


def query(prometheus_url: str, expr: str) -> list:
    reply = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_prometheus_scrapes_every_service_and_the_dashboard_has_data(system, prometheus):
    written = yaml.safe_load(system.scrape_config.read_text())
    scraped = [s["labels"]["worker_id"] for job in written["scrape_configs"] for s in job["static_configs"]]
    # every process kvbus up started serves /metrics: tokenizer, kv_store, router, prefill, decode, gateway
    assert sorted(scraped) == ["decode-0", "gateway-0", "kv_store-0", "prefill-0", "router-0", "tokenizer-0"]
    _, finish, usage = stream_completion(system.http_url, 24)
    assert (usage["completion_tokens"], finish) == (24, "length")

    def targets_up() -> bool:
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return len(active) == 6 and all(t["health"] == "up" for t in active)

    wait_for_sync(targets_up, "every target up", 60)
    jobs = {r["metric"]["job"] for r in query(prometheus, "up == 1")}
    assert jobs == {"tokenizer", "kv_store", "router", "prefill", "decode", "gateway"}
    # the services' own identity survives the scrape (honor_labels); the others get the config's worker_id
    assert {r["metric"]["worker_id"] for r in query(prometheus, "kvbus_num_requests_running")} == {
        "prefill-0", "decode-0"}
    assert {r["metric"]["worker_id"] for r in query(prometheus, "kvbus_tokenizer_num_requests_waiting")} == {
        "tokenizer-0"}

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/kvbus.json").read_text())
    exprs = [t["expr"].replace("$__rate_interval", RATE_WINDOW) for p in dashboard["panels"]
             for t in p.get("targets", [])]
    assert len(exprs) >= 30
    empty = list(exprs)

    def all_have_data() -> bool:
        empty[:] = [e for e in empty if not query(prometheus, e)]
        return not empty

    wait_for_sync(all_have_data, "every dashboard query to return data", 60, lambda: empty)
    assert query(prometheus, 'sum(kvbus_generation_tokens_total)')[0]["value"][1] != "0"

    num_rules = sum(len(g["rules"]) for path in sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))
                    for g in yaml.safe_load(path.read_text())["groups"])

    def rules_evaluated() -> bool:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == num_rules and all(r["health"] == "ok" for r in rules)  # "unknown" until evaluated

    wait_for_sync(rules_evaluated, "every recording and alert rule evaluated without error", 60)


def test_a_stream_survives_its_decode_workers_nats_node_dying(system, nodes):
    def node_of(name: str) -> NatsNode:
        [node] = [n for n in nodes if n.proc.poll() is None and name in n.client_names()]
        return node

    services = set().union(*(n.client_names() for n in nodes if n.proc.poll() is None))
    services = {name for name in services if name.startswith("kvbus-") and name != "kvbus-health"}
    assert {"kvbus-decode-decode-0", "kvbus-prefill-prefill-0", "kvbus-gateway-gateway-0"} <= services
    doomed = node_of("kvbus-decode-decode-0")
    killed_after: list[float] = []

    def kill_the_node() -> None:  # called on the stream's first chunk: the rest is still to come
        killed_after.append(time.monotonic())
        doomed.stop(signal.SIGKILL)

    undisturbed, finish, usage = stream_completion(system.http_url, 300)
    assert (usage["completion_tokens"], finish) == (300, "length")
    text, finish, usage = stream_completion(system.http_url, 300, on_first_chunk=kill_the_node)
    assert killed_after, "the stream never started"
    # complete, and the same greedy text: nothing lost or repeated across the reconnect
    assert (usage["completion_tokens"], finish) == (300, "length")
    assert text == undisturbed
    gateway = httpx.get(f"{system.http_url}/metrics", timeout=10).text
    print("across the node's death:", [line for line in gateway.splitlines() if line.startswith("kvbus_migrations")])

    # every service is back, each on one of the two nodes left; the decode worker serves again
    alive = [n for n in nodes if n.proc.poll() is None]
    assert len(alive) == NUM_NODES - 1

    def reconnected() -> bool:
        return services <= set().union(*(n.client_names() for n in alive))

    wait_for_sync(reconnected, "every service reconnected to the nodes left", 30,
                  lambda: services - set().union(*(n.client_names() for n in alive)))
    assert node_of("kvbus-decode-decode-0") in alive
    assert stream_completion(system.http_url, 8)[2]["completion_tokens"] == 8


def wait_for_sync(cond, what: str, timeout: float, detail=lambda: None) -> None:
    """tests/waiting.py's wait_for for these synchronous checks: poll ``cond``, fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {detail()}"
        time.sleep(0.2)
