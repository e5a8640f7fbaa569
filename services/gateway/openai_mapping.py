"""OpenAI bodies <-> kvbus messages, and bus errors -> OpenAI error bodies. Pure functions, no I/O."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from bus.errors import HTTP_STATUS, BusError, ErrorCode, PayloadTooLarge
from schemas.engine import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams, TokenLogprob, Usage
from schemas.generate import GenerateRequest
from services.gateway.openai_schemas import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    SpeculativeUsage,
    TopLogprob,
    UsageInfo,
)
from services.gateway.engine_features import refuse_osl, refuse_unhonoured
from services.gateway.pipeline import PromptTooLong, UnknownModel
from services.gateway.validation import BadField as BadParam
from services.gateway.validation import chat_messages, refuse_unsupported_chat_fields

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions (chat has none: until the context is full)."""


class BodyTooLarge(PayloadTooLarge):
    """The HTTP body is larger than max_request_bytes (HTTP 413)."""


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_body(body: bytes, type_: type) -> Any:
    """Parse a JSON body into ``type_``; malformed JSON or a wrong field type raises BadParam."""
    decoder = _decoders.get(type_) or _decoders.setdefault(type_, msgspec.json.Decoder(type_))
    if not body.strip():
        raise BadParam(None, "the request body is empty; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        path = re.search(r"at `\$\.([A-Za-z_]+)", str(exc))
        unknown = re.match(r"Object contains unknown field `([^`]*)`", str(exc))
        if unknown:  # OpenAI's wording for a field it does not know
            param = f"{path.group(1)}.{unknown.group(1)}" if path else unknown.group(1)
            raise BadParam(param, f"Unrecognized request argument supplied: {param}") from None
        # the whole path names the field: tools[0].function.name for a tool without a name
        where = re.search(r"at `\$\.([^`]+)`", str(exc))
        missing = re.match(r"Object missing required field `([^`]*)`", str(exc))
        param = where.group(1) if where else None
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise BadParam(param, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadParam(None, f"malformed JSON body: {exc}") from None


# --- requests ---------------------------------------------------------------------------------


def completion_to_generate(req: CompletionRequest) -> GenerateRequest:
    _refuse_unsupported(req)
    if req.echo:
        raise BadParam("echo", "echo is not supported")
    if req.suffix:
        raise BadParam("suffix", "suffix is not supported")
    if req.best_of not in (None, 1):
        raise BadParam("best_of", f"best_of must be 1: kvbus returns one choice per request (got {req.best_of})")
    prompt, prompt_token_ids = _completion_prompt(req.prompt)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return GenerateRequest(prompt=prompt, prompt_token_ids=prompt_token_ids, model=req.model,
                           sampling=_sampling(req, max_tokens, req.logprobs), session_id=req.session_id,
                           stream_interval=req.stream_interval)


def chat_to_generate(req: ChatCompletionRequest) -> GenerateRequest:
    """The chat request as the NATS generate subject takes it; the agent fields (tools, tool_choice,
    response_format, ...) travel as they are and are checked by the pipeline, for NATS callers too."""
    _refuse_unsupported(req)
    refuse_unsupported_chat_fields(req)
    messages = chat_messages(req.messages or [])
    if req.top_logprobs is not None and not req.logprobs:
        raise BadParam("top_logprobs", "top_logprobs needs logprobs: true")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise BadParam("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return GenerateRequest(messages=messages, model=req.model, sampling=_sampling(req, max_tokens, logprobs),
                           session_id=req.session_id, stream_interval=req.stream_interval,
                           tools=req.tools, tool_choice=req.tool_choice,
                           parallel_tool_calls=req.parallel_tool_calls is not False,
                           response_format=req.response_format, chat_template_kwargs=req.chat_template_kwargs)


MAX_SESSION_ID_CHARS = 256


def with_session(gen: GenerateRequest, header: str | None, user: str | None) -> GenerateRequest:
    """The conversation the router keeps on one worker: the body's ``session_id``, else the
    ``X-Session-ID`` header, else ``user`` (the OpenAI field; the caller passes it only with
    ``--session-from-user``). A blank header or an id past 256 characters is refused, naming it."""
    if gen.session_id is not None:
        return gen
    for param, value in (("X-Session-ID", header), ("user", user)):
        if value is None or (param == "user" and not value.strip()):
            continue
        if not value.strip():
            raise BadParam(param, f"{param} must not be blank")
        if len(value) > MAX_SESSION_ID_CHARS:
            raise BadParam(param, f"{param} is longer than {MAX_SESSION_ID_CHARS} characters")
        return msgspec.structs.replace(gen, session_id=value)
    return gen


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    hints = req.nvext.agent_hints if req.nvext is not None else None
    if hints is not None:
        if hints.strict_priority is not None:
            raise BadParam("nvext.agent_hints.strict_priority", "nvext.agent_hints.strict_priority is not supported")
        if hints.speculative_prefill:
            raise BadParam("nvext.agent_hints.speculative_prefill",
                           "nvext.agent_hints.speculative_prefill is not supported")
        refuse_osl(hints.osl, "nvext.agent_hints.osl")
        if hints.priority is not None and req.priority:
            raise BadParam("nvext.agent_hints.priority", "give one of priority and nvext.agent_hints.priority")
    if req.stream_options is not None and not req.stream:
        raise BadParam("stream_options", "stream_options is only allowed when stream is true")
    if req.stream_interval < 1:
        raise BadParam("stream_interval", f"stream_interval must be >= 1, got {req.stream_interval}")


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    hinted = req.nvext is not None and req.nvext.agent_hints is not None and req.nvext.agent_hints.priority is not None
    # Dynamo's priority: higher goes first; kvbus's (vLLM's): lower goes first
    priority = -req.nvext.agent_hints.priority if hinted else req.priority
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens, priority=priority, n=req.n,
        )
    except InvalidSamplingParams as exc:
        message = str(exc)  # "<field> must ...": the field is the param
        param = message.split(" ", 1)[0] if " must " in message else None
        raise BadParam("nvext.agent_hints.priority" if hinted and param == "priority" else param, message) from None
    refuse_unhonoured(sampling, names={"priority": "nvext.agent_hints.priority"} if hinted else None)
    return sampling


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's keys are token ids as strings."""
    if not logit_bias:
        return None
    if not all(k.isdigit() for k in logit_bias):
        bad = next(k for k in logit_bias if not k.isdigit())
        raise BadParam("logit_bias", f"logit_bias keys must be token ids, got {bad!r}")
    return {int(k): v for k, v in logit_bias.items()}


def _completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids): one of them set, from the four shapes OpenAI allows."""
    if prompt is None:
        raise BadParam("prompt", "prompt is required")
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise BadParam("prompt", "prompt must not be empty")
    if all(_is_int(t) for t in prompt):
        return None, list(prompt)
    if not all(isinstance(t, (str, list)) for t in prompt):
        raise BadParam("prompt", "prompt must be a string, a list of token ids, or a list holding one of those")
    if len(prompt) > 1:
        raise BadParam("prompt", f"batched prompts are not supported (got {len(prompt)}); send one per request")
    only = prompt[0]
    if isinstance(only, str):
        return only, None
    if isinstance(only, list) and only and all(_is_int(t) for t in only):
        return None, list(only)
    raise BadParam("prompt", "prompt must be a string, a list of token ids, or a list holding one of those")


def _is_int(value: Any) -> bool:
    return type(value) is int


# --- responses --------------------------------------------------------------------------------


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.prompt_tokens + usage.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
                     kvbus_speculative=SpeculativeUsage(
                         draft_tokens=usage.draft_tokens, accepted_draft_tokens=usage.accepted_draft_tokens,
                         mean_accepted_length=usage.mean_accepted_length,
                     ) if usage.draft_tokens else None)


def completion_logprobs(logprobs: list[TokenLogprob], texts: dict[int, str], offset: int = 0) -> CompletionLogprobs:
    """The legacy completions shape; ``offset`` is where this piece starts in the completion text."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(texts[lp.token_id])
        offset += len(texts[lp.token_id])
    tops = [{texts[t]: v for t, v in zip(lp.top_token_ids, lp.top_logprobs)} for lp in logprobs]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs],
                              top_logprobs=tops, text_offset=offsets)


