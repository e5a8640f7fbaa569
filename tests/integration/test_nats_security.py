"""NATS security on a real nats-server: deploy/nats/auth.conf permissions, nkey auth, mutual TLS."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from bus import errors
from bus.nats_transport import BusConfig, connect
from bus.subjects import ALL_SUBJECTS, CANCEL, HEALTH, ROUTE, WORKER_HEARTBEAT
from schemas.common import HealthReply, HealthRequest
from schemas.worker import RouteReply, RouteRequest, WorkerHeartbeatEvent, WorkerLoad
from services.natsd import local_nats_server
from tests.nats_conf import subject_matches as _matches

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
AUTH_CONF = ROOT / "deploy/nats/auth.conf"
SERVICE = dict(nats_user="kvbus-service", nats_password="CHANGE-ME-service")
CLIENT = dict(nats_user="kvbus-client", nats_password="CHANGE-ME-client")


def _needs_nats_server():
    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")


def test_client_role_may_publish_every_public_subject_and_no_internal_one():
    # Public events (reply None) flow out of kvbus: a client may subscribe to them, never publish one.
    text = AUTH_CONF.read_text()
    client_block = text[text.index("CLIENT = {"):]
    publish = re.search(r"publish:\s*\{\s*allow:\s*\[(.*?)\]", client_block, re.S).group(1)
    subscribe = re.search(r"subscribe:\s*\{\s*allow:\s*\[(.*?)\]", client_block, re.S).group(1)
    allowed = re.findall(r'"([^"]+)"', publish)
    listens = [p for p in re.findall(r'"([^"]+)"', subscribe) if not p.startswith("_INBOX")]
    for subject in ALL_SUBJECTS:
        name = subject.template.format(**{f: "x" for f in subject.fields})
        is_outbound_event = subject.public and subject.reply is None
        may = any(_matches(p, name) for p in allowed)
        assert may == ((subject.public and not is_outbound_event) or subject is CANCEL), (subject.template, allowed)
        assert any(_matches(p, name) for p in listens) == is_outbound_event, (subject.template, listens)


@pytest.fixture(scope="module")
def secured_by_deploy_config(tmp_path_factory):
    """nats-server running deploy/nats/auth.conf as shipped (placeholder passwords)."""
    _needs_nats_server()
    folder = tmp_path_factory.mktemp("nats-auth")
    shutil.copy(AUTH_CONF, folder / "auth.conf")
    (folder / "server.conf").write_text("include ./auth.conf\n")
    with local_nats_server("-c", str(folder / "server.conf")) as url:
        yield url


async def test_deploy_permissions_refuse_a_client_on_internal_subjects(secured_by_deploy_config):
    url = secured_by_deploy_config
    service = await connect(BusConfig(nats_url=url, **SERVICE))
    client = await connect(BusConfig(nats_url=url, **CLIENT))
    routed: list[str] = []
    beats: list[WorkerHeartbeatEvent] = []
    try:
        async def route(req: RouteRequest) -> RouteReply:
            routed.append(req.request_id)
            return RouteReply(decode_worker_id="w")

        async def health(req: HealthRequest) -> HealthReply:
            return HealthReply(role="gateway", worker_id="g", ready=True, version="0", uptime_s=0.0)

        await service.serve(ROUTE, route)
        await service.serve(HEALTH, health, queue=False, role="gateway")
        await service.flush()
        # A public subject works for the client (wait for the condition, not a fixed time).
        deadline = anyio.current_time() + 10.0
        while True:
            try:
                assert (await client.request(HEALTH, HealthRequest(), timeout=2.0, role="gateway")).ready
                break
            except errors.Unavailable:
                if anyio.current_time() > deadline:
                    raise
        # The service itself may call the internal one...
        assert (await service.request(ROUTE, RouteRequest(request_id="svc", prompt_token_ids=[1]))).decode_worker_id
        # ...the client may not: the server drops its message, the router never sees it.
        with pytest.raises((errors.Timeout, errors.Unavailable)):
            await client.request(ROUTE, RouteRequest(request_id="client", prompt_token_ids=[1]), timeout=1.0)
        assert routed == ["svc"]
        # Nor may the client listen in on internal traffic.
        async def on_beat(event: WorkerHeartbeatEvent) -> None:
            beats.append(event)

        await client.subscribe(WORKER_HEARTBEAT, on_beat)
        await client.flush()
        await service.publish(WORKER_HEARTBEAT, WorkerHeartbeatEvent(worker_id="w", role="decode", host_id="h",
                                                                     load=WorkerLoad()))
        await service.flush()
        # The service's own round trip on the same subject proves the event went through the server.
        got: list[WorkerHeartbeatEvent] = []

        async def on_own(event: WorkerHeartbeatEvent) -> None:
            got.append(event)

        await service.subscribe(WORKER_HEARTBEAT, on_own)
        await service.flush()
        await service.publish(WORKER_HEARTBEAT, WorkerHeartbeatEvent(worker_id="w2", role="decode", host_id="h",
                                                                     load=WorkerLoad()))
        with anyio.fail_after(10):
            while not got:
                await anyio.sleep(0.01)
        await client.flush()
        assert beats == []
    finally:
        await service.close()
        await client.close()


def _nkey_pair() -> tuple[bytes, str]:
    import os

    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


async def test_nkey_auth(tmp_path):
    _needs_nats_server()
    seed, public = _nkey_pair()
    other_seed, _ = _nkey_pair()
    (tmp_path / "server.conf").write_text(f"authorization {{ users: [ {{ nkey: {public} }} ] }}\n")
    (tmp_path / "user.nk").write_bytes(seed)
    (tmp_path / "other.nk").write_bytes(other_seed)
    (tmp_path / "user.nk").chmod(0o600)
    with local_nats_server("-c", str(tmp_path / "server.conf")) as url:
        with pytest.raises(errors.Unavailable, match="cannot connect"):
            await connect(BusConfig(nats_url=url, connect_timeout=1.0, nats_nkey_seed=str(tmp_path / "other.nk")))
        with pytest.raises(errors.Unavailable, match="cannot connect"):
            await connect(BusConfig(nats_url=url, connect_timeout=1.0))
        bus = await connect(BusConfig(nats_url=url, nats_nkey_seed=str(tmp_path / "user.nk")))
        await bus.close()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvbus-test-ca",
             "-keyout", "ca-key.pem", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvbus-{name}", "-keyout", f"{name}-key.pem",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)
    return d


async def test_mutual_tls(certs):
    _needs_nats_server()
    conf = certs / "tls.conf"
    conf.write_text(f'tls {{ cert_file: "{certs}/server.pem"\n key_file: "{certs}/server-key.pem"\n'
                    f' ca_file: "{certs}/ca.pem"\n verify: true\n timeout: 5 }}\n')
    with local_nats_server("-c", str(conf)) as url:
        tls_url = url.replace("nats://", "tls://")
        with pytest.raises(errors.Unavailable):  # no client certificate
            await connect(BusConfig(nats_url=tls_url, connect_timeout=1.0, nats_tls_ca=str(certs / "ca.pem")))
        bus = await connect(BusConfig(nats_url=tls_url, nats_tls_ca=str(certs / "ca.pem"),
                                      nats_tls_cert=str(certs / "client.pem"),
                                      nats_tls_key=str(certs / "client-key.pem")))
        try:
            async def health(req: HealthRequest) -> HealthReply:
                return HealthReply(role="t", worker_id="t", ready=True, version="0", uptime_s=0.0)

            await bus.serve(HEALTH, health, queue=False, role="t")
            await bus.flush()
            assert (await bus.request(HEALTH, HealthRequest(), timeout=5.0, role="t")).ready
        finally:
            await bus.close()
