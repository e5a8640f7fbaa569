"""Sampling: filter masks vs a brute-force oracle, greedy == argmax, seeded reproducibility,
the sampled distribution, logprobs; the Triton sampler vs the same expectations."""

from __future__ import annotations

import pytest
import torch

from kernels import compute_logprobs, filter_logits, sample
from kernels.sampling import sample_ref


def _params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=-1, offset=0, device="cpu"):
    def full(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return (t.expand(batch).clone() if t.dim() == 0 else t).to(device)

    return (
        full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
        full(min_p, torch.float32), full(seed, torch.int64), full(offset, torch.int64),
    )


def _oracle_kept(logits, temperature, top_k, top_p, min_p) -> set[int]:
    """HF order, one row, float64, written as loops."""
    if temperature < 1e-5:
        return {int(logits.argmax())}
    x = logits.double() / temperature
    probs = x.softmax(-1)
    order = torch.argsort(x, descending=True).tolist()
    vocab = len(order)
    cand = order[: top_k if 0 < top_k < vocab else vocab]
    if top_p < 1.0:
        mass = probs[cand] / probs[cand].sum()
        kept, above = [], 0.0
        for i, token in enumerate(cand):
            if i > 0 and above >= top_p:
                break
            kept.append(token)
            above += float(mass[i])
        cand = kept
    if min_p > 0:
        cand = [t for t in cand if probs[t] >= min_p * probs.max()]
    return set(cand)


COMBOS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.0, 5, 0.5, 0.1),  # greedy ignores filters
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 0.0, 0.0),  # top_p 0: only the top token
    (1.0, 0, 1.0, 0.2),
    (0.8, 10, 0.6, 0.0),  # top-p inside the renormalized top-k
    (1.0, 3, 0.95, 0.3),
    (2.0, 0, 0.8, 0.05),
    (1.0, 1, 1.0, 0.0),
    (0.5, 64, 1.0, 0.0),  # k >= V: off
    (1.0, -1, 0.97, 0.0),
]


def test_filter_masks_match_oracle():
    gen = torch.Generator().manual_seed(0)
    rows = len(COMBOS) * 3
    logits = torch.randn(rows, 50, generator=gen) * 3
    t, k, p, m = (torch.tensor([c[i] for c in COMBOS * 3]) for i in range(4))
    kept = filter_logits(logits, t.float(), k.int(), p.float(), m.float()) > float("-inf")
    for r in range(rows):
        want = _oracle_kept(logits[r], float(t[r]), int(k[r]), float(p[r]), float(m[r]))
        assert set(kept[r].nonzero().flatten().tolist()) == want, f"row {r}: {COMBOS[r % len(COMBOS)]}"


def test_top_p_only_rows_widen_the_candidate_set_exactly():
    # the reference sorts only the top 64 / 1024 / all tokens, depending on where the nucleus ends
    gen = torch.Generator().manual_seed(3)
    spread = torch.tensor([8.0, 2.0, 0.3, 8.0, 0.3, 1.0])[:, None]
    logits = torch.randn(6, 3000, generator=gen) * spread
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.999, 0.99, 0.7])
    t, k, _, m, _, _ = _params(6, temperature=1.0)
    kept = filter_logits(logits, t, k, top_p, m) > float("-inf")
    sizes = kept.sum(-1).tolist()
    assert min(sizes) < 64 and max(sizes) > 1024  # every width is exercised
    for r in range(6):
        assert set(kept[r].nonzero().flatten().tolist()) == _oracle_kept(logits[r], 1.0, 0, float(top_p[r]), 0.0)


def test_filter_keeps_scaled_logits():
    logits = torch.randn(2, 30)
    out = filter_logits(logits, *_params(2, temperature=0.5, top_k=4)[:4])
    kept = out > float("-inf")
    assert kept.sum(-1).tolist() == [4, 4]
    torch.testing.assert_close(out[kept], (logits / 0.5)[kept])


def test_sample_draws_only_kept_tokens():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(COMBOS), 50, generator=gen) * 3
    t, k, p, m = (torch.tensor([c[i] for c in COMBOS]) for i in range(4))
    kept = filter_logits(logits, t.float(), k.int(), p.float(), m.float()) > float("-inf")
    for step in range(40):
        seeds = torch.arange(len(COMBOS)) + 100 * step
        ids = sample(logits, t.float(), k.int(), p.float(), m.float(), seeds, torch.full((len(COMBOS),), step))
        assert kept[torch.arange(len(COMBOS)), ids].all()


def test_greedy_is_argmax():
    logits = torch.randn(6, 1000)
    assert torch.equal(sample(logits, *_params(6, temperature=0.0)), logits.argmax(-1))
    # mixed batch: the greedy rows still take the argmax
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.9, 0.0, 1e-6])
    ids = sample(logits, temperature, *_params(6, seed=3)[1:])
    greedy = temperature < 1e-5
    assert torch.equal(ids[greedy], logits.argmax(-1)[greedy])


def test_seeded_rows_reproducible_per_seed_and_offset():
    logits = torch.randn(1, 200).expand(4, 200).contiguous()
    t, k, p, m, _, _ = _params(4, temperature=1.5)
    a = sample(logits, t, k, p, m, torch.tensor([7, 7, 8, -1]), torch.tensor([3, 3, 3, 3]))
    assert a[0] == a[1]  # same (seed, offset) -> same token, whatever the batch position
    # the same request alone in a batch, at the same step
    alone = sample(logits[:1], *_params(1, temperature=1.5, seed=7, offset=3))
    assert alone[0] == a[0]
    # successive steps of one seeded request differ (200 tokens at temperature 1.5)
    steps = [int(sample(logits[:1], *_params(1, temperature=1.5, seed=7, offset=s))[0]) for s in range(20)]
    assert len(set(steps)) > 5


