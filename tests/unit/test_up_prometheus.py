"""``kvbus up --prometheus-config``: the scrape config names every /metrics endpoint planned (promtool
checks it in tests/integration/test_deploy_checkers.py; a real Prometheus scrapes it in
test_deployment.py)."""

from __future__ import annotations

import yaml

from services.up import prometheus
from services.up.config import UpConfig, parse
from services.up.roles import Site, plan


def _planned(**kw):
    config = UpConfig(**{"hicache": True, "layout": "disaggregated", "prefill": 2, "decode": 1, "speculative": "off",
                         "share_cores": True, "metrics_port": 0, "http_port": 8123, **kw})
    return config, plan(config, Site(nats_url="nats://127.0.0.1:4222", model_dir="/m", http_port=8123))


def test_every_replica_is_a_target_of_its_role_job():
    config, planned = _planned(metrics_host="0.0.0.0")
    targets = prometheus.scrape_targets(planned.roles, planned.children, metrics_host=config.metrics_host,
                                        http_host=config.http_host, http_port=8123)
    port = {c.name: c.metrics_port for c in planned.children}
    assert targets == {
        "tokenizer": [(f"127.0.0.1:{port['tokenizer-0']}", "tokenizer-0")],
        "kv_store": [(f"127.0.0.1:{port['kv_store-0']}", "kv_store-0")],
        "router": [(f"127.0.0.1:{port['router-0']}", "router-0")],
        "prefill": [(f"127.0.0.1:{port['prefill-0']}", "prefill-0"), (f"127.0.0.1:{port['prefill-1']}", "prefill-1")],
        "decode": [(f"127.0.0.1:{port['decode-0']}", "decode-0")],
        "gateway": [("127.0.0.1:8123", "gateway-0")],  # the HTTP port serves its /metrics
    }
    # --metrics-port -1: the gateway alone
    config, planned = _planned(metrics_port=-1)
    assert list(prometheus.scrape_targets(planned.roles, planned.children, metrics_host="127.0.0.1",
                                          http_host="::", http_port=8123)) == ["gateway"]
    assert prometheus.scrape_targets({"gateway": ["gateway-0"]}, [], metrics_host="h", http_host="::",
                                     http_port=1)["gateway"] == [("[::1]:1", "gateway-0")]


def test_written_config_parses_to_the_targets_and_loads_the_rules(tmp_path):
    config, planned = _planned()
    targets = prometheus.scrape_targets(planned.roles, planned.children, metrics_host="127.0.0.1",
                                        http_host="127.0.0.1", http_port=8123)
    path = tmp_path / "prometheus.yml"
    prometheus.write(str(path), targets)
    doc = yaml.safe_load(path.read_text())
    jobs = {job["job_name"]: job for job in doc["scrape_configs"]}
    assert list(jobs) == list(targets)
    for role, found in targets.items():
        assert jobs[role]["honor_labels"] is True
        assert [(s["targets"][0], s["labels"]["worker_id"]) for s in jobs[role]["static_configs"]] == found
    assert doc["rule_files"] == sorted(str(p) for p in prometheus.RULES_DIR.glob("*.yml")) and doc["rule_files"]


def test_the_flag_takes_a_path():
    assert parse(["--prometheus-config", "/tmp/p.yml"]).prometheus_config == "/tmp/p.yml"
    assert parse([]).prometheus_config is None
