"""The gateway: public generate subjects on NATS and the OpenAI-compatible HTTP API.

``config`` (GatewayConfig), ``pipeline`` (tokenize -> route -> stream from a
worker), ``openai_schemas`` / ``openai_mapping`` (HTTP bodies <-> kvbus
messages), ``http`` (the FastAPI app), ``metrics`` (Prometheus), ``actor``.
"""

from services.gateway.actor import GatewayActor
from services.gateway.config import GatewayConfig

__all__ = ["GatewayActor", "GatewayConfig"]