def test_unseeded_rows_follow_torch_global_rng():
    logits = torch.randn(8, 100)
    args = _params(8, temperature=1.0, top_p=0.9)
    torch.manual_seed(123)
    a = sample(logits, *args)
    torch.manual_seed(123)
    assert torch.equal(sample(logits, *args), a)


@pytest.mark.parametrize("combo", [(1.0, 0, 1.0, 0.0), (0.7, 6, 0.9, 0.05), (1.0, 0, 0.8, 0.0)])
def test_sampled_distribution_matches_filtered_softmax(combo):
    # 20000 draws of one distribution: each row is the same logits with its own seed
    n, vocab = 20000, 10
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)).expand(n, vocab).contiguous()
    t, k, p, m, _, _ = _params(n, *combo)
    ids = sample_ref(logits, t, k, p, m, torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(ids, minlength=vocab).double() / n
    want = filter_logits(logits[:1], t[:1], k[:1], p[:1], m[:1]).softmax(-1)[0].double()
    # 5 sigma of a binomial proportion at n=20000 is <= 0.018; filtered tokens never appear
    torch.testing.assert_close(freq, want, atol=0.018, rtol=0)
    assert freq[want == 0].sum() == 0


def test_compute_logprobs():
    logits = torch.randn(4, 300)
    ids = torch.tensor([0, 17, 299, 5])
    chosen, top_ids, top_lps = compute_logprobs(logits, ids, 3)
    logp = logits.double().log_softmax(-1)
    torch.testing.assert_close(chosen.double(), logp[torch.arange(4), ids], atol=1e-5, rtol=0)
    want_lp, want_ids = logp.topk(3)
    assert torch.equal(top_ids, want_ids)
    torch.testing.assert_close(top_lps.double(), want_lp, atol=1e-5, rtol=0)
    _, no_ids, no_lps = compute_logprobs(logits, ids, 0)
    assert no_ids.shape == (4, 0) and no_lps.shape == (4, 0)


def test_sampling_errors():
    with pytest.raises(ValueError, match="top_k"):
        sample(torch.zeros(2, 5), torch.ones(2), torch.zeros(3, dtype=torch.int32), torch.ones(2), torch.zeros(2),
               torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="top_n"):
        compute_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 6)


# --------------------------------------------------------------------------- Triton


def test_sample_triton_greedy_and_support(triton_backend, device):
    # V = 5000 spans two 4096-wide blocks; greedy rows must equal torch.argmax exactly
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 5000, generator=gen) * 4).to(device)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.8, 1.2, 0.0], device=device)
    top_k = torch.tensor([0, 0, 9, 20, 0, 0], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.7, 1.0, 1.0], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.2, 0.0], device=device)
    seeds = torch.tensor([-1, 4, 5, 6, -1, 7], device=device)
    offsets = torch.zeros(6, dtype=torch.long, device=device)
    ids = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    greedy = (temperature == 0).cpu()
    assert torch.equal(ids.cpu()[greedy], logits.argmax(-1).cpu()[greedy])
    kept = filter_logits(logits, temperature, top_k, top_p, min_p) > float("-inf")
    assert kept[torch.arange(6, device=device), ids].all()
    # seeded rows are reproducible
    again = sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert torch.equal(again[1:4], ids[1:4])


def test_sample_triton_distribution(triton_backend, device):
    # the interpreter runs one program per row (~10 ms): 256 draws, a loose 4-sigma bound
    n, vocab = 256, 6
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0]).expand(n, vocab).contiguous().to(device)
    t, k, p, m, _, _ = _params(n, temperature=1.0, top_k=4, device=device)
    ids = sample(logits, t, k, p, m, torch.arange(n, device=device), torch.zeros(n, dtype=torch.long, device=device))
    freq = torch.bincount(ids.cpu(), minlength=vocab).double() / n
    want = filter_logits(logits[:1], t[:1], k[:1], p[:1], m[:1]).softmax(-1)[0].double().cpu()
    assert freq[want == 0].sum() == 0
    torch.testing.assert_close(freq, want, atol=0.13, rtol=0)


@pytest.mark.gpu
def test_sample_triton_real_shapes(triton_backend):
    # SmolLM2 vocab, 64 rows, 4000 draws of one mixed-filter row
    n, vocab = 4000, 49152
    logits = torch.randn(vocab, device="cuda").expand(n, vocab).contiguous()
    t, k, p, m, _, _ = _params(n, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, device="cuda")
    ids = sample(logits, t, k, p, m, torch.arange(n, device="cuda"), torch.zeros(n, dtype=torch.long, device="cuda"))
    freq = torch.bincount(ids.cpu(), minlength=vocab).double() / n
    want = filter_logits(logits[:1], t[:1], k[:1], p[:1], m[:1]).softmax(-1)[0].double().cpu()
    assert freq[want == 0].sum() == 0
    torch.testing.assert_close(freq, want, atol=0.04, rtol=0)
    greedy = sample(logits[:64], *_params(64, temperature=0.0, device="cuda"))
    assert torch.equal(greedy, logits[:64].argmax(-1))
