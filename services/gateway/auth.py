"""HTTP API keys, OpenAI style: ``Authorization: Bearer KEY`` on every /v1 request.

Policy (docs/reliability.md, "Security"): with no key configured the API is open (the
default binds 127.0.0.1). With keys, every path under /v1 needs one of them and gets a
401 with an OpenAI error body (``invalid_api_key``) without or with a wrong one.
``/health`` and ``/metrics`` stay open, as in vLLM, so load balancers, Kubernetes probes
and Prometheus need no secret; they carry no request content. Keys are compared in
constant time. The NATS subjects are secured by NATS itself (users, permissions, TLS).
"""

from __future__ import annotations

import hmac
from pathlib import Path

import msgspec

from services.config import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.openai_schemas import ErrorDetail, ErrorResponse

PROTECTED_PREFIX = "/v1"


def load_api_keys(config: GatewayConfig) -> tuple[bytes, ...]:
    """The configured keys (flags/env plus the key file); empty: no auth."""
    keys = list(config.api_key)
    if config.api_key_file:
        path = Path(config.api_key_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ConfigError(f"--api-key-file {path} holds no key")
        keys += from_file
    return tuple(k.encode() for k in keys)


def _unauthorized(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = msgspec.json.encode(ErrorResponse(error=ErrorDetail(
        message=message, type="invalid_request_error", code="invalid_api_key")))
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"www-authenticate", b'Bearer realm="kvbus"')]


class ApiKeyMiddleware:
    """ASGI middleware: a /v1 request without a valid bearer key gets 401 before any work."""

    def __init__(self, app, keys: tuple[bytes, ...]):
        self.app = app
        self.keys = keys

    def is_allowed(self, authorization: bytes | None) -> bool:
        if authorization is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # every key is compared, so the time taken says nothing about which one nearly matched
        return any([hmac.compare_digest(token, key) for key in self.keys])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        authorization = dict(scope["headers"]).get(b"authorization")
        if self.is_allowed(authorization):
            return await self.app(scope, receive, send)
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
                   if authorization is None else "Incorrect API key provided.")
        body, headers = _unauthorized(message)
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def install_auth(app, config: GatewayConfig) -> None:
    """Require API keys on ``app`` when the config names any."""
    keys = load_api_keys(config)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
