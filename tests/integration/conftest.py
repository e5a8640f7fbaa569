"""A real nats-server for the integration layer, started once per test session.

Uses the ``nats-server`` binary on PATH; where it is missing but a Docker engine
runs, a testcontainers NATS container; otherwise the tests skip, naming what to
install.
"""

from __future__ import annotations

import shutil

import pytest
from services.natsd import local_nats_server, wait_port


def _docker_engine_runs() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def nats_url():
    if shutil.which("nats-server"):
        with local_nats_server() as url:
            yield url
        return
    if _docker_engine_runs():
        from testcontainers.core.container import DockerContainer

        with DockerContainer("nats:2.10").with_exposed_ports(4222) as container:
            port = int(container.get_exposed_port(4222))
            wait_port(port, 30)
            yield f"nats://{container.get_container_host_ip()}:{port}"
        return
    pytest.skip("needs nats-server: `apt-get install -y nats-server` (or a Docker engine for testcontainers)")

