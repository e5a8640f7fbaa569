"""The deployment files name real roles and real settings (Docker can't run here; this still can)."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.cli import serve_parser
from services.registry import ROLES, actor_class

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_run_known_roles():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "jaeger"} <= services.keys()
    kvbus = {name: s for name, s in services.items() if s.get("image", "").startswith("kvbus")}
    assert kvbus, "no kvbus service in docker-compose.yml"
    for name, service in kvbus.items():
        command = service["command"]
        assert command[0] == "serve" and command[1] in ROLES, (name, command)
        serve_parser(command[1], actor_class(command[1])).parse_args(command[2:])  # exits on a bad flag
        assert service["environment"]["KVBUS_NATS_URL"].startswith("nats://")


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:]
    block = block[:block.index("```")]
    assert [line.split("#")[0].strip() for line in block] == [
        "bash deploy/bootstrap.sh up", "bash deploy/bootstrap.sh test"]
    assert "bootstrap.sh test" in (ROOT / ".ci/run").read_text()


def test_kubernetes_deployments_run_known_roles_with_valid_flags():
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/kvbus.yaml").read_text()))
    deployments = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("kvbus-")]
    roles = set()
    for d in deployments:
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "serve" and args[1] in ROLES, args
        serve_parser(args[1], actor_class(args[1])).parse_args(args[2:])
        roles.add(args[1])
    assert {"tokenizer", "router", "gateway", "prefill", "decode"} <= roles
