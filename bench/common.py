"""Helpers shared by the benchmarks: a private nats-server, timing, machine facts, tables."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
from pathlib import Path

from services.natsd import local_nats_server as nats_server  # noqa: F401  (re-exported for the benches)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def median(values: list[float]) -> float:
    return statistics.median(values)


def against_label(checkout: Path) -> str:
    """``@<short commit>`` of another checkout (its directory name where git cannot say): how the
    benches' ``--against`` name the previous path."""
    res = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return "@" + (res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else checkout.name)


def read_bandwidth(reps: int = 5) -> float:
    """Bytes per second of a 1 GiB sum on every core (best of ``reps``): the read bandwidth the
    decode-step floors are measured against."""
    import time

    import torch

    x = torch.ones(1 << 28)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
