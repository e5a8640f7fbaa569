"""A whole kvbus system as real processes, started through ``kvbus up`` itself (tests, benchmarks).

It reads the addresses back from ``kvbus up``'s output through services/up/report.py, the module that
prints them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.up.report import read_announcement

ROOT = Path(__file__).resolve().parents[1]


class LocalSystem:
    """``kvbus up`` in the background; knows its NATS and HTTP URLs once ready.

    The log of every process is kept in ``self.lines`` (prefixed by worker id),
    so a failing test can show what the services said.
    """

    def __init__(self, *args: str, model_dir: Path | None = None, timeout: float = 240.0,
                 env: dict[str, str] | None = None, root: Path | None = None):
        """``root``: the checkout whose code runs (default: this one), for benchmarks that
        compare two."""
        argv = [sys.executable, "-m", "services.cli", "up", "--nats-port", "0", "--http-port", "0",
                "--metrics-port", "0", "--kv-cache-memory", "0.5", *args]
        if model_dir is not None:
            argv += ["--model", str(model_dir)]
        self.argv = argv
        self.timeout = timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.root = Path(root) if root is not None else ROOT
        if root is not None:  # `python -m` puts the cwd first anyway; PYTHONPATH covers child imports
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), self.env.get("PYTHONPATH")]))
        self.lines: list[str] = []
        self.nats_url: str | None = None
        self.http_url: str | None = None
        self.metrics_urls: dict[str, str] = {}
        """Prometheus endpoint per service (tokenizers, kv_store, router, engine workers), by worker id."""
        self._ready = threading.Event()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LocalSystem":
        self.proc = subprocess.Popen(self.argv, cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError("kvbus up did not become ready:\n" + self.log(80))
        return self

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match read_announcement(line):
                case ("nats", url):
                    self.nats_url = url
                case ("http", url):
                    self.http_url = url
                case ("metrics", worker_id, url):
                    self.metrics_urls[worker_id] = url
                case ("serving",):  # printed last, after every URL
                    self._ready.set()

    def log(self, last: int = 200) -> str:
        return "\n".join(self.lines[-last:])

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
