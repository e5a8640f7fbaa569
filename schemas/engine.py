"""Messages at the engine boundary: how to sample, and what comes back.

These travel from the gateway through the router to prefill/decode workers,
so they are msgspec Structs; the in-process engine uses them directly.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]

MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1
"""top_k travels to the sampler as int32; any k >= the vocabulary size means off anyway."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1
_INT64_MAX = 2**63 - 1
MAX_LOGIT_BIAS_ENTRIES = 300
"""OpenAI's bound on logit_bias."""
MAX_PRIORITY = 2**31 - 1
MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for."""
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "lark")
"""What a StructuredOutput's ``spec`` holds: JSON Schema text, nothing (any JSON object), a regular
expression, or a Lark grammar as llguidance reads it (JSON Schemas may be embedded with ``%json``)."""
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range (maps to ``invalid_argument``)."""


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the output must match, as source text: a worker compiles it (services/agent/grammar.py), and
    a worker that takes over a migrated request compiles it again and replays the tokens so far."""

    kind: str
    """One of STRUCTURED_OUTPUT_KINDS."""
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_OUTPUT_KINDS,
               f"structured_output.kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {self.kind!r}")
        _check(len(self.spec) <= MAX_STRUCTURED_SPEC_CHARS,
               f"structured_output.spec must be at most {MAX_STRUCTURED_SPEC_CHARS} characters, got {len(self.spec)}")
        _check(bool(self.spec) or self.kind == "json_object", f"structured_output.spec must not be empty for "
                                                              f"kind {self.kind!r}")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request decoding controls (OpenAI / vLLM meanings).

    Every bound is checked here, so a request the sampler cannot serve is refused when it is
    decoded (or built), never in the middle of a batched step (docs/reliability.md, "Bad input").
    """

    max_tokens: int | None = None
    """Most tokens to generate; None: until the context length."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 is off."""
    min_p: float = 0.0
    """Drop tokens below min_p times the top probability; 0 is off."""
    seed: int | None = None
    """Makes sampling reproducible token by token for this request."""
    stop: tuple[str, ...] = ()
    """Stop strings; the text is cut before the first match."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept in the token ids, not in the text)."""
    ignore_eos: bool = False
    """Keep going past the model's end-of-sequence tokens."""
    logprobs: int | None = None
    """Return the chosen token's logprob and the top-n alternatives (0..20)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""
    # --- per-row logit work (issue 28's engine half): the gateway refuses these until a worker honours
    # them (services/gateway/engine_features.py); the bounds hold from now on
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated, in [-2, 2] (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated, in [-2, 2] (OpenAI)."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in the prompt or output (> 0; 1 is off)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit, in [-100, 100] (-100 bans it)."""
    min_tokens: int = 0
    """No end-of-sequence token or stop token id before this many tokens."""
    structured_output: StructuredOutput | None = None
    """Constrained decoding: every token must keep the output a prefix of the grammar's language."""
    priority: int = 0
    """Scheduling priority among waiting requests: lower goes first (vLLM's meaning)."""
    num_prior_output_tokens: int = 0
    """The prompt's last this many tokens are output this request generated before (the gateway sets it
    when it moves a stream to another worker): output-token penalties, the grammar and seeded draws
    continue from them; ``max_tokens`` and ``min_tokens`` count what is generated from here on."""
    n: int = 1
    """Choices to generate for the prompt, 1..16: the gateway runs one sequence per choice, choice i
    seeded with ``seed + i`` (docs/agents.md); an engine or worker takes 1."""

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or 1 <= self.max_tokens <= _INT64_MAX,
               f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1, 0 (off) or positive up to {MAX_TOP_K}, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.seed is None or 0 <= self.seed <= _INT64_MAX,
            f"seed must be in [0, 2**63), got {self.seed}",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"stop must hold at most {MAX_STOP_STRINGS} strings, "
               f"got {len(self.stop)}")
        _check(all(self.stop), "stop strings must be non-empty")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        _check(all(0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
               f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
                   f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
            _check(all(0 <= t <= MAX_TOKEN_ID for t in self.logit_bias),
                   f"logit_bias token ids must be in [0, {MAX_TOKEN_ID}]")
            _check(all(math.isfinite(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                   "logit_bias values must be in [-100, 100]")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        _check(-MAX_PRIORITY - 1 <= self.priority <= MAX_PRIORITY,
               f"priority must be a 32-bit integer, got {self.priority}")
        _check(0 <= self.num_prior_output_tokens <= _INT64_MAX,
               f"num_prior_output_tokens must be >= 0, got {self.num_prior_output_tokens}")
        _check(1 <= self.n <= MAX_CHOICES, f"n must be in [1, {MAX_CHOICES}], got {self.n}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(message)


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Logprob of one generated token and of the top-n alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens not computed: hits in any cache tier (the sum of the two fields below)."""
    completion_tokens: int
    # speculative decoding (zero when it is off)
    draft_tokens: int = 0
    """Tokens the drafter proposed and the target verified."""
    accepted_draft_tokens: int = 0
    """Of those, the ones the target accepted."""
    mean_accepted_length: float = 0.0
    """Tokens appended per verification step (accepted drafts + the target's own), 0 without one."""
    cached_tokens_device: int = 0
    """Of cached_prompt_tokens: hits in the engine's own KV pool (L1)."""
    cached_tokens_host: int = 0
    """Of cached_prompt_tokens: pages loaded back from the host tier (L2, including pages the kv_store
    promoted from disk, L3, for this request)."""
    draft_seconds: float = 0.0
    """Seconds this request's decode steps waited for drafts (a remote round trip included; a step's
    drafting counts whole for every request it drafted for), 0 without speculation."""


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine step produced for one request (a streaming delta).

    ``new_token_ids``/``new_text`` hold only what is new since the previous
    output of this request; the final output has ``finished`` set.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    """Set, with finish_reason ``abort``, when the engine failed this request alone (the batch went on)."""
