"""What the engine hands back besides streamed RequestOutputs, and its request error."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from schemas.engine import FinishReason, TokenLogprob, Usage


class RequestError(ValueError):
    """A request the engine cannot serve (maps to ``invalid_argument``)."""


@dataclass
class Completion:
    """A finished request, for the run-to-completion helper :meth:`LLMEngine.generate_sync`."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None


@dataclass
class PrefillResult:
    """A prefill-only request's product, for disaggregation (see :meth:`LLMEngine.prefill`)."""

    first_token_id: int
    kv: torch.Tensor  # [pages, layers, 2, page_size, Hkv, D] in the KV cache dtype, pool device
    kv_scales: list[float]  # fp8 caches: [k_scale, v_scale]; else empty
    num_cached_tokens: int
    first_logprob: TokenLogprob | None = None


@dataclass
class EngineStats:
    num_steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_cached_device_tokens: int = 0  # of those, L1 hits (counted apart so each is monotonic: Prometheus)
    num_cached_host_tokens: int = 0  # and loaded back from a lower tier (HiCache L2/L3)
    # speculative decoding
    num_spec_steps: int = 0  # sequence-steps that verified drafts
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_seconds: float = 0.0  # in the drafter (in-process drafting), inside step_seconds
    accepted_length_counts: dict[int, int] = field(default_factory=dict)  # accepted drafts -> sequence-steps

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, input
        building, sampling, detokenization, outputs)."""
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0
