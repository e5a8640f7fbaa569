"""Penalties, sparse and vectorised: only the tokens of a row's context change, so a step gathers
those logits (one gather for every penalised row), penalises them in one tensor expression and
scatters them back; the work is the rows' context sizes, not rows x vocabulary.

Semantics (the tests hold them to these references):

* ``repetition_penalty`` (HF's RepetitionPenaltyLogitsProcessor, vLLM's): the logit of every token
  in the prompt or the output so far is divided by the penalty when positive, multiplied when not;
* ``frequency_penalty`` and ``presence_penalty`` (OpenAI's): ``logit -= frequency * count +
  presence * (count > 0)``, counts over the output tokens only.

Repetition first, then frequency and presence (vLLM's order); all on the raw logits, before
``logit_bias``, the grammar's masks, temperature and the filters.

A row's context is a sorted array of token ids and, aligned, each one's count in the output (0 for
a prompt token the output has not repeated): :func:`add_tokens` extends it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def add_tokens(ids: np.ndarray, counts: np.ndarray, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The context ``(ids, counts)`` after ``token_ids`` more output tokens (new arrays when a token
    is new to it, else ``counts`` changed in place)."""
    new_ids, new_counts = np.unique(np.asarray(token_ids, dtype=np.int64), return_counts=True)
    pos = np.searchsorted(ids, new_ids)
    if len(ids) and (pos < len(ids)).all() and (ids[np.minimum(pos, len(ids) - 1)] == new_ids).all():
        counts[pos] += new_counts  # only tokens it holds: the usual case
        return ids, counts
    merged = np.union1d(ids, new_ids)
    out = np.zeros(len(merged), dtype=np.float32)
    out[np.searchsorted(merged, ids)] = counts
    out[np.searchsorted(merged, new_ids)] += new_counts
    return merged, out


def apply_penalties(logits: torch.Tensor, rows: np.ndarray, ids: np.ndarray, counts: np.ndarray,
                    repetition: np.ndarray | None, frequency: np.ndarray, presence: np.ndarray) -> None:
    """Penalise ``logits`` [N, V] in place at the pairs (``rows[i]``, ``ids[i]``), each a token of that
    row's context with its output count ``counts[i]``; ``repetition`` (None: every row's is 1),
    ``frequency`` and ``presence`` per pair. Pairs are unique."""
    if not len(rows):
        return
    dev = logits.device
    flat_logits = logits.view(-1)  # NOTE: flat indexes: on CPU a 2-D gather takes the slow path (~30x)
    flat = torch.from_numpy(rows * logits.shape[1] + ids).to(dev)
    c = torch.from_numpy(counts).to(dev, logits.dtype)
    x = flat_logits.index_select(0, flat)
    if repetition is not None:
        rep = torch.from_numpy(repetition).to(dev, logits.dtype)
        x = torch.where(x > 0, x / rep, x * rep)
    x = x - torch.from_numpy(frequency).to(dev, logits.dtype) * c \
        - torch.from_numpy(presence).to(dev, logits.dtype) * (c > 0).to(logits.dtype)
    flat_logits.index_copy_(0, flat, x)
