"""A private nats-server on a free loopback port (tests, benchmarks, local tools)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nats-server did not listen on {port}")


@contextlib.contextmanager
def local_nats_server(*args: str) -> Iterator[str]:
    """``nats-server`` from PATH with extra ``args`` (auth, limits); yields its URL."""
    if shutil.which("nats-server") is None:
        raise RuntimeError("nats-server is not on PATH: apt-get install -y nats-server")
    port = free_port()
    proc = subprocess.Popen(["nats-server", "-a", "127.0.0.1", "-p", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
