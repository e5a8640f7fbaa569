"""The deployment files name real roles, flags, ports, environment variables and series (no Docker
engine or Kubernetes here): everything the containers would be given, checked against the CLI that
would read it.

Elsewhere: Prometheus's and Compose's own checkers on these files
(tests/integration/test_deploy_checkers.py), and what really runs, kvbus up scraped by a real
Prometheus on a three-node NATS cluster (tests/integration/test_deployment.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from bus.nats_transport import BusConfig
from services import config as cfg
from services.cli import health_parser, serve_parser
from services.registry import ROLES, actor_class

ROOT = Path(__file__).resolve().parents[2]
PROCESS_ENV = {"KVBUS_WORKER_ID", "KVBUS_LOG_LEVEL", "KVBUS_DRAIN_TIMEOUT", "KVBUS_KEEP_FREED_MEMORY"}
"""Environment variables read by `kvbus serve` itself (services/cli.py), not by a config class."""
METRICS_PORT = 9400
ENGINE_ROLES = {"prefill", "decode", "worker"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def kvbus_services() -> dict[str, dict]:
    return {name: s for name, s in compose()["services"].items() if s.get("image", "").startswith("kvbus")}


def k8s_docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "deploy/k8s" / name).read_text()))


def k8s_workloads() -> list[dict]:
    return [d for d in k8s_docs("kvbus.yaml") if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def check_env(role: str, names: set[str]) -> None:
    """Every KVBUS_* variable is one the role reads: a field of its config or the bus's, or kvbus serve's own."""
    fields = set(BusConfig.__dataclass_fields__) | set(actor_class(role).config_class.__dataclass_fields__)
    known = {cfg.env_name(f) for f in fields} | PROCESS_ENV
    unknown = {n for n in names if n.startswith("KVBUS_")} - known
    assert not unknown, (role, unknown)
    assert names - {n for n in names if n.startswith("KVBUS_")} <= {"OTEL_EXPORTER_OTLP_ENDPOINT"}, (role, names)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def metric_names(text: str) -> set[str]:
    """The kvbus series a PromQL text reads, as registered (suffixes _bucket, _sum, _count, _total off)."""
    names = set(re.findall(r"\bkvbus_[a-z0-9_]+", text))
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}


def registered_names() -> set[str]:
    """Every series name written as a whole string literal in services/ (a Counter, Gauge, Histogram or
    family; the few named by an f-string are not read by the rules or the dashboard)."""
    found: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        found |= set(re.findall(r'"(kvbus_[a-z0-9_]+)"', path.read_text()))
    return found


# --- docker-compose.yml --------------------------------------------------------------------------


def test_compose_services_run_known_roles():
    services = compose()["services"]
    assert {"nats", "jaeger", "prometheus", "grafana"} <= services.keys()
    kvbus = kvbus_services()
    assert kvbus, "no kvbus service in docker-compose.yml"
    roles = set()
    for name, service in kvbus.items():
        command = service["command"]
        assert command[0] == "serve" and command[1] in ROLES, (name, command)
        serve_parser(command[1], actor_class(command[1])).parse_args(command[2:])  # exits on a bad flag
        assert service["environment"]["KVBUS_NATS_URL"].startswith("nats://")
        check_env(command[1], set(service["environment"]))
        roles.add(command[1])
    assert {"tokenizer", "router", "gateway", "prefill", "decode", "kv_store"} <= roles


def test_compose_healthchecks_ask_each_replica_of_its_role():
    services = compose()["services"]
    for name, service in kvbus_services().items():
        role = service["command"][1]
        kind, line = service["healthcheck"]["test"]
        assert kind == "CMD-SHELL", name
        # "$$" is compose's escape of "$": the container's shell expands $HOSTNAME, the replica's worker id
        # (deploy/docker-entrypoint.sh names each replica after its hostname)
        argv = line.replace('"$$HOSTNAME"', "HOSTNAME").split()
        assert argv[:2] == ["kvbus", "health"] and flag(argv, "--worker-id") == "HOSTNAME", (name, line)
        assert health_parser().parse_args(argv[2:]).role == role
        # every kvbus role waits for NATS to be healthy; every health condition names a service with a check
        depends = service["depends_on"]
        assert depends["nats"]["condition"] == "service_healthy", name
        for other, condition in depends.items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[other], (name, other)
    entrypoint = (ROOT / "deploy/docker-entrypoint.sh").read_text()
    assert ': "${KVBUS_WORKER_ID:=$(hostname)}"' in entrypoint and 'exec kvbus "$@"' in entrypoint
    assert 'ENTRYPOINT ["kvbus-entrypoint"]' in (ROOT / "deploy/Dockerfile").read_text()


def test_compose_prefill_and_decode_scale():
    for name in ("prefill", "decode"):
        service = compose()["services"][name]
        # --scale makes several containers: none may claim a fixed name or host port
        assert "container_name" not in service and "ports" not in service, name


def test_compose_metrics_ports_are_the_ones_prometheus_scrapes():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    services = kvbus_services()
    for name, service in services.items():
        role, argv = service["command"][1], service["command"]
        job = jobs[role]  # one scrape job per role, named after it
        assert job["honor_labels"] is True
        if role == "gateway":
            port, host = int(flag(argv, "--http-port")), name
        else:
            port, host = int(flag(argv, "--metrics-port")), name
            assert flag(argv, "--metrics-host") == "0.0.0.0"  # scraped from the prometheus container
        if "dns_sd_configs" in job:  # scaled roles: every replica by DNS
            assert job["dns_sd_configs"] == [{"names": [host], "type": "A", "port": port, "refresh_interval": "10s"}]
        else:
            assert job["static_configs"] == [{"targets": [f"{host}:{port}"]}]
    for role in ("prefill", "decode", "tokenizer"):
        assert "dns_sd_configs" in jobs[role], role
    assert set(jobs) == {s["command"][1] for s in services.values()}


def test_compose_mounts_exist_and_nats_exposes_monitoring():
    services = compose()["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
    nats_conf = (ROOT / "deploy/nats/nats-server.conf").read_text()
    assert re.search(r"^http_port: 8222$", nats_conf, re.M) and "8222:8222" in services["nats"]["ports"]
    assert "9090:9090" in services["prometheus"]["ports"] and "3000:3000" in services["grafana"]["ports"]


# --- Prometheus and Grafana -----------------------------------------------------------------------


def test_rules_alert_on_errors_ttft_queues_and_workers_gone():
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/rules/kvbus-alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert {"KvbusHighErrorRate", "KvbusTTFTP99High", "KvbusQueueDeep", "KvbusWorkerGone", "KvbusTargetDown"} <= names
    # promtool checks and unit-tests them: tests/integration/test_deploy_checkers.py


def dashboard() -> dict:
    return json.loads((ROOT / "deploy/grafana/dashboards/kvbus.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_every_series_the_rules_and_dashboard_read_is_one_kvbus_serves():
    served = registered_names()
    texts = [(ROOT / "deploy/prometheus/rules" / n).read_text() for n in ("kvbus-recording.yml", "kvbus-alerts.yml")]
    texts += dashboard_exprs() + [(ROOT / "deploy/k8s/prometheus-adapter.yaml").read_text()]
    read = set().union(*(metric_names(t) for t in texts))
    assert len(read) > 25 and read <= served, sorted(read - served)


def test_dashboard_covers_the_issue_and_uses_the_provisioned_data_source():
    titles = " | ".join(p["title"] for p in dashboard()["panels"]).lower()
    for topic in ("time to first token", "tpot", "throughput", "cache hits per tier", "queue depths",
                  "transfer bandwidth", "acceptance", "migrations"):
        assert topic in titles, topic
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    [ds] = source["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == ds["uid"], panel["title"]
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kvbus.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose()["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# --- Kubernetes ---------------------------------------------------------------------------------


def test_kubernetes_workloads_run_known_roles_with_valid_flags():
    roles = {}
    for d in k8s_workloads():
        [container] = d["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[0] == "serve" and args[1] in ROLES, args
        serve_parser(args[1], actor_class(args[1])).parse_args(args[2:])
        check_env(args[1], {e["name"] for e in container["env"]})
        assert container["resources"]["requests"].keys() == {"cpu", "memory"}, d["metadata"]["name"]
        roles[args[1]] = d
    assert {"tokenizer", "router", "gateway", "prefill", "decode", "kv_store"} <= roles.keys()
    assert roles["kv_store"]["kind"] == "DaemonSet"  # one per node
    for role in ("kv_store", "prefill", "decode"):  # the node's shared memory, and the node as host id
        spec = roles[role]["spec"]["template"]["spec"]
        assert spec["hostIPC"] is True, role
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["KVBUS_HOST_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", role


def test_kubernetes_probes_ask_the_health_subjects():
    for d in k8s_workloads():
        [container] = d["spec"]["template"]["spec"]["containers"]
        role = container["args"][1]
        env = {e["name"]: e for e in container["env"]}
        # the probe's default replica is $KVBUS_WORKER_ID: the pod's own name
        assert env["KVBUS_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        probes = {kind: container[kind]["exec"]["command"]
                  for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        for kind, command in probes.items():
            assert command[:2] == ["kvbus", "health"], (role, kind)
            args = health_parser().parse_args(command[2:])
            assert args.role == role and args.live == (kind != "readinessProbe"), (role, kind)


def test_kubernetes_services_reach_every_node_of_the_nats_cluster():
    cluster = {d["kind"]: d for d in k8s_docs("nats-cluster.yaml")}
    nodes = cluster["StatefulSet"]["spec"]["replicas"]
    service = cluster["StatefulSet"]["spec"]["serviceName"]
    assert nodes == 3 and cluster["Service"]["spec"]["clusterIP"] == "None"
    expected = [f"nats://nats-{i}.{service}:4222" for i in range(nodes)]
    routes = re.findall(r"nats-route://(\S+):6222", cluster["ConfigMap"]["data"]["nats-server.conf"])
    assert routes == [f"nats-{i}.{service}" for i in range(nodes)]
    for d in k8s_workloads():
        env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["KVBUS_NATS_URL"].split(",") == expected, d["metadata"]["name"]


def test_kubernetes_autoscales_engines_on_queue_depth():
    docs = k8s_docs("kvbus.yaml")
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    adapter = yaml.safe_load((ROOT / "deploy/k8s/prometheus-adapter.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"kvbus-prefill", "kvbus-decode"}
    for h in hpas:
        assert h["spec"]["scaleTargetRef"]["name"] in deployments
        [metric] = h["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served


def test_kubernetes_scrape_config_names_jobs_by_role_and_labels_pods():
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/kubernetes.yml").read_text())
    [job] = scrape["scrape_configs"]
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"job", "namespace", "pod", "worker_id"} <= targets  # the adapter maps namespace and pod
    for d in k8s_workloads():
        template = d["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        port = int(template["metadata"]["annotations"]["prometheus.io/port"])
        args = template["spec"]["containers"][0]["args"]
        assert port == int(flag(args, "--http-port" if args[1] == "gateway" else "--metrics-port"))
        assert template["metadata"]["labels"]["kvbus.role"] == args[1]


# --- README ---------------------------------------------------------------------------------------


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:]
    block = block[:block.index("```")]
    assert [line.split("#")[0].strip() for line in block] == [
        "bash deploy/bootstrap.sh up", "bash deploy/bootstrap.sh test"]
    assert "bootstrap.sh test" in (ROOT / ".ci/run").read_text()
