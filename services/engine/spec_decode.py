"""Speculative decoding on the engine side: verifying drafted tokens and choosing k.

Verification (docs/speculative.md). A decoding sequence with drafts d_1..d_k runs
k + 1 rows in one forward pass (its last token and the drafts, as decode rows that
share its block table), so row j holds the target's distribution p_j for the token
after d_j (d_0 = the last token). Then:

* greedy: accept the longest prefix with d_{j+1} == argmax p_j, plus the target's
  own token at the first mismatch (or after the last draft): output identical to
  plain decoding;
* sampling: accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); on rejection
  draw from normalize(max(0, p_j - q_j)) and stop; when all k are accepted draw a
  bonus token from p_k. q is the drafter's distribution (one-hot on the proposed
  token when the drafter sends none: n-gram lookup, greedy drafting). Every accepted
  or resampled token is distributed as p: lossless. p is the plain sampler's
  distribution (temperature, top-k, top-p, min-p: ``kernels.filter_logits``).

Seeded requests draw every uniform from a generator seeded with
``mix_seed(seed ^ salt, output index)``, so a request is reproducible whatever it
is batched with and whatever the drafter proposed at other positions.

Adaptive k (:func:`choose_k`): the j-th draft of a step pays off with probability
a^j (a: the sequence's moving-average acceptance rate) and costs one verification
row plus the drafter's time per token; k is the largest count whose last draft is
still worth its cost, at most ``num_speculative_tokens``. Across a step's sequences,
:func:`budget_drafts` keeps the drafts whose rows raise the step's expected tokens per second
(:class:`RowCost`), within ``SPEC_MAX_ROWS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import filter_logits, mix_seed
from kernels.sampling import GREEDY_EPS
from schemas.engine import SamplingParams

ROW_COST = 0.05
"""Cost of one verification row as a share of a one-row decode step, below the compute knee (see
:class:`RowCost`): what a sequence's own k is chosen against. Measured on the 2-core dev VM
(SmolLM2-135M fp32, one sequence): 1 row 25.0 ms, 3 rows 28.6, 5 rows 29.9: the packed kernel reads
the weights once whatever the row count, so a row costs 4-7% of a step."""

SPEC_MAX_ROWS = 48
"""Most decode rows (plain rows + drafts) of a step with drafts: linear.NATIVE_MAX_ROWS, so
verification stays in the packed kernel (a row's result does not depend on the rows beside it:
greedy output stays that of plain decoding). Within it :func:`budget_drafts` decides."""

EMA_WEIGHT = 0.3
"""Weight of the newest step's acceptance rate in the moving average."""

INITIAL_ACCEPTANCE = 0.6
"""Acceptance rate assumed for a sequence that has not speculated yet."""

PROBE_INTERVAL = 8
"""A sequence whose k dropped to 0 still drafts one token every this many steps to re-measure."""

_ACCEPT_SALT = 0x5EC0_0001
_RESIDUAL_SALT = 0x5EC0_0002


def choose_k(acceptance: float, max_k: int, cost_per_token: float) -> int:
    """Largest k <= max_k with acceptance**k >= ROW_COST + cost_per_token (0 when even one draft does not pay)."""
    cost = ROW_COST + cost_per_token
    k = 0
    gain = 1.0
    while k < max_k:
        gain *= acceptance
        if gain < cost:
            break
        k += 1
    return k


@dataclass(frozen=True)
class RowCost:
    """Time of a decode step's projections by its row count: reading the weights (``memory_s``,
    once whatever the rows) or computing them (``row_s`` a row), whichever is longer. Measured
    per engine (``LlamaModel.projection_seconds``): on the 2-core dev VM, SmolLM2-135M fp32,
    ~19 ms to read, ~1.7 ms a row, so about 11 rows are free and every row past them costs."""

    memory_s: float
    row_s: float

    def seconds(self, rows: int) -> float:
        return max(self.memory_s, rows * self.row_s)

    @classmethod
    def measure(cls, projection_seconds, rows: int = 32) -> RowCost:
        """From ``projection_seconds(rows)``, the time of one pass over every projection."""
        one, many = projection_seconds(1), projection_seconds(rows)
        return cls(memory_s=one, row_s=many / rows)


