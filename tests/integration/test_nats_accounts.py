"""deploy/nats/accounts.conf on a real nats-server: services in KVBUS, API callers in CLIENTS, SYS monitors.

What NATS really does here (nats-server 2.9): a request from CLIENTS on an imported subject reaches the
KVBUS service and its reply (every chunk of a stream) comes back to the caller's inbox; a client's publish
or subscribe outside its permissions is refused with a "permissions violation" error on its connection,
the message going nowhere; and even a client without any permissions only talks to its own account, so
an internal subject it publishes never reaches kvbus. A request on an imported subject that nothing
serves is not answered "no responders" across the account boundary: the caller times out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bus import errors
from bus.nats_transport import BusConfig, connect
from bus.subjects import (
    ALL_SUBJECTS,
    GENERATE,
    HEALTH,
    KV_EVENTS,
    KV_EVENTS_DUMP,
    ROUTE,
    TOKENIZER_ENCODE,
    WORKER_HEARTBEAT,
)
from schemas.common import HealthReply, HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateChunk, GenerateRequest
from schemas.kv_store import KVDumpRequest, KVEvent, KVEventBatchEvent
from schemas.tokenizer import EncodeReply, EncodeRequest
from schemas.worker import RouteReply, RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services.natsd import local_nats_server
from tests.nats_conf import block

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
ACCOUNTS_CONF = ROOT / "deploy/nats/accounts.conf"
SERVICE = dict(nats_user="kvbus-service", nats_password="CHANGE-ME-service")
CLIENT = dict(nats_user="kvbus-client", nats_password="CHANGE-ME-client")
ADMIN = dict(nats_user="kvbus-admin", nats_password="CHANGE-ME-admin")
# nats-server's own monitoring subjects (system account), not kvbus subjects: they are not in bus/subjects.py.
SYS_VARZ = "$SYS.REQ.SERVER.PING.VARZ"
SYS_CONNZ = "$SYS.REQ.SERVER.PING.CONNZ"
WAIT_S = 30.0


def _serve_conf(folder: Path, text: str):
    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")
    (folder / "accounts.conf").write_text(text)
    (folder / "server.conf").write_text("include ./accounts.conf\n")
    return local_nats_server("-c", str(folder / "server.conf"))


@pytest.fixture(scope="module")
def accounts_server(tmp_path_factory):
    """nats-server running deploy/nats/accounts.conf as shipped (placeholder passwords)."""
    with _serve_conf(tmp_path_factory.mktemp("nats-accounts"), ACCOUNTS_CONF.read_text()) as url:
        yield url


@pytest.fixture(scope="module")
def clients_without_permissions(tmp_path_factory):
    """The same accounts, but the CLIENTS user has no permissions at all: only the account boundary holds."""
    text = ACCOUNTS_CONF.read_text()
    clients = text.index("CLIENTS {")
    start = text.index("permissions: {", clients)
    inner = block(text[start:], "permissions: {")
    stripped = text[:start] + text[start + len("permissions: {") + len(inner) + 1:]
    assert "kvbus-client" in stripped and stripped.count("permissions:") == text.count("permissions:") - 1
    with _serve_conf(tmp_path_factory.mktemp("nats-open-clients"), stripped) as url:
        yield url


async def _until(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not within {timeout:g}s"
        await asyncio.sleep(0.01)


async def _ready(client, role: str) -> None:
    """Wait until a served HEALTH answers the client across the boundary (a condition, not a sleep).

    NOTE: across accounts an unserved request times out (no "no responders"), so each try is short.
    """
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        try:
            if (await client.request(HEALTH, HealthRequest(), timeout=1.0, role=role)).ready:
                return
        except (errors.Timeout, errors.Unavailable):
            assert asyncio.get_running_loop().time() < deadline, f"{role} not reachable within {WAIT_S:g}s"


def _health(role: str):
    async def health(req: HealthRequest) -> HealthReply:
        return HealthReply(role=role, worker_id=f"{role}-0", ready=True, version="0", uptime_s=0.0)

    return health


def _batch(worker_id: str, event_id: int) -> KVEventBatchEvent:
    return KVEventBatchEvent(worker_id=worker_id, host_id="h", event_id=event_id,
                             events=[KVEvent(kind="stored", tier="device", page_hashes=[event_id],
                                             parent_hashes=[0])])


async def test_a_client_streams_requests_and_cancels_across_the_account_boundary(accounts_server):
    service = await connect(BusConfig(nats_url=accounts_server, **SERVICE))
    client = await connect(BusConfig(nats_url=accounts_server, **CLIENT))
    cancelled = asyncio.Event()
    try:
        async def generate(req: GenerateRequest):
            if req.prompt == "refuse":
                raise errors.InvalidArgument("prompt refused")
            count = int(req.prompt) if req.prompt != "forever" else 10**9
            try:
                for i in range(count):
                    yield GenerateChunk(text=str(i), token_ids=[i])
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def encode(req: EncodeRequest) -> EncodeReply:
            return EncodeReply(ids=[len(w) for w in req.text.split()])

        await service.serve(GENERATE, generate)
        await service.serve(TOKENIZER_ENCODE, encode)
        await service.serve(HEALTH, _health("gateway"), queue=False, role="gateway")
        await service.flush()
        await _ready(client, "gateway")

        # A streamed reply: every chunk crosses, in order, then the end of the stream.
        async with client.stream(GENERATE, GenerateRequest(prompt="40"), timeout=WAIT_S) as chunks:
            texts = [chunk.text async for chunk in chunks]
        assert texts == [str(i) for i in range(40)]
        # A single reply, and a typed error: the error headers cross the boundary too.
        assert (await client.request(TOKENIZER_ENCODE, EncodeRequest(text="ab c def"), timeout=WAIT_S)).ids == [2, 1, 3]
        with pytest.raises(errors.InvalidArgument, match="prompt refused"):
            async with client.stream(GENERATE, GenerateRequest(prompt="refuse"), timeout=WAIT_S) as chunks:
                async for _ in chunks:
                    pass
        # Leaving a stream early publishes a cancel event, imported into KVBUS: the server's work stops.
        async with client.stream(GENERATE, GenerateRequest(prompt="forever"), timeout=WAIT_S) as chunks:
            assert [(await chunks.__anext__()).text for _ in range(3)] == ["0", "1", "2"]
        await asyncio.wait_for(cancelled.wait(), WAIT_S)
    finally:
        await service.close()
        await client.close()


async def test_a_client_cannot_reach_internal_subjects_nor_publish_kv_events(accounts_server, caplog):
    caplog.set_level(logging.WARNING, logger="bus.nats_transport")
    service = await connect(BusConfig(nats_url=accounts_server, **SERVICE))
    client = await connect(BusConfig(nats_url=accounts_server, **CLIENT))
    other_client = await connect(BusConfig(nats_url=accounts_server, **CLIENT))
    routed: list[str] = []
    client_beats: list[WorkerHeartbeatEvent] = []
    service_beats: list[WorkerHeartbeatEvent] = []
    seen_by_service: list[KVEventBatchEvent] = []
    seen_by_clients: list[KVEventBatchEvent] = []
    try:
        async def route(req: RouteRequest) -> RouteReply:
            routed.append(req.request_id)
            return RouteReply(decode_worker_id="w")

        async def on_service_events(event: KVEventBatchEvent) -> None:
            seen_by_service.append(event)

        async def on_client_events(event: KVEventBatchEvent) -> None:
            seen_by_clients.append(event)

        async def on_client_beat(event: WorkerHeartbeatEvent) -> None:
            client_beats.append(event)

        async def on_service_beat(event: WorkerHeartbeatEvent) -> None:
            service_beats.append(event)

        await service.serve(ROUTE, route)
        await service.serve(HEALTH, _health("router"), queue=False, role="router")
        await service.subscribe(KV_EVENTS, on_service_events)
        await service.subscribe(WORKER_HEARTBEAT, on_service_beat)
        await service.flush()
        await other_client.subscribe(KV_EVENTS, on_client_events)
        await other_client.flush()
        await _ready(client, "router")

        # The routing subject is internal: the server refuses the client's request; the router never sees it.
        with pytest.raises(errors.Timeout):
            await client.request(ROUTE, RouteRequest(request_id="client", prompt_token_ids=[1]), timeout=1.0)
        assert (await service.request(ROUTE, RouteRequest(request_id="svc", prompt_token_ids=[1]))).decode_worker_id
        assert routed == ["svc"]

        # Nor may a client listen to internal traffic: its subscription is refused.
        await client.subscribe(WORKER_HEARTBEAT, on_client_beat)
        await client.flush()
        # A client may not publish a KV event (it could poison a router's index), not even for other clients.
        await client.publish(KV_EVENTS, _batch("forged", 1), worker_id="forged")
        await client.flush()
        # What the service publishes flows through; the client's forgery, sent before it, would be ahead of it.
        await service.publish(WORKER_HEARTBEAT, WorkerHeartbeatEvent(worker_id="w", role="decode", host_id="h",
                                                                     load=WorkerLoad()))
        await service.publish(KV_EVENTS, _batch("worker-0", 7), worker_id="worker-0")
        await service.flush()
        await _until(lambda: seen_by_clients and seen_by_service and service_beats, "the service's events")
        await client.flush()
        assert [e.worker_id for e in seen_by_clients] == ["worker-0"]  # the KV events stream export works...
        assert [e.worker_id for e in seen_by_service] == ["worker-0"]  # ...and only the service's arrive
        assert client_beats == []
        violations = " ".join(r.getMessage() for r in caplog.records).lower()
        for what in ('publish to "kvbus.v1.router.route"', 'subscription to "kvbus.v1.workers.heartbeat"',
                     'publish to "kvbus.v1.kv_events.forged"'):
            assert f"permissions violation for {what}" in violations, violations
    finally:
        for bus in (service, client, other_client):
            await bus.close()


async def test_the_account_alone_keeps_a_client_without_permissions_out(clients_without_permissions):
    url = clients_without_permissions
    service = await connect(BusConfig(nats_url=url, **SERVICE))
    client = await connect(BusConfig(nats_url=url, **CLIENT))
    routed: list[str] = []
    beats: list[str] = []
    heard: list[str] = []
    try:
        async def route(req: RouteRequest) -> RouteReply:
            routed.append(req.request_id)
            return RouteReply(decode_worker_id="w")

        async def on_beat(event: WorkerHeartbeatEvent) -> None:
            beats.append(event.worker_id)

        await service.serve(ROUTE, route)
        await service.serve(HEALTH, _health("router"), queue=False, role="router")
        await service.subscribe(WORKER_HEARTBEAT, on_beat)
        await service.flush()
        # The client listens to everything under kvbus.v1 its account can see.
        nc = client.transport.nc

        async def on_anything(msg) -> None:
            heard.append(msg.subject)

        await nc.subscribe("kvbus.v1.>", cb=on_anything)
        await nc.flush()
        await _ready(client, "router")

        # Internal subjects published in CLIENTS stay in CLIENTS: no route request, no forged heartbeat in KVBUS.
        with pytest.raises(errors.Timeout):
            await client.request(ROUTE, RouteRequest(request_id="client", prompt_token_ids=[1]), timeout=1.0)
        await client.publish(WORKER_HEARTBEAT, WorkerHeartbeatEvent(worker_id="forged", role="decode", host_id="h",
                                                                    load=WorkerLoad()))
        await client.flush()
        # And of KVBUS's traffic only the exported KV events reach the client.
        await service.publish(WORKER_HEARTBEAT, WorkerHeartbeatEvent(worker_id="real", role="decode", host_id="h",
                                                                     load=WorkerLoad()))
        await service.request(ROUTE, RouteRequest(request_id="svc", prompt_token_ids=[1]))
        await service.publish(KV_EVENTS, _batch("worker-0", 1), worker_id="worker-0")
        await service.flush()
        await _until(lambda: "kvbus.v1.kv_events.worker-0" in heard and beats, "the service's events")
        assert routed == ["svc"]
        assert beats == ["real"]
        # What the client hears: its own publishes (its account: health and route requests, the cancel its
        # timed-out request sent, the forged heartbeat) and the imported KV events, nothing else of KVBUS.
        assert set(heard) <= {"kvbus.v1.router.route", "kvbus.v1.workers.heartbeat", "kvbus.v1.kv_events.worker-0",
                              "kvbus.v1.health.router", "kvbus.v1.cancel"}, heard
        assert heard.count("kvbus.v1.workers.heartbeat") == 1  # the client's own forgery, not the service's beat
        assert heard.count("kvbus.v1.router.route") == 1  # the client's own request, not the service's
    finally:
        await service.close()
        await client.close()


async def _request_once_heard(nc, subject: str, payload: bytes):
    """A raw request, repeated while the server answers "no responders" (a condition, not a sleep).

    NOTE: right after the peer's SUBs were flushed, this server with accounts answered "no
    responders" to one of these requests in about 1 run in 20 (cause not established). A subject
    the peer may not subscribe to is never heard, so the deadline still fails the test."""
    import nats.errors

    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        try:
            return await nc.request(subject, payload, timeout=WAIT_S)
        except nats.errors.NoRespondersError:
            assert loop.time() < deadline, f"no responders on {subject} within {WAIT_S} s"
            await asyncio.sleep(0.01)


async def test_a_service_user_may_use_every_kvbus_subject(accounts_server):
    service = await connect(BusConfig(nats_url=accounts_server, **SERVICE))
    peer = await connect(BusConfig(nats_url=accounts_server, **SERVICE))
    try:
        nc, peer_nc = service.transport.nc, peer.transport.nc
        received: dict[str, bytes] = {}

        async def on_message(msg) -> None:
            received[msg.subject] = msg.data
            if msg.reply:
                await peer_nc.publish(msg.reply, b"reply:" + msg.data)

        names = {s.template: s.template.format(**{f: f"{f}-1" for f in s.fields}) for s in ALL_SUBJECTS}
        names["micro"] = "$SRV.PING.kvbus-tokenizer"  # NATS micro discovery, which every service answers
        for name in names.values():
            await peer_nc.subscribe(name, cb=on_message)
        await peer_nc.flush()
        for template, name in names.items():
            reply = await _request_once_heard(nc, name, template.encode())  # through an _INBOX
            assert reply.data == b"reply:" + template.encode()
        assert received == {name: template.encode() for template, name in names.items()}
    finally:
        await service.close()
        await peer.close()


async def test_the_system_account_monitors_the_server_and_only_it(accounts_server, caplog):
    caplog.set_level(logging.WARNING, logger="bus.nats_transport")
    admin = await connect(BusConfig(nats_url=accounts_server, **ADMIN))
    service = await connect(BusConfig(nats_url=accounts_server, **SERVICE))
    client = await connect(BusConfig(nats_url=accounts_server, **CLIENT))
    try:
        varz = json.loads((await admin.transport.nc.request(SYS_VARZ, b"", timeout=WAIT_S)).data)["data"]
        assert varz["version"] and varz["connections"] >= 3
        connz = json.loads((await admin.transport.nc.request(SYS_CONNZ, b"{}", timeout=WAIT_S)).data)["data"]
        assert connz["num_connections"] >= 3
        for bus in (service, client):  # not in the system account: refused
            with pytest.raises(Exception):
                await bus.transport.nc.request(SYS_VARZ, b"", timeout=1.0)
        violations = " ".join(r.getMessage() for r in caplog.records).lower()
        assert violations.count(f'permissions violation for publish to "{SYS_VARZ.lower()}"') == 2, violations
    finally:
        for bus in (admin, service, client):
            await bus.close()


def test_the_server_config_with_accounts_included_is_valid(tmp_path):
    """deploy/nats/nats-server.conf with its ``include ./accounts.conf`` line uncommented, as documented."""
    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")
    server_conf = (ROOT / "deploy/nats/nats-server.conf").read_text()
    assert "# include ./accounts.conf\n" in server_conf
    enabled = server_conf.replace("# include ./accounts.conf", "include ./accounts.conf")
    (tmp_path / "nats-server.conf").write_text(enabled)
    shutil.copy(ACCOUNTS_CONF, tmp_path / "accounts.conf")
    check = subprocess.run(["nats-server", "-c", str(tmp_path / "nats-server.conf"), "-t"], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0 and "is valid" in check.stdout + check.stderr, check.stdout + check.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("--aggregated",),
    # Prefill and decode workers, the KV pages sent over NATS (kvbus.v1.kv.*) as kvbus-service too.
    ("--prefill", "1", "--decode", "1", "--kv-transfer", "nats", "--engine-args", "--local-prefill-tokens 0"),
], ids=["aggregated", "disaggregated"])
async def test_a_real_kvbus_system_serves_a_client_of_another_account(accounts_server, model_dir, layout):
    """``kvbus up`` against the accounts config, every service as kvbus-service (KVBUS_NATS_USER/_PASSWORD)."""
    from transformers import AutoTokenizer

    from services.local_system import LocalSystem

    env = {"KVBUS_NATS_USER": SERVICE["nats_user"], "KVBUS_NATS_PASSWORD": SERVICE["nats_password"]}
    with LocalSystem(*layout, "--nats-url", accounts_server, "--num-threads", "1",
                     model_dir=model_dir, env=env) as system:
        client = await connect(BusConfig(nats_url=accounts_server, request_timeout=120, **CLIENT))
        events: list[KVEventBatchEvent] = []
        try:
            async def on_events(event: KVEventBatchEvent) -> None:
                events.append(event)

            await client.subscribe(KV_EVENTS, on_events)
            await client.flush()
            # A prompt of several full KV pages: the worker publishes their hashes as KV events.
            request = GenerateRequest(prompt="A client in another account asks about rivers. " * 12,
                                      sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            async with client.stream(GENERATE, request, timeout=120) as chunks:
                got = [chunk async for chunk in chunks]
            assert sum(len(c.token_ids) for c in got) == 8 and got[-1].finish_reason == "length", system.log(40)
            if "--prefill" in layout:  # the prompt went through the prefill worker and its pages over NATS
                assert "prefill_call_s" in (got[0].timings or {}), got[0].timings
            await _until(lambda: events, "a KV event from the worker")
            dump = await client.request(KV_EVENTS_DUMP, KVDumpRequest(), timeout=WAIT_S, worker_id=events[0].worker_id)
            assert dump.worker_id == events[0].worker_id and dump.events

            # The kvbus command as an API caller: the client's credentials, the real tokenizer's answer.
            text = "Hello across accounts"
            call = subprocess.run(
                [sys.executable, "-m", "services.cli", "call", TOKENIZER_ENCODE.template, json.dumps({"text": text}),
                 "--nats-url", accounts_server, "--nats-user", CLIENT["nats_user"],
                 "--nats-password", CLIENT["nats_password"]],
                cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("KVBUS_NATS_")},
                capture_output=True, text=True, timeout=120)
            assert call.returncode == 0, call.stderr
            assert json.loads(call.stdout)["ids"] == AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
            assert not re.search(r"permissions violation", system.log(400), re.I), system.log(80)
        finally:
            await client.close()
