"""HTTP API keys on the gateway (real uvicorn port, in-memory bus, real tokenizer): OpenAI-style bearer auth."""

from __future__ import annotations

import httpx
import openai
import pytest

from bus.memory import MemoryNetwork, memory_bus
from services import config as cfg
from services.cli import serve_parser
from services.config import ConfigError
from services.gateway import GatewayActor, GatewayConfig
from services.gateway.auth import load_api_keys
from services.runner import bind_health
from services.tokenizer import TokenizerActor, TokenizerConfig, TokenizerCore

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def core(model_dir):
    return TokenizerCore(model_dir)


@pytest.fixture
async def gateway(core, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-from-file\n\n")
    network = MemoryNetwork()
    started = []
    for actor in (TokenizerActor(TokenizerConfig(), core=core),
                  GatewayActor(GatewayConfig(http_port=0, api_key=("sk-one", "sk-two"), api_key_file=str(key_file)),
                               worker_id="gateway-0")):
        bus = memory_bus(network)
        await actor.start(bus)
        await bind_health(bus, actor)
        started.append((actor, bus))
    gw = started[-1][0]
    yield f"http://127.0.0.1:{gw.http_port}"
    for actor, bus in reversed(started):
        await actor.drain(5.0)
        await bus.drain(timeout=5)
        await actor.stop()


async def test_v1_needs_a_valid_bearer_key(gateway):
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        for headers, message in [({}, "didn't provide an API key"),
                                 ({"Authorization": "Bearer sk-wrong"}, "Incorrect API key"),
                                 ({"Authorization": "Basic sk-one"}, "Incorrect API key"),
                                 ({"Authorization": "Bearer sk-one-and-more"}, "Incorrect API key")]:
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
                r = await http.request(method, path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (path, headers, r.text)
                error = r.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
                assert message in error["message"] and "sk-" not in error["message"]
                assert r.headers["www-authenticate"].startswith("Bearer")
        for key in ("sk-one", "sk-two", "sk-from-file"):
            r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        # Open by policy: probes and scrapers need no secret (the router is absent: 503, not 401).
        assert (await http.get("/health")).status_code == 503
        assert (await http.get("/metrics")).status_code == 200


async def test_openai_client_with_and_without_the_key(gateway):
    # Both clients are closed inside the test: an unclosed one is finalized later, in another
    # test's event loop, and fails that test with "Event loop is closed".
    async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="sk-two", max_retries=0) as good:
        assert [m.id for m in (await good.models.list()).data]
    async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="sk-nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.completions.create(model="m", prompt="x", max_tokens=1)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_keys_from_flags_env_and_file(tmp_path):
    parser = serve_parser("gateway", GatewayActor)
    args = parser.parse_args(["--api-key", "a", "--api-key", "b"])
    fields = {k: v for k, v in vars(args).items() if k in GatewayConfig.__dataclass_fields__}
    assert cfg.build(GatewayConfig, fields, env={}).api_key == ("a", "b")
    assert cfg.build(GatewayConfig, {}, env={"KVBUS_API_KEY": "k1, k2"}).api_key == ("k1", "k2")
    assert cfg.build(GatewayConfig, {}, env={}).api_key == ()
    assert load_api_keys(GatewayConfig()) == ()
    with pytest.raises(ConfigError, match="holds no key"):
        (tmp_path / "empty").write_text("# nothing\n")
        load_api_keys(GatewayConfig(api_key_file=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="api-key-file"):
        load_api_keys(GatewayConfig(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="non-empty"):
        GatewayConfig(api_key=(" padded ",))
