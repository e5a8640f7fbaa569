"""The agent fields of a GenerateRequest, at the gateway, for HTTP and NATS alike: checked, turned into
what a worker enforces (``sampling.structured_output``), and the parsers its reply goes through."""

from __future__ import annotations

import msgspec

from schemas.engine import InvalidSamplingParams, StructuredOutput
from schemas.generate import GenerateRequest
from services.agent import grammar
from services.agent.output import ReplyParser, forces_calls, reply_parser
from services.agent.tool_parsers import TOOL_PARSERS
from services.agent.tools import BadField, check_agent_fields
from services.gateway.config import GatewayConfig
from services.gateway.engine_features import refuse_unhonoured


def derived_constraint(req: GenerateRequest, tool_parser: str) -> tuple[StructuredOutput | None, str | None]:
    """(the constraint, the field it comes from) that ``response_format`` or ``tool_choice`` asks for.

    ``tool_choice`` ``required`` or a named function: the reply must be calls in the tool-call
    parser's format (its ``call_grammar``) whose arguments match each tool's schema."""
    choice, response_format = req.tool_choice, req.response_format
    calls_forced = forces_calls(req)
    if calls_forced and response_format is not None and response_format.type != "text":
        raise BadField("response_format", "response_format cannot be combined with tool_choice 'required' or a "
                                          "named function (both would constrain the reply)")
    try:
        if calls_forced:
            tools = req.tools if choice == "required" else \
                [t for t in req.tools if t.function.name == choice.function.name]
            parallel = req.parallel_tool_calls and choice == "required"
            spec = TOOL_PARSERS.get(tool_parser).call_grammar(tools, parallel=parallel)
            return StructuredOutput(kind="lark", spec=spec), "tool_choice"
        if response_format is None or response_format.type == "text":
            return None, None
        if response_format.type == "json_object":
            return StructuredOutput(kind="json_object"), "response_format"
        return grammar.json_schema_constraint(response_format.json_schema.schema), "response_format"
    except InvalidSamplingParams as exc:  # a spec too large
        raise BadField("tool_choice" if calls_forced else "response_format", str(exc)) from None


def prepare(req: GenerateRequest, config: GatewayConfig) -> GenerateRequest:
    """The request as the worker gets it; BadField (HTTP 400) naming the field for what cannot be served."""
    check_agent_fields(req)
    constraint, param = derived_constraint(req, config.tool_call_parser)
    if constraint is not None and req.sampling.structured_output is not None:
        raise BadField("sampling.structured_output", f"sampling.structured_output cannot be combined with {param}")
    if constraint is None and req.sampling.structured_output is not None:
        constraint, param = req.sampling.structured_output, "sampling.structured_output"
    if constraint is not None:
        try:
            grammar.check(constraint)
        except grammar.GrammarError as exc:
            raise BadField(param, f"{param}: {exc.message}") from None
        if constraint is not req.sampling.structured_output:
            req = msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling,
                                                                                structured_output=constraint))
    refuse_unhonoured(req.sampling, prefix="sampling.", names={"structured_output": param} if param else None)
    return req


def parser_for(req: GenerateRequest, config: GatewayConfig) -> ReplyParser | None:
    return reply_parser(req, tool_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
