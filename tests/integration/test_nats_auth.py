"""Auth from BusConfig against a nats-server that requires it."""

from __future__ import annotations

import shutil

import anyio

import pytest
from services.natsd import local_nats_server

from bus import errors
from bus.nats_transport import BusConfig, connect
from bus.subjects import DEBUG_ECHO
from schemas.common import EchoReply, EchoRequest

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=["user", "token"])
def secured_server(request):
    if shutil.which("nats-server") is None:
        pytest.skip("needs nats-server: `apt-get install -y nats-server`")
    auth = ["--user", "svc", "--pass", "s3cret"] if request.param == "user" else ["--auth", "t0ken"]
    good = dict(nats_user="svc", nats_password="s3cret") if request.param == "user" else dict(nats_token="t0ken")
    bad = dict(nats_user="svc", nats_password="wrong") if request.param == "user" else dict(nats_token="nope")
    with local_nats_server(*auth) as url:
        yield url, good, bad


async def test_right_credentials_work_wrong_ones_fail_clearly(secured_server):
    url, good, bad = secured_server
    with pytest.raises(errors.Unavailable, match=f"cannot connect to NATS at {url}"):
        await connect(BusConfig(nats_url=url, connect_timeout=1.0, **bad))
    server = await connect(BusConfig(nats_url=url, **good))
    client = await connect(BusConfig(nats_url=url, **good))
    try:
        async def echo(req: EchoRequest) -> EchoReply:
            return EchoReply(data=req.data)

        await server.serve(DEBUG_ECHO, echo)
        await server.flush()
        # NOTE: in one full CI run (2026-11-30) the first request still met "no responders" right after the
        # flush; wait on the condition (the service answers) for a bounded time instead.
        deadline = anyio.current_time() + 10.0
        while True:
            try:
                reply = await client.request(DEBUG_ECHO, EchoRequest(data=b"authed"), timeout=2.0)
                break
            except errors.Unavailable:
                if anyio.current_time() > deadline:
                    raise
                await server.flush()
        assert reply.data == b"authed"
    finally:
        await server.close()
        await client.close()
