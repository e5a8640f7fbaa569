"""What one request's rows need beyond the model's logits, kept on its sequence between steps.

A sequence that asks for no per-row work has none (``seq.logits_state is None``) and costs nothing.
Everything here is rebuilt from the tokens so far, never carried across engines: the output-token
counts are brought up to date from ``seq.generated_token_ids`` when a step needs them (so a moved
stream's prior output counts, and preemption changes nothing), and the grammar's matcher accepts the
output tokens it has not seen (the first token of a request prefilled elsewhere, a moved stream's
output) before its mask is computed.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import GREEDY_EPS
from schemas.engine import SamplingParams
from services.engine.logits_processors.penalties import add_tokens
from services.engine.logits_processors.structured import GrammarSlot


def wants_logit_work(params: SamplingParams) -> bool:
    """Whether a request asks for anything of the chain."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
            or bool(params.logit_bias) or params.min_tokens > 0 or params.structured_output is not None)


class LogitsState:
    def __init__(self, seq, grammar: GrammarSlot | None = None):
        p: SamplingParams = seq.params
        self.repetition = p.repetition_penalty
        self.frequency = p.frequency_penalty
        self.presence = p.presence_penalty
        self.has_penalties = self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0
        self.bias_ids = self.bias_values = None  # [n] int64, [n] float32 (CPU)
        if p.logit_bias:
            self.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            self.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        self.min_tokens = p.min_tokens
        self.stop_token_ids = sorted(seq.stop_token_ids)  # what min_tokens holds back
        self.grammar = grammar
        self.wants_logprobs = p.logprobs is not None
        self.deferrable = p.temperature < GREEDY_EPS or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p == 0.0)
        """Argmax or temperature alone: the grammar's mask is needed only when the token drawn without it
        is one the grammar refuses (chain.py says why that is exact)."""
        self.error: str | None = None
        """Why this request cannot go on (its grammar failed): it fails alone at its next step."""
        self._context: tuple[np.ndarray, np.ndarray] | None = None  # penalties.add_tokens' (ids, counts)
        self._num_counted = 0

    def context(self, seq) -> tuple[np.ndarray, np.ndarray]:
        """The tokens penalties touch (sorted ids; with repetition_penalty the prompt's too, without a
        moved stream's prior output, which counts as output) and each one's count in the output so far."""
        if self._context is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens - seq.num_prior_output_tokens] \
                if self.repetition != 1.0 else []
            ids = np.unique(np.asarray(prompt, dtype=np.int64))
            self._context = ids, np.zeros(len(ids), dtype=np.float32)
        new = seq.generated_since(self._num_counted)
        if new:
            self._context = add_tokens(*self._context, new)
            self._num_counted += len(new)
        return self._context

    def matcher(self, seq, *, wait: bool = True):
        """The grammar's matcher, having accepted the whole output so far; None when the request has no
        grammar, it is still compiling (``wait=False``) or it failed (then ``error`` says why)."""
        slot = self.grammar
        if slot is None or self.error is not None or (not wait and not slot.is_ready):
            return None
        matcher = slot.resolve()
        if matcher is None:
            self.error = f"structured output: {slot.error}"
            return None
        for t in seq.generated_since(matcher.num_tokens):
            if not matcher.accept(t):
                self.error = f"structured output: token {t} does not fit the grammar ({matcher.error})"
                return None
        return matcher

    def accept(self, seq, token_ids: list[int]) -> None:
        """Sampled ``token_ids`` (not yet appended): the matcher takes them now, so a token the grammar
        cannot accept fails the request before it is streamed. Tokens after a stop token are dropped
        by the engine, so the matcher does not see them either."""
        matcher = self.grammar.matcher if self.grammar is not None and self.error is None else None
        if matcher is None:
            return
        for t in token_ids:
            if not matcher.accept(t):
                self.error = f"structured output: token {t} does not fit the grammar ({matcher.error})"
                return
            if t in seq.stop_token_ids:
                return

    def num_allowed_drafts(self, seq, token_ids: list[int]) -> int:
        """How many leading drafted tokens the grammar allows (all without a grammar; none while it
        compiles or after it failed)."""
        if self.grammar is None:
            return len(token_ids)
        matcher = self.matcher(seq, wait=False)
        return matcher.accept_drafts(token_ids) if matcher is not None else 0
