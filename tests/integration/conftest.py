"""A real nats-server for the integration layer, started once per test session.

Uses the ``nats-server`` binary on PATH; where it is missing but a Docker engine
runs, a testcontainers NATS container; otherwise the tests skip, naming what to
install.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nats-server did not listen on {port}")


def _docker_engine_runs() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def nats_url():
    binary = shutil.which("nats-server")
    if binary:
        port = _free_port()
        proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_port(port)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)
        return
    if _docker_engine_runs():
        from testcontainers.core.container import DockerContainer

        with DockerContainer("nats:2.10").with_exposed_ports(4222) as container:
            port = int(container.get_exposed_port(4222))
            _wait_port(port, 30)
            yield f"nats://{container.get_container_host_ip()}:{port}"
        return
    pytest.skip("needs nats-server: `apt-get install -y nats-server` (or a Docker engine for testcontainers)")

