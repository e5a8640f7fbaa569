"""``kvbus up --prometheus-config FILE``: a Prometheus scrape config for the services kvbus up started.

Their ports are chosen at start (``--metrics-port 0``, ``--http-port 0``), so no static file can name
them. One scrape job per role (its ``job`` label is the role, as in deploy/prometheus/prometheus.yml
for Docker), one target per replica labelled with its ``worker_id``; ``honor_labels`` keeps the
labels a service exports itself (an engine's own ``worker_id`` and ``role``). The gateway is scraped
at its HTTP port. Where the checkout's deploy/prometheus/rules/ exists, its recording and alert rules
are loaded too. Written as YAML by hand (a handful of keys; JSON strings are YAML strings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.up.supervisor import Child

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
SCRAPE_INTERVAL = "2s"
"""A local system, scraped often so a dashboard follows a benchmark as it runs (a scrape reads counters the
services keep anyway)."""


def scrape_targets(roles: dict[str, list[str]], children: list[Child], *, metrics_host: str, http_host: str,
                   http_port: int) -> dict[str, list[tuple[str, str]]]:
    """Role -> [(host:port, worker id)] of every replica that serves /metrics (the gateway at its HTTP port)."""
    port_of = {c.name: c.metrics_port for c in children if c.metrics_port is not None}
    targets: dict[str, list[tuple[str, str]]] = {}
    for role, worker_ids in roles.items():
        if role == "gateway":
            found = [(_address(http_host, http_port), wid) for wid in worker_ids]
        else:
            found = [(_address(metrics_host, port_of[wid]), wid) for wid in worker_ids if wid in port_of]
        if found:
            targets[role] = found
    return targets


def render(targets: dict[str, list[tuple[str, str]]], rule_files: list[str]) -> str:
    q = json.dumps
    lines = ["# Written by `kvbus up --prometheus-config`: the services it started, at the ports chosen at start.",
             "#   prometheus --config.file=THIS_FILE --storage.tsdb.path=SOME_DIR",
             "global:", f"  scrape_interval: {SCRAPE_INTERVAL}", f"  evaluation_interval: {SCRAPE_INTERVAL}"]
    if rule_files:
        lines.append("rule_files:")
        lines += [f"  - {q(path)}" for path in rule_files]
    lines.append("scrape_configs:")
    for role, found in targets.items():
        lines += [f"  - job_name: {q(role)}", "    honor_labels: true", "    static_configs:"]
        for address, worker_id in found:
            lines += [f"      - targets: [{q(address)}]", f"        labels: {{worker_id: {q(worker_id)}}}"]
    return "\n".join(lines) + "\n"


def write(path: str, targets: dict[str, list[tuple[str, str]]]) -> None:
    """Write the config to ``path`` (atomically: a Prometheus reloading it never reads half a file)."""
    rule_files = sorted(str(p) for p in RULES_DIR.glob("*.yml")) if RULES_DIR.is_dir() else []
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(render(targets, rule_files))
    os.replace(tmp, path)


def _address(host: str, port: int) -> str:
    """A scrapeable address: a wildcard listen address is scraped on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
