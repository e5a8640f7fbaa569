"""Per-step sampling: gather each row's parameters into tensors, call the kernels.

The sampler sees rows, not requests: each row's SamplingParams and its output index (the step a
seeded request draws for). Whatever changes logits from a request's history (penalties, grammar
masks, logit_bias) runs before it, on the model runner's logits (model_runner.py).
"""

from __future__ import annotations

import logging

import torch

from kernels import compute_logprobs, sample
from schemas.engine import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], steps: list[int], raw: torch.Tensor | None = None
) -> tuple[list[int | None], list[TokenLogprob | None], dict[int, str]]:
    """One token per row of ``logits`` [N, V] float32, drawn with ``params[i]``; ``steps[i]``: the
    row's output index (a seeded request draws the same token at the same step, batched or not);
    ``raw``: the rows before the logits-processor chain, which logprobs describe (None: ``logits``).

    Returns (token ids, logprobs, errors): when the batch cannot be sampled, each row is
    sampled alone and a row that still fails gets None and its reason in ``errors`` (by row),
    so one request the sampler cannot serve fails alone and the rest of the batch goes on.
    """
    raw = logits if raw is None else raw
    try:
        ids, lps = _sample_tokens(logits, params, steps, raw)
        return ids, lps, {}
    except Exception:
        if len(params) == 1:
            log.exception("sampling failed for %s", params[0])
            return [None], [None], {0: "the sampler failed for this request's parameters"}
    log.warning("sampling a batch of %d failed; sampling its rows one by one", len(params), exc_info=True)
    ids, lps, errors = [], [], {}
    for i in range(len(params)):
        row_ids, row_lps, row_errors = sample_tokens(logits[i : i + 1], params[i : i + 1], steps[i : i + 1],
                                                     raw[i : i + 1])
        ids += row_ids
        lps += row_lps
        if row_errors:
            errors[i] = row_errors[0]
    return ids, lps, errors


def _sample_tokens(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                   raw: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
    want_logprobs = [p.logprobs for p in params]
    if all(p.temperature == 0.0 for p in params):
        ids = logits.argmax(dim=-1)  # greedy fast path: no parameter tensors
    else:
        ids = _sample(logits, params, steps)
    id_list = ids.tolist()
    if all(n is None for n in want_logprobs):
        return id_list, [None] * len(params)
    top_n = max(n for n in want_logprobs if n is not None)
    chosen, top_ids, top_lps = compute_logprobs(raw, ids, top_n)
    chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    out: list[TokenLogprob | None] = []
    for i, n in enumerate(want_logprobs):
        if n is None:
            out.append(None)
        else:
            out.append(TokenLogprob(
                token_id=id_list[i], logprob=chosen[i], top_token_ids=top_ids[i][:n], top_logprobs=top_lps[i][:n]
            ))
    return id_list, out


def _sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature > 0]
    if seeded and len(params) > 1:
        # NOTE: the CPU reference picks its sampling path (sorted candidates or the full
        # vocabulary) per batch, so a seeded row could draw a different token batched than
        # alone. Seeded rows are drawn one by one, which makes them batch-invariant.
        ids = _sample_rows(logits, params, steps) if len(seeded) < len(params) else None
        out = ids if ids is not None else torch.empty(len(params), dtype=torch.int64, device=logits.device)
        for i in seeded:
            out[i] = _sample_rows(logits[i : i + 1], params[i : i + 1], steps[i : i + 1])[0]
        return out
    return _sample_rows(logits, params, steps)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    device = logits.device
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return sample(
        logits,
        torch.tensor([p.temperature for p in params], **f32),
        # top_k >= V is off; clamping keeps any bound SamplingParams allows inside int32
        torch.tensor([min(p.top_k, logits.shape[1]) for p in params], dtype=torch.int32, device=device),
        torch.tensor([p.top_p for p in params], **f32),
        torch.tensor([p.min_p for p in params], **f32),
        torch.tensor([-1 if p.seed is None else p.seed for p in params], **i64),
        # the step number: a seeded request draws the same token at the same step, batched or not
        torch.tensor(steps, **i64),
    )
