"""Batched sampling with per-request temperature / top-k / top-p / min-p / seed, and logprobs.

Shapes:
    logits        [B, V] float32
    temperature   [B] float32   (< 1e-5 = greedy: argmax of the raw logits)
    top_k         [B] int32     (<= 0 or >= V: off)
    top_p         [B] float32   (>= 1: off)
    min_p         [B] float32   (<= 0: off)
    seeds         [B] int64     (-1: unseeded, drawn from torch's global RNG)
    offsets       [B] int64     (step number; a seeded row draws from (seed, offset) only)
    out           [B] int64 token ids

Filtering (HF / vLLM order), on x = logits / temperature:
    1. top-k: the k highest tokens;
    2. top-p: the smallest prefix (by descending prob) of the top-k set, renormalized, whose
       mass reaches top_p: a token is kept when the renormalized mass of the tokens ranked
       above it is < top_p (the first token is always kept);
    3. min-p: tokens with prob < min_p * max prob are dropped (ratio, so order-free).
Every filter keeps a prefix of the sorted tokens, so the result is one logit cutoff per row:
keep x >= cutoff (ties with the cutoff token are all kept).
The CPU reference samples by inverse CDF with one uniform per row; a seeded row draws it from
a torch.Generator seeded with mix_seed(seed, offset). The Triton path uses Gumbel-max with
Philox noise keyed by the seed, counter (column, offset): both sample the same distribution,
but a given (seed, offset) gives the same token only within one backend.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._triton import require_triton, tl, triton

GREEDY_EPS = 1e-5
_FIRST_WIDTH = 64  # top-p-only rows: first try the top 64 tokens, then x16
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, offset: int) -> int:
    """Deterministic 63-bit seed for (request seed, step offset)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (offset & _MASK64)) >> 1


