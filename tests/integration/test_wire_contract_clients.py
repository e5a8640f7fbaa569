"""Clients in other languages, written from the published contract alone, against ``kvbus up``.

``kvbus schemas export`` writes the contract (asyncapi.json and a JSON Schema per subject); the
official AsyncAPI parser validates it. A Node.js client (tests/clients/node/client.cjs: npm ``nats``
and ``ajv``, nothing from kvbus's Python code) and the C client (tests/clients/generate_stream.c,
libnats) run against one real system with a short probe interval: a long stream well past several
probe intervals, the ``.once`` subject, a schema-violating request, an overloaded refusal, cancelled
and abandoned streams (their pages freed), and streams through a worker killed mid-way (migration).
Every message a client gets must be a message of the contract, its headers and body valid against
it, and the greedy text must equal the HTTP API's. Probes reach only the client that asked
(``Kvbus-Probe: accept``); it answers them, and when it is killed its generation stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import HEALTH
from schemas.common import HealthRequest
from services.local_system import LocalSystem
from tests.clients import runners
from tests.leaks import engine_states, is_idle, pid_of

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORKERS = [("worker", "worker-0"), ("worker", "worker-1")]
PROBE_INTERVAL = 0.05
# A prompt whose greedy continuation has no near-tie in its first 48 tokens (top-2 logprobs at least
# 0.05 apart, measured): fp32 sums that round differently in another batch or after a migration's
# recompute cannot flip a token, so the text must match the HTTP API's exactly. 24 tokens last a few
# probe intervals however fast the machine (10 ms a token would still be 5 intervals).
PROMPT = "Explain how a computer works, step by step:"
NUM_TOKENS = 24
GREEDY = {"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
# No max_tokens: decoding to the context limit takes minutes, so only a cancel ends it early (and admission,
# which refuses a max_tokens it cannot finish before the deadline, lets it in).
ENDLESS = {"temperature": 0, "ignore_eos": True}
WAIT_S = 60.0


def request(sampling: dict, **fields) -> dict:
    return {"prompt": PROMPT, "sampling": sampling, **fields}


@pytest.fixture(scope="module")
def contract(tmp_path_factory) -> Path:
    """What ``kvbus schemas export`` writes, through the command itself."""
    out = tmp_path_factory.mktemp("contract")
    subprocess.run([sys.executable, "-m", "services.cli", "schemas", "export", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def modules() -> Path:
    reason = runners.node_missing()
    if reason:
        pytest.skip(reason)
    return runners.node_modules()


@pytest.fixture(scope="module")
def c_client(tmp_path_factory) -> Path:
    reason = runners.c_missing()
    if reason:
        pytest.skip(reason)
    return runners.build_c_client(tmp_path_factory.mktemp("c-client"))


@pytest.fixture(scope="module")
def system(model_dir, modules, c_client):
    # 2 aggregated workers (one to kill), 1 thread each; 2 running + 2 queued each: easy to overload.
    # No speculation: streams keep a steady pace, well past several probe intervals.
    with LocalSystem("--aggregated", "--workers", "2", "--num-threads", "1", "--speculative", "off",
                     "--drain-timeout", "5",
                     "--engine-args", "--max-running-requests 2 --max-queue 2 --heartbeat-interval 0.5",
                     model_dir=model_dir, env={"KVBUS_PROBE_INTERVAL": str(PROBE_INTERVAL)}) as s:
        yield s
        # The workers are idle now. The one restarted after the migration test would hold a SIGTERM
        # until its start-up is over (services/runner.py); stopped at once, it spares the suite that
        # start-up and the wait (kvbus up, stopped right after, restarts nothing).
        for _, worker_id in WORKERS:
            with contextlib.suppress(LookupError, ProcessLookupError):
                os.kill(pid_of(s, worker_id), signal.SIGKILL)


@pytest.fixture(scope="module")
def http_text(system) -> str:
    """The HTTP API's text for the greedy request every client sends."""
    r = httpx.post(system.http_url + "/v1/completions", timeout=300,
                   json={"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# --- running the clients -----------------------------------------------------------------------------------
class Running:
    """A client process whose JSON lines are gathered as they come (the test acts on them mid-stream)."""

    def __init__(self, proc: subprocess.Popen, parse=json.loads):
        self.proc = proc
        self.lines: list[dict] = []
        self._parse = parse
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip():
                self.lines.append(self._parse(line))

    def chunks(self) -> int:
        return sum(1 for m in self.lines if m.get("kind") == "chunk" or m.get("headers", {}).get("Kvbus-Stream")
                   == "chunk")

    def wait_for_chunks(self, n: int, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks() < n:
            assert self.proc.poll() is None or self.chunks() >= n, f"the client ended early:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"{n} chunks not within {timeout:g}s"
            time.sleep(0.02)

    def finish(self, timeout: float = 300) -> list[dict]:
        self.proc.wait(timeout)
        self._reader.join(timeout)
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}:\n{self.stderr()}"
        return self.lines

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else "(still running)"


def node_client(modules: Path, contract: Path, system, **plan) -> Running:
    return Running(runners.node(modules, "client.cjs", str(contract), system.nats_url, json.dumps(plan)))


def c_run(c_client: Path, system, body: dict, *options: str) -> Running:
    proc = subprocess.Popen([str(c_client), *options, "-m", system.nats_url, json.dumps(body)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Running(proc)


def checked_by_contract(modules: Path, contract: Path, op: str, c_lines: list[dict]) -> list[dict]:
    """What the Node client's validator says about each message the C client received (same checks)."""
    stdin = "".join(json.dumps({"headers": m["headers"], "body": m["body"]}) + "\n" for m in c_lines)
    checked = runners.run_node(modules, "client.cjs", str(contract), "-", json.dumps({"validate": op}), stdin=stdin)
    assert checked[-1]["checked"] == len(c_lines)
    return checked[:-1]


def summaries(lines: list[dict]) -> list[dict]:
    return [m for m in lines if m.get("event") == "done"]


def c_text(lines: list[dict]) -> str:
    return "".join(m["body"]["text"] for m in lines if m["headers"].get("Kvbus-Stream") == "chunk")


def assert_conforms(summary: dict) -> None:
    assert not summary["problems"], summary["problems"]


def assert_c_conforms(modules, contract, op: str, lines: list[dict]) -> list[str]:
    """Every message the C client got is a message of ``op``'s contract; their kinds, in order."""
    checked = checked_by_contract(modules, contract, op, lines)
    bad = [(c["kind"], c["problems"]) for c in checked if c["problems"]]
    assert not bad, bad
    return [c["kind"] for c in checked]


async def _all_idle(nats_url: str, timeout: float) -> float:
    """Seconds until every worker runs nothing and has every KV page free (health detail)."""
    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=10))
    t0 = time.monotonic()
    try:
        while True:
            states = await engine_states(bus, WORKERS)
            if all(is_idle(d) for d in states.values()):
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, f"not idle within {timeout:g}s: {states}"
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


def all_idle(system, timeout: float = WAIT_S) -> float:
    return asyncio.run(_all_idle(system.nats_url, timeout))


def gateway_detail(system) -> dict[str, str]:
    async def ask():
        bus = await connect(BusConfig(nats_url=system.nats_url, request_timeout=10))
        try:
            return (await bus.request(HEALTH, HealthRequest(), role="gateway")).detail
        finally:
            await bus.close()
    return asyncio.run(ask())


# --- the contract itself ------------------------------------------------------------------------------------
def test_the_asyncapi_document_is_valid_for_the_official_parser(contract, modules):
    diagnostics = runners.run_node(modules, "validate_asyncapi.cjs", str(contract / "asyncapi.json"))
    verdict = diagnostics[-1]
    assert verdict == {"valid": True, "version": "3.0.0"}, diagnostics
    # errors (0) and warnings (1) alike: only hints and the "3.1.0 exists" notice may remain
    assert [d for d in diagnostics[:-1] if d["severity"] <= 1] == [], diagnostics


# --- the clients against kvbus up --------------------------------------------------------------------------
def test_a_long_stream_gets_only_what_it_asked_for_and_the_https_text(system, contract, modules, c_client,
                                                                       http_text):
    """Node (no probes asked), Node (probes asked and answered) and C at once, each well past several probe
    intervals: the first and the last get chunks and an end message only, the second its probes too."""
    plain = node_client(modules, contract, system, op="generate", body=request(GREEDY), timeout_s=300)
    asking = node_client(modules, contract, system, op="generate", body=request(GREEDY), probes=True,
                         answer="alive", timeout_s=300)
    t0 = time.monotonic()
    c = c_run(c_client, system, request(GREEDY), "-t", "300")
    c_lines = c.finish()
    c_took = time.monotonic() - t0
    [quiet], [probed] = summaries(plain.finish()), summaries(asking.finish())
    for summary in (quiet, probed):
        assert_conforms(summary)
        assert summary["ended"] == "end" and summary["chunks"] == NUM_TOKENS, summary
        assert summary["seqs"] == list(range(NUM_TOKENS + 1))
        assert summary["text"] == http_text
    assert quiet["probes"] == 0 and quiet["streamed_s"] > 3 * PROBE_INTERVAL, quiet  # nothing unasked for
    assert probed["probes"] >= 2 and probed["answered"] == probed["probes"], probed
    kinds = assert_c_conforms(modules, contract, "generate", c_lines)
    assert kinds == ["chunk"] * NUM_TOKENS + ["end"] and c_took > 3 * PROBE_INTERVAL  # no probe: it did not ask
    assert c_text(c_lines) == http_text


def test_the_once_subject(system, contract, modules, c_client, http_text):
    node = node_client(modules, contract, system, op="generateOnce", body=request(GREEDY), timeout_s=300)
    c_lines = c_run(c_client, system, request(GREEDY), "-s", "kvbus.v1.generate.once", "-t", "300").finish()
    [summary] = summaries(node.finish())
    assert_conforms(summary)
    assert summary["ended"] == "reply" and summary["text"] == http_text, summary
    assert assert_c_conforms(modules, contract, "generateOnce", c_lines) == ["reply"]
    assert c_lines[0]["body"]["text"] == http_text


def test_a_schema_violating_request_gets_a_typed_error(system, contract, modules, c_client):
    """``max_tokens`` belongs in ``sampling``: the request schema refuses it, and so does kvbus, in headers."""
    bad = {"prompt": PROMPT, "max_tokens": 4}
    node = node_client(modules, contract, system, op="generate", body=bad)
    c_lines = c_run(c_client, system, bad).finish()
    lines = node.finish()
    assert lines[0]["event"] == "request" and lines[0]["valid"] is False, lines[0]  # the client's own check
    [summary] = summaries(lines)
    assert_conforms(summary)
    assert summary["ended"] == "error" and summary["error"] == "invalid_argument", summary
    assert assert_c_conforms(modules, contract, "generate", c_lines) == ["error"]
    assert c_lines[0]["headers"]["Kvbus-Error-Code"] == "invalid_argument"
    assert "max_tokens" in c_lines[0]["headers"]["Kvbus-Error-Message"]


def test_an_overloaded_system_refuses_at_once_with_retry_after(system, contract, modules, c_client):
    """16 requests from each client at once against 2 workers x (2 running + 2 queued)."""
    one_token = {"prompt": PROMPT, "sampling": {"temperature": 0, "max_tokens": 1}}
    node = node_client(modules, contract, system, op="generateOnce", body=one_token, copies=16, timeout_s=300)
    c_lines = c_run(c_client, system, one_token, "-s", "kvbus.v1.generate.once", "-n", "16", "-t", "300").finish()
    results = summaries(node.finish())
    for summary in results:
        assert_conforms(summary)
    refused = [s for s in results if s["error"] == "overloaded"]
    assert refused and all(float(s["retry_after"]) > 0 for s in refused), results
    assert {s["ended"] for s in results} <= {"reply", "error"}, results
    kinds = assert_c_conforms(modules, contract, "generateOnce", c_lines)
    assert len(kinds) == 16 and "error" in kinds, kinds
    # the two floods raced for the same 8 places: which client got them is up to the router
    assert "reply" in kinds or any(s["ended"] == "reply" for s in results), (kinds, results)
    c_refused = [m["headers"] for m in c_lines if "Kvbus-Error-Code" in m["headers"]]
    assert {h["Kvbus-Error-Code"] for h in c_refused} == {"overloaded"}
    assert all(float(h["Kvbus-Retry-After"]) > 0 for h in c_refused)
    all_idle(system)


def test_cancelled_and_abandoned_streams_free_their_pages(system, contract, modules, c_client):
    """Generations that would run for minutes: Node and C cancel theirs (a CancelEvent) after 3 chunks;
    a Node client that asked for probes is killed after 3 chunks. Every page comes back within seconds."""
    all_idle(system)
    cancelling = node_client(modules, contract, system, op="generate", body=request(ENDLESS), cancel_after=3)
    c = c_run(c_client, system, request(ENDLESS), "-c", "3")
    killed = node_client(modules, contract, system, op="generate", body=request(ENDLESS), probes=True,
                         answer="alive")
    killed.wait_for_chunks(3)
    killed.proc.send_signal(signal.SIGKILL)  # no CancelEvent, no goodbye: only the probe can tell
    killed.proc.wait()
    [summary] = summaries(cancelling.finish())
    assert_conforms(summary)
    assert summary["ended"] == "cancelled" and summary["chunks"] == 3, summary
    assert assert_c_conforms(modules, contract, "generate", c.finish()) == ["chunk"] * 3
    all_idle(system, timeout=30)  # the context limit takes minutes: only the cancels and the probe ended them


def test_streams_through_a_worker_killed_mid_way_migrate_and_match_http(system, contract, modules, c_client,
                                                                        http_text):
    """Last: it kills a worker. One session, so both streams run on one worker; SIGKILL it after 2 chunks
    of each: the gateway moves both to the other worker, and each client sees one unbroken, valid stream."""
    all_idle(system)
    before = int(gateway_detail(system)["migrations"])
    body = request(GREEDY, session_id="wire-contract-migration")
    # Node first, C once Node streams: a node process can take seconds to start on a loaded machine,
    # and C, started together with it, had finished its 24 tokens by then (seen with the cores busy).
    # Both streams are paced by the same engine steps now: C's prefill and 2 chunks take ~3 of the
    # ~22 steps Node has left.
    node = node_client(modules, contract, system, op="generate", body=body, timeout_s=300)
    node.wait_for_chunks(2)
    c = c_run(c_client, system, body, "-t", "300")
    c.wait_for_chunks(2)
    states = asyncio.run(_states(system.nats_url))
    victims = [wid for wid, detail in states.items() if detail.get("running") == "2"]
    assert len(victims) == 1, (f"the session's two streams are not on one worker: {states}; Node had "
                               f"{node.chunks()} chunks, C {c.chunks()}")
    victim = victims[0]
    os.kill(pid_of(system, victim), signal.SIGKILL)
    c_lines = c.finish()
    [summary] = summaries(node.finish())
    assert_conforms(summary)
    assert summary["ended"] == "end" and summary["seqs"] == list(range(NUM_TOKENS + 1)), summary
    assert summary["text"] == http_text
    assert assert_c_conforms(modules, contract, "generate", c_lines) == ["chunk"] * NUM_TOKENS + ["end"]
    assert c_text(c_lines) == http_text
    assert int(gateway_detail(system)["migrations"]) == before + 2


async def _states(nats_url: str) -> dict[str, dict[str, str]]:
    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=10))
    try:
        return await engine_states(bus, WORKERS)
    finally:
        await bus.close()
