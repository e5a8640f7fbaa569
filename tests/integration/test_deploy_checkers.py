"""The deployment files through their tools' own checkers: promtool (Prometheus's) on the scrape configs
and the rules, with the rules' unit tests, and Compose v1's ``docker-compose config``, which validates
a compose file without a Docker engine. They skip, naming the package, where the tool is missing
(bash deploy/bootstrap.sh test installs both)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from services.up import prometheus
from services.up.config import UpConfig
from services.up.roles import Site, plan

ROOT = Path(__file__).resolve().parents[2]


def run(tool: str, package: str, *args: str) -> subprocess.CompletedProcess:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"needs {tool}: `apt-get install -y {package}` (bash deploy/bootstrap.sh test does)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_promtool_accepts_the_compose_scrape_config_and_the_rules():
    rules = sorted(str(p) for p in (ROOT / "deploy/prometheus/rules").glob("*.yml"))
    assert len(rules) == 2
    checked = run("promtool", "prometheus", "check", "rules", *rules)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = run("promtool", "prometheus", "check", "config", "deploy/prometheus/prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # NOTE: deploy/prometheus/kubernetes.yml is not checked here: Debian's build has no Kubernetes
    # service discovery ("field kubernetes_sd_configs not found"); tests/unit/test_deploy_files.py reads it.


def test_the_alerts_fire_on_their_series_and_not_before():
    tested = run("promtool", "prometheus", "test", "rules", "deploy/prometheus/tests/kvbus-rules-test.yml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_promtool_accepts_what_kvbus_up_writes(tmp_path):
    config = UpConfig(hicache=True, layout="disaggregated", prefill=2, decode=2, metrics_port=0, http_port=8123)
    planned = plan(config, Site(nats_url="nats://127.0.0.1:4222", model_dir="/m", http_port=8123))
    path = tmp_path / "kvbus-prometheus.yml"
    prometheus.write(str(path), prometheus.scrape_targets(planned.roles, planned.children, metrics_host="0.0.0.0",
                                                          http_host="127.0.0.1", http_port=8123))
    checked = run("promtool", "prometheus", "check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "2 rule files found" in checked.stdout  # the checkout's recording and alert rules, loaded


def test_docker_compose_config_validates():
    done = run("docker-compose", "docker-compose", "-f", "docker-compose.yml", "config", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