def budget_drafts(
    rates: list[float], lengths: list[int], plain_rows: int, cost: RowCost, max_rows: int, other_s: float = 0.0
) -> list[int]:
    """How many of its ``lengths[i]`` drafts sequence i verifies this step, beside ``plain_rows``
    rows of one token each (every decoding sequence's own row); ``other_s``: what the step costs
    beside its projections (attention, norms, sampling), whatever its rows.

    Sequence i's j-th draft is accepted with probability ~``rates[i] ** j`` (it needs the j - 1
    before it), so its row adds that many tokens on average. Drafts are taken best first while
    they raise the step's expected tokens per second: a draft row is free while the step is bound
    by reading the weights, and once it is bound by compute, it must add at least its share of
    the step's tokens (``value * T >= dT * tokens``). Values fall and row costs rise, so the first
    draft that does not pay ends the budget. At most ``max_rows`` rows in all."""
    cands = sorted(
        ((rates[i] ** j, i) for i in range(len(rates)) for j in range(1, lengths[i] + 1)),
        key=lambda c: (-c[0], c[1]),
    )
    counts = [0] * len(rates)
    rows, tokens = plain_rows, float(plain_rows)
    t = other_s + cost.seconds(rows)
    for value, i in cands:
        if rows >= max_rows or value <= 0.0:
            break
        dt = cost.seconds(rows + 1) - cost.seconds(rows)
        if value * t < dt * tokens * (1.0 - 1e-9):  # a draft that breaks even still saves a step's latency
            break
        counts[i] += 1
        rows, tokens, t = rows + 1, tokens + value, t + dt
    return counts


def _uniform(params: SamplingParams, salt: int, offset: int) -> float:
    if params.seed is None:
        return float(torch.rand((), dtype=torch.float64))
    gen = torch.Generator().manual_seed(mix_seed(params.seed ^ salt, offset))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _draw(probs: torch.Tensor, params: SamplingParams, offset: int) -> int:
    """One token from ``probs`` [V] (unnormalized weights) by inverse CDF."""
    cdf = probs.double().cumsum(0)
    u = _uniform(params, _RESIDUAL_SALT, offset) * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    idx = min(idx, probs.shape[0] - 1)
    if probs[idx] <= 0:  # u * total rounded onto the end: the last token with weight
        idx = int(probs.nonzero()[-1])
    return idx


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The plain sampler's distribution for every row of ``logits`` [R, V]: [R, V] float32."""
    r = logits.shape[0]
    x = filter_logits(
        logits,
        torch.full((r,), params.temperature, dtype=torch.float32),
        torch.full((r,), params.top_k, dtype=torch.int32),
        torch.full((r,), params.top_p, dtype=torch.float32),
        torch.full((r,), params.min_p, dtype=torch.float32),
    )
    return torch.softmax(x, dim=-1)


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Tokens to append: the matching prefix of ``draft`` and the target's next token."""
    target = logits.argmax(dim=-1).tolist()
    out = []
    for j, d in enumerate(draft):
        if d != target[j]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def accept_sampled(
    p: torch.Tensor, draft: list[int], q: torch.Tensor | None, params: SamplingParams, first_offset: int
) -> list[int]:
    """Rejection sampling: ``p`` [k+1, V] target probabilities, ``draft`` k tokens, ``q`` [k, V]
    draft probabilities or None (one-hot on each drafted token). ``first_offset`` is the output
    index of the first token this step appends (the seeded generators' offset)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        pj = p[j]
        qd = 1.0 if q is None else float(q[j, d])
        pd = float(pj[d])
        u = _uniform(params, _ACCEPT_SALT, first_offset + j)
        if qd > 0 and u < min(1.0, pd / qd):
            out.append(d)
            continue
        if q is None:
            residual = pj.clone()
            residual[d] = 0.0
        else:
            residual = (pj - q[j].to(pj.dtype)).clamp_(min=0.0)
        if not bool((residual > 0).any()):  # p == q: rejection had probability 0; guard rounding
            residual = pj
        out.append(_draw(residual, params, first_offset + j))
        return out
    out.append(_draw(p[len(draft)], params, first_offset + len(draft)))
    return out


def verify(
    logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, params: SamplingParams, first_offset: int
) -> list[int]:
    """Tokens to append for a sequence whose rows ``logits`` [k+1, V] scored ``draft`` (k tokens)."""
    if params.temperature < GREEDY_EPS:
        return accept_greedy(logits, draft)
    return accept_sampled(target_probs(logits, params), draft, q, params, first_offset)