def check_sampling(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    batch = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("min_p", min_p), ("seeds", seeds), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.shape != (batch,):
            raise ValueError(f"{name} must be a [B={batch}] tensor, got {getattr(t, 'shape', type(t))}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")


def _top(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `width` largest values of each row, descending, and their token ids ([B, width]).

    Ids are None for a full sort (width == V): then no candidate list is needed.
    """
    vocab = x.shape[1]
    if width == vocab:
        if not x.is_cpu:
            return x.sort(dim=-1, descending=True).values, None
        # NOTE: numpy's values-only sort is ~3.5x faster than torch.sort (which also sorts
        # indices): a 49k-vocab sort of 8 rows takes ~8 ms instead of ~28 ms on one core.
        return torch.from_numpy(np.ascontiguousarray(np.sort(x.numpy(), axis=-1)[:, ::-1])), None
    vals, ids = x.topk(width, dim=-1)
    return vals, ids


def _filter(x, top_k, top_p, min_p):
    """Cutoffs for the scaled logits x [B, V]: keep x >= cutoff [B].

    Returns (cutoff, cand_vals, cand_ids): cutoff is None when no row filters; cand_* are the
    top `width` tokens of each row, sorted (None after a full sort). Every filter keeps a
    prefix of the sorted row, so only the top `width` tokens are ever sorted: the largest
    top-k, else 64, widened x16 while a top-p-only row's nucleus does not fit.
    """
    batch, vocab = x.shape
    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    use_p = top_p < 1.0
    use_min_p = min_p > 0
    any_k, any_p, any_min_p = bool(use_k.any()), bool(use_p.any()), bool(use_min_p.any())
    if not (any_k or any_p or any_min_p):
        return None, None, None
    p_only = use_p & ~use_k
    any_p_only = bool(p_only.any())
    width = max(int(k[use_k].max()) if any_k else 1, _FIRST_WIDTH)
    top_p32 = top_p.to(x.dtype)
    lse = x.logsumexp(dim=-1, keepdim=True) if any_p else None
    while True:
        width = min(width, vocab)
        vals, ids = _top(x, width)
        if not any_p:
            break
        cum = (vals - lse).exp_().cumsum_(dim=-1)  # [B, width] mass of the top-r tokens
        if width == vocab or not any_p_only or bool((cum[:, -1] >= top_p32)[p_only].all()):
            break
        width *= 16
    cutoff = torch.full((batch,), float("-inf"), dtype=x.dtype, device=x.device)
    if any_k or any_p:
        k_eff = torch.where(use_k, k, vocab).clamp_(max=width)  # [B]
        num_keep = k_eff
        if any_p:
            # top-p runs on the top-k set renormalized; a row without top-k keeps all its mass
            mass_k = torch.where(use_k, cum.gather(1, (k_eff - 1).unsqueeze(1)).squeeze(1), 1.0)
            above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
            in_p = above < (top_p32 * mass_k).unsqueeze(1)  # a prefix of each row
            num_p = in_p.sum(dim=-1).clamp_(min=1)
            num_keep = torch.where(use_p, torch.minimum(num_p, k_eff), k_eff)
        kth = vals.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(use_k | use_p, kth, cutoff)
    if any_min_p:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        floor = vals[:, 0] + torch.log(min_p.to(x.dtype))
        cutoff = torch.maximum(cutoff, floor)
    return cutoff, vals if ids is not None else None, ids


def _logit_cutoffs(x, top_k, top_p, min_p) -> torch.Tensor | None:
    """Per-row cutoff on the scaled logits x [B, V] (keep x >= cutoff); None if no row filters."""
    return _filter(x, top_k, top_p, min_p)[0]


def filter_logits(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution `sample` draws from, as logits [B, V] float32 (filtered tokens -inf).

    softmax(filter_logits(...)) is the exact per-row sampling distribution (greedy rows are
    one-hot on the argmax); speculative decoding's rejection sampling uses it.
    """
    check_sampling(logits, temperature, top_k, top_p, min_p, temperature, temperature)
    greedy = temperature < GREEDY_EPS
    x = logits.to(torch.float32) / torch.where(greedy, 1.0, temperature).to(torch.float32).unsqueeze(1)
    cutoff = _logit_cutoffs(x, top_k, top_p, min_p)
    if cutoff is not None:
        x = x.masked_fill(x < cutoff.unsqueeze(1), float("-inf"))
    if bool(greedy.any()):
        one_hot = torch.full_like(x, float("-inf"))
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
        x = torch.where(greedy.unsqueeze(1), one_hot, x)
    return x


def _uniforms(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One U[0,1) per row: seeded rows from mix(seed, offset), others from the global RNG."""
    u = torch.rand(seeds.shape[0], dtype=torch.float64)
    seed_list = seeds.tolist()
    if any(s >= 0 for s in seed_list):
        gen = torch.Generator()
        for i, (seed, offset) in enumerate(zip(seed_list, offsets.tolist())):
            if seed >= 0:
                gen.manual_seed(mix_seed(seed, offset))
                u[i] = torch.rand(1, generator=gen, dtype=torch.float64)
    return u


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative weight exceeds u * total: [B] int64."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1].double()).to(torch.float32).unsqueeze(1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)
    # NOTE: u * total can round up to total; then fall back to the last column with weight.
    hit_zero = weights.gather(1, ids.unsqueeze(1)).squeeze(1) == 0
    if bool(hit_zero.any()):
        last = weights.shape[1] - 1 - (weights.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        ids = torch.where(hit_zero, last, ids)
    return ids


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    check_sampling(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    greedy = temperature < GREEDY_EPS
    num_greedy = int(greedy.sum())
    if num_greedy == logits.shape[0]:
        return logits.argmax(dim=-1)  # fast path: no scaling, no sort
    out = logits.argmax(dim=-1) if num_greedy else torch.empty(0, dtype=torch.int64)
    rows = None
    if num_greedy:
        rows = (~greedy).nonzero().squeeze(1)
        logits, temperature, top_k, top_p, min_p, seeds, offsets = (
            t.index_select(0, rows) for t in (logits, temperature, top_k, top_p, min_p, seeds, offsets)
        )
    x = logits.to(torch.float32) / temperature.to(torch.float32).unsqueeze(1)
    cutoff, cand_vals, cand_ids = _filter(x, top_k, top_p, min_p)
    u = _uniforms(seeds, offsets).to(x.device)
    if cand_vals is not None and bool((cand_vals[:, -1] < cutoff).all()):
        # Every kept token (ties with the cutoff included) is in the sorted candidate list:
        # sample there, [B, width] instead of [B, V].
        weights = (cand_vals - cand_vals[:, :1]).exp_().masked_fill_(cand_vals < cutoff.unsqueeze(1), 0.0)
        ids = cand_ids.gather(1, _inverse_cdf(weights, u).unsqueeze(1)).squeeze(1)
    else:
        if cutoff is not None:
            x.masked_fill_(x < cutoff.unsqueeze(1), float("-inf"))
        ids = _inverse_cdf((x - x.amax(dim=-1, keepdim=True)).exp_(), u)
    if rows is None:
        return ids
    out[rows] = ids
    return out


def compute_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model log-probabilities (before temperature/filters).

    logits [B, V], ids [B] -> (chosen [B] float32, top_ids [B, n] int64, top_logprobs [B, n]).
    Plain torch on every device: logsumexp + gather + topk, no [B, V] log-softmax copy.
    """
    if logits.dim() != 2 or ids.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [B, V] and ids [B]; got {tuple(logits.shape)}, {tuple(ids.shape)}")
    if top_n < 0 or top_n > logits.shape[1]:
        raise ValueError(f"top_n must be in [0, V={logits.shape[1]}], got {top_n}")
    x = logits.to(torch.float32)
    lse = x.logsumexp(dim=-1)
    chosen = x.gather(1, ids.long().unsqueeze(1)).squeeze(1) - lse
    if top_n == 0:
        empty = x.new_empty((x.shape[0], 0))
        return chosen, empty.long(), empty
    top_vals, top_ids = x.topk(top_n, dim=-1)
    return chosen, top_ids, top_vals - lse.unsqueeze(1)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _sample_kernel(
    x_ptr, cutoff_ptr, is_greedy_ptr, seeds_ptr, offsets_ptr, out_ptr,
    vocab, stride_x,
    HAS_CUTOFF: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per row: Gumbel-max over the kept tokens, argmax for greedy rows.
    # x is already temperature-scaled (greedy rows unscaled); cutoff comes from the same x.
    row = tl.program_id(0)
    is_greedy = tl.load(is_greedy_ptr + row) != 0
    cutoff = tl.load(cutoff_ptr + row) if HAS_CUTOFF else float("-inf")
    seed = tl.load(seeds_ptr + row)
    # Philox counter = (column, step): every step of a seeded request gets fresh noise.
    step = tl.load(offsets_ptr + row).to(tl.int64) << 32
    best_val = tl.full([], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([], 0, dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=in_vocab, other=float("-inf"))
        u = tl.rand(seed, step + cols.to(tl.int64))
        gumbel = -tl.log(-tl.log(u))  # u == 0 gives -inf: never chosen
        noisy = tl.where(x >= cutoff, x + gumbel, float("-inf"))
        score = tl.where(is_greedy, x, noisy)
        score = tl.where(in_vocab, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0)  # first maximum, like torch.argmax
        better = block_best > best_val
        best_idx = tl.where(better, start + block_idx, best_idx)
        best_val = tl.where(better, block_best, best_val)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    check_sampling(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    require_triton(logits)
    batch, vocab = logits.shape
    is_greedy = temperature < GREEDY_EPS
    if bool(is_greedy.all()):  # NOTE: one host sync; the all-greedy step skips everything else
        return logits.argmax(dim=-1)
    x = logits.to(torch.float32) / torch.where(is_greedy, 1.0, temperature).to(torch.float32).unsqueeze(1)
    cutoff = _logit_cutoffs(x, top_k, top_p, min_p)
    random_seeds = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=logits.device)
    seeds = torch.where(seeds >= 0, seeds.long(), random_seeds)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _sample_kernel[(batch,)](
        x, cutoff if cutoff is not None else x, is_greedy.to(torch.int8), seeds, offsets.long(), out,
        vocab, x.stride(0),
        HAS_CUTOFF=cutoff is not None, BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
    )
    return out
