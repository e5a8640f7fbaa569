"""The gateway's configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import dataclasses

from services.agent.tool_parsers import DEFAULT_TOOL_PARSER
from services.config import ConfigError, check_choices, plugin


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    model_name: str | None = None
    """Model name to advertise (/v1/models) and accept in requests; None: the tokenizer's model name."""
    enable_http: bool = True
    """Serve the OpenAI-compatible HTTP API beside the NATS subjects."""
    http_host: str = "127.0.0.1"
    """Address the HTTP API listens on (0.0.0.0 for every interface)."""
    http_port: int = 8000
    """HTTP port; 0 picks a free one (logged, and in the health detail)."""
    generate_timeout: float = 600.0
    """Most seconds one generation may take end to end; past it the caller gets timeout (HTTP 504)."""
    stream_stall_timeout: float = 120.0
    """Most seconds to wait for the next chunk from a worker, the first included (queueing + prefill)."""
    call_timeout: float = 10.0
    """Seconds to wait for the tokenizer and the router to answer one call."""
    max_concurrent_requests: int = 256
    """Generations in flight at once, NATS and HTTP together; past it callers get overloaded (HTTP 429)."""
    max_model_len: int | None = None
    """Longest prompt plus output accepted; None: the tokenizer's context length."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest HTTP request body; larger gets HTTP 413."""
    api_key: tuple[str, ...] = ()
    """HTTP API keys: /v1/* needs ``Authorization: Bearer KEY`` with one of them (401 otherwise); none: open."""
    api_key_file: str | None = None
    """File of HTTP API keys, one per line (blank lines and # comments skipped), added to api_key."""
    worker_ttl: float = 3.0
    """Seconds without a heartbeat after which a worker streaming to us is taken for dead (its requests migrate)."""
    max_migrations: int = 3
    """Times one request may move to another worker after its worker died; past it the caller gets unavailable."""
    tool_call_parser: str = plugin("services.agent.tool_parsers:TOOL_PARSERS", DEFAULT_TOOL_PARSER)
    """How the model writes tool calls (docs/agents.md): hermes (<tool_call>{json}</tool_call>; also the
    fallback prompt's format for templates without tools) or llama3_json."""
    reasoning_parser: str | None = plugin("services.agent.reasoning:REASONING_PARSERS", None)
    """Split <think>...</think> out of chat replies into reasoning_content: deepseek_r1 or qwen3; none: off."""
    session_from_user: bool = False
    """Take the OpenAI ``user`` field as the conversation id (the router keeps a session on its worker) when the
    request names none (body ``session_id`` or ``X-Session-ID`` header)."""

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"GatewayConfig.http_port must be in [0, 65535], got {self.http_port}")
        for name in ("generate_timeout", "stream_stall_timeout", "call_timeout", "worker_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"GatewayConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"GatewayConfig.max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.max_migrations < 0:
            raise ConfigError(f"GatewayConfig.max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"GatewayConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"GatewayConfig.max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if any(not k or k != k.strip() for k in self.api_key):
            raise ConfigError("GatewayConfig.api_key: keys must be non-empty, without surrounding spaces")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("GatewayConfig.model_name must not be blank")
        check_choices(self)  # the parsers: their registries
