"""Request parameters that need issue 28's engine half, and whether the workers honour them yet.

Until a worker applies a parameter, the gateway refuses it with a 400 that names it, on HTTP and NATS
alike, rather than let a worker ignore it silently. Each is turned on by setting its line below to
True once the engine (or the router, for ``osl``) honours it; nothing else in the gateway changes:
the mapping already puts every value where the worker reads it (docs/agents.md, "Status").
"""

from __future__ import annotations

from schemas.engine import SamplingParams
from services.agent.tools import BadField

HONOURED = {
    "presence_penalty": True,  # SamplingParams.presence_penalty: the logits-processor chain
    "frequency_penalty": True,  # SamplingParams.frequency_penalty: the logits-processor chain
    "repetition_penalty": True,  # SamplingParams.repetition_penalty: the logits-processor chain
    "logit_bias": True,  # SamplingParams.logit_bias: the logits-processor chain
    "min_tokens": True,  # SamplingParams.min_tokens: the logits-processor chain (EOS/stop ids masked)
    "structured_output": True,  # SamplingParams.structured_output: grammar masks (services/engine/logits_processors)
    "priority": True,  # SamplingParams.priority: the scheduler's waiting queue
    # NOTE: the router's decode load (services/router/scoring.decode_load: the KV tokens a worker holds plus
    # those routed to it since its last heartbeat) could count a request's expected output, but no router
    # code reads a RouteRequest field for it yet: a router change, not the engine's
    "osl": False,  # nvext.agent_hints.osl: the router's load estimate
}
"""What the workers honour: flip one to True when the engine half lands it."""

_DEFAULTS = SamplingParams()


def refuse_unhonoured(sampling: SamplingParams, *, prefix: str = "", names: dict[str, str] | None = None) -> None:
    """BadField for the first parameter set away from its default that the workers do not honour yet.

    ``prefix`` goes in front of the field (``sampling.`` on NATS); ``names`` maps a field to what the
    caller called it (``response_format`` for structured_output on HTTP)."""
    for field, honoured in HONOURED.items():
        if honoured or not hasattr(sampling, field) or getattr(sampling, field) == getattr(_DEFAULTS, field):
            continue
        param = (names or {}).get(field) or prefix + field
        raise BadField(param, f"{param} is not supported yet: the engine does not apply it "
                              "(docs/agents.md lists what is honoured)")


def refuse_osl(osl: int | None, param: str) -> None:
    if osl is not None and not HONOURED["osl"]:
        raise BadField(param, f"{param} is not supported yet: the router does not use it")
