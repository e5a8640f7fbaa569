"""Real service processes on a real nats-server: replicas, drain, discovery, other languages."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import TOKENIZER_ENCODE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.tokenizer import EncodeRequest

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def start_service(role: str, worker_id: str, nats_url: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", role, "--worker-id", worker_id, "--nats-url", nats_url,
         *extra],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


async def wait_ready(bus, role: str, worker_ids: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    pending = set(worker_ids)
    while pending:
        assert time.monotonic() < deadline, f"not ready: {pending}"
        for wid in list(pending):
            try:
                if (await bus.request(WORKER_HEALTH, HealthRequest(), timeout=0.5, role=role, worker_id=wid)).ready:
                    pending.discard(wid)
            except Exception:
                pass
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def tokenizers(nats_url, model_dir):
    procs = [start_service("tokenizer", wid, nats_url, "--model", str(model_dir)) for wid in ("tok-a", "tok-b")]
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


async def test_replicas_share_load_and_answer_right(tokenizers, nats_url, model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    bus = await connect(BusConfig(nats_url=nats_url))
    try:
        await wait_ready(bus, "tokenizer", ["tok-a", "tok-b"])
        texts = [f"replica test {i} " * (1 + i % 5) for i in range(200)]
        replies = await asyncio.gather(*(bus.request(TOKENIZER_ENCODE, EncodeRequest(text=t)) for t in texts))
        assert [r.ids for r in replies] == hf(texts)["input_ids"]
        batches = {}
        for wid in ("tok-a", "tok-b"):
            health = await bus.request(WORKER_HEALTH, HealthRequest(), role="tokenizer", worker_id=wid)
            batches[wid] = int(health.detail["batches"])
        assert all(n > 0 for n in batches.values()), batches
    finally:
        await bus.close()


async def test_micro_discovery(tokenizers, nats_url):
    bus = await connect(BusConfig(nats_url=nats_url))
    try:
        await wait_ready(bus, "tokenizer", ["tok-a", "tok-b"])
        nc = bus.transport.nc
        sub = await nc.subscribe(nc.new_inbox() + ".ping")
        await nc.publish("$SRV.PING.kvbus-tokenizer", b"", reply=sub.subject)
        seen = set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            msg = await sub.next_msg(timeout=5)
            seen.add(json.loads(msg.data)["metadata"]["worker_id"])
        assert seen == {"tok-a", "tok-b"}
    finally:
        await bus.close()


def test_c_client_calls_the_tokenizer(tokenizers, nats_url, model_dir, tmp_path):
    if not Path("/usr/include/nats/nats.h").exists() or shutil.which("gcc") is None:
        pytest.skip("needs gcc and Debian's libnats-dev (`apt-get install -y libnats-dev`)")
    from transformers import AutoTokenizer

    exe = tmp_path / "tokenize"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(ROOT / "tests/clients/tokenize.c"), "-lnats"], check=True)
    asyncio.run(_wait(nats_url))
    out = subprocess.run([str(exe), nats_url, "Hello from C"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    expected = AutoTokenizer.from_pretrained(str(model_dir))("Hello from C")["input_ids"]
    assert json.loads(out.stdout) == {"ids": expected}


async def _wait(nats_url):
    bus = await connect(BusConfig(nats_url=nats_url))
    try:
        await wait_ready(bus, "tokenizer", ["tok-a", "tok-b"])
    finally:
        await bus.close()


def test_sigterm_drains_in_flight_and_exits_cleanly(nats_url, model_dir):
    proc = start_service("tokenizer", "tok-drain", nats_url, "--model", str(model_dir))

    async def scenario():
        bus = await connect(BusConfig(nats_url=nats_url))
        try:
            await wait_ready(bus, "tokenizer", ["tok-drain"])
            # Only this replica listens on its own health subject; ask it to stop mid-load.
            calls = [asyncio.create_task(bus.request(TOKENIZER_ENCODE, EncodeRequest(text="drain " * 2000)))
                     for _ in range(50)]
            await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results
        finally:
            await bus.close()

    results = asyncio.run(scenario())
    code = proc.wait(30)
    output = proc.stdout.read()
    assert code == 0, output
    assert "draining" in output and "stopped" in output
    # Every request got an answer (no silent loss): a reply, or a clear error if it arrived after the drain.
    from bus.errors import Unavailable

    answered = [r for r in results if not isinstance(r, Exception)]
    assert answered, results
    assert len({tuple(r.ids) for r in answered}) == 1 and len(answered[0].ids) >= 2000
    assert all(isinstance(r, Unavailable) for r in results if isinstance(r, Exception)), results


def test_kvbus_up_serves_a_first_request(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--nats-port", "0", "--exit-after-ready",
         "--model", str(model_dir), "--tokenizers", "2", "--tokenizer-only"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "served: kvbus.v1.tokenizer.encode" in out.stdout
    assert "tokenizer-1" in out.stdout  # logs streamed with a role prefix
    assert out.stdout.rstrip().endswith("[kvbus] stopped")
