"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time

from schemas.engine import FinishReason, SamplingParams, Usage


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, holds its pages, waits for a lower tier's copies (not computed)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, pages and progress of one request.

    ``token_ids`` is the prompt followed by every generated token. The KV of
    the first ``num_computed_tokens`` of them is in the pages ``page_ids``;
    the rest still has to go through the model (the whole prompt before the
    first step, one token while decoding, everything again after a
    preemption). ``page_hashes`` caches the chained hash of every full page.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int,
    ):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # A moved stream's prompt ends with what it generated before (SamplingParams.num_prior_output_tokens)
        self.num_prior_output_tokens = params.num_prior_output_tokens
        self.logits_state = None  # logits_processors.LogitsState when it asks for per-row logit work
        self.status = SequenceStatus.WAITING
        self.page_ids: list[int] = []
        self.page_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.num_indexed_pages = 0
        self.num_cached_tokens = 0
        self.num_loaded_tokens = 0  # of the cached prefix at first admission: loaded from a lower tier
        self.num_preemptions = 0
        self.loading_ticket = None  # a lower-tier load into its pages in flight (block_manager.py)
        self.held_pages: list[tuple[int, int | None]] = []  # (page id, hash) it holds while waiting (held_pages.py)
        self.is_admitted_once = False
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        limit = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.detok = None  # an IncrementalDetokenizer when text is produced
        # Disaggregation: a prefill-only request exports its prompt's pages when it
        # samples its first token; an imported one arrives with those pages.
        self.is_prefill_only = False
        self.imported_kv = None  # [pages, layers, 2, page_size, Hkv, D] until written
        self.awaiting_kv = False  # imported, first token streamed, pages not here yet (LLMEngine.import_kv)
        self.import_from_page = 0
        # Leading pages the other side of a transfer holds: an imported sequence's kv starts
        # here; a prefill-only one exports from here.
        self.imported_first_page = 0
        # Speculative decoding (services/engine/spec_decode.py): the drafted tokens for the
        # positions after the last token, what the drafter drew them from (None: q = 1 on
        # each), and the per-sequence state of adaptive k.
        self.draft_tokens: list[int] = []
        self.draft_probs = None
        self.spec_acceptance = -1.0  # moving average; < 0 until the first verification
        self.spec_idle_steps = 0
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0
        self.draft_seconds = 0.0  # drafting time of the steps that drafted for this sequence

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, pages={len(self.page_ids)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens of the whole request: this engine's and those it came with (a seeded draw's step)."""
        return self.num_output_tokens + self.num_prior_output_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """The whole request's output: the prompt's prior output tokens, then this engine's."""
        return self.generated_since(0)

    def generated_since(self, num_seen: int) -> list[int]:
        """The request's output tokens after its first ``num_seen`` (without copying the rest)."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_output_tokens + num_seen :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is missing from the cache."""
        return self.num_computed_tokens == len(self.token_ids) - 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_reason(self, token: int) -> FinishReason | None:
        """Why this sequence stops after its newly appended ``token``, if it does."""
        if token in self.stop_token_ids:
            return "stop"
        if self.detok is not None and self.detok.add(token):
            return "stop"
        if self.num_output_tokens >= self.max_output_tokens:
            return "length"
        return None

    def usage(self) -> Usage:
        """What this request consumed, as its final output reports it."""
        host = min(self.num_loaded_tokens, self.num_cached_tokens)
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            cached_prompt_tokens=self.num_cached_tokens,
            completion_tokens=self.num_output_tokens,
            draft_tokens=self.num_drafted_tokens,
            accepted_draft_tokens=self.num_accepted_tokens,
            mean_accepted_length=(
                (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps if self.num_spec_steps else 0.0
            ),
            draft_seconds=round(self.draft_seconds, 6),
            cached_tokens_device=self.num_cached_tokens - host,
            cached_tokens_host=host,
        )
