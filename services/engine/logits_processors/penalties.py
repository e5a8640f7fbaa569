"""Penalties on a block of rows, vectorised: each kind is one tensor expression over all its rows.

Semantics (the tests hold them to these references):

* ``repetition_penalty`` (HF's RepetitionPenaltyLogitsProcessor, vLLM's): the logit of every token
  in the prompt or the output so far is divided by the penalty when positive, multiplied when not;
* ``frequency_penalty`` and ``presence_penalty`` (OpenAI's): ``logit -= frequency * count +
  presence * (count > 0)``, counts over the output tokens only.

Repetition first, then frequency and presence (vLLM's order); all on the raw logits, before
``logit_bias``, the grammar's masks, temperature and the filters.
"""

from __future__ import annotations

import torch


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """x: [R, V] logits; counts: [R, V] float32, each row's output token counts; prompt_mask: [R, V]
    bool (tokens in the prompt) or None; repetition, frequency, presence: [R] (repetition None when
    every row's is 1). Returns the penalised rows (a new tensor)."""
    seen = counts > 0
    if repetition is not None:
        in_context = seen if prompt_mask is None else seen | prompt_mask
        factor = torch.where(in_context, repetition.unsqueeze(1), 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    return x - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * seen.to(x.dtype)