def chat_logprobs(logprobs: list[TokenLogprob], texts: dict[int, str]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = texts[token_id]
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=texts[lp.token_id], logprob=lp.logprob, bytes=list(texts[lp.token_id].encode("utf-8")),
                         top_logprobs=[top(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)])
        for lp in logprobs
    ])


def logprob_token_ids(logprobs: list[TokenLogprob]) -> list[int]:
    """Every token id a logprobs list names (chosen and alternatives)."""
    return [i for lp in logprobs for i in (lp.token_id, *lp.top_token_ids)]


# --- errors -------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_response(exc: BaseException) -> tuple[int, ErrorResponse]:
    """(HTTP status, OpenAI error body) for any exception; unknown ones become a bare 500."""
    if not isinstance(exc, BusError):
        return 500, ErrorResponse(error=ErrorDetail(message="internal server error", type="server_error",
                                                    code=ErrorCode.INTERNAL.value))
    status = 413 if isinstance(exc, PayloadTooLarge) else HTTP_STATUS[exc.code]
    code, param = exc.code.value, getattr(exc, "param", None)
    if isinstance(exc, PromptTooLong):
        code = "context_length_exceeded"
    elif isinstance(exc, UnknownModel):
        code, param = "model_not_found", "model"
    elif isinstance(exc, PayloadTooLarge):
        code = "request_too_large"
    return status, ErrorResponse(error=ErrorDetail(message=exc.message, type=_ERROR_TYPES.get(status, "server_error"),
                                                   param=param, code=code))
