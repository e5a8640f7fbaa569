"""``kvbus health ROLE``: the command containers and Kubernetes probes run, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from bus.nats_transport import BusConfig, connect
from services.actor import Actor
from services.runner import bind_health

pytestmark = pytest.mark.anyio


class _Probed(Actor):
    role = "decode"
    config_class = dict


async def health(nats_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVBUS_WORKER_ID"}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "health", *args,
                                                    "--nats-url", nats_url, "--timeout", "2"],
                                   capture_output=True, text=True, timeout=60, env=env)


async def test_exit_status_says_ready_live_or_gone(nats_url):
    bus = await connect(BusConfig(nats_url=nats_url))
    actor = _Probed({}, worker_id="decode-h1")
    try:
        await bind_health(bus, actor)
        await bus.transport.flush()
        loading = await health(nats_url, "decode", "--worker-id", "decode-h1")
        assert loading.returncode == 1 and json.loads(loading.stdout)["ready"] is False, loading
        assert (await health(nats_url, "decode", "--worker-id", "decode-h1", "--live")).returncode == 0

        actor.is_ready = True
        ready = await health(nats_url, "decode", "--worker-id", "decode-h1")
        assert ready.returncode == 0, ready.stderr
        assert json.loads(ready.stdout)["worker_id"] == "decode-h1"
        assert (await health(nats_url, "decode")).returncode == 0  # any replica of the role

        gone = await health(nats_url, "decode", "--worker-id", "decode-other", "--live")
        assert gone.returncode == 1 and "decode decode-other: no answer" in gone.stderr
    finally:
        await bus.close()
