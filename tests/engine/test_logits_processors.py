"""The logits-processor chain (services/engine/logits_processors) on irregular batches, against plain
references: HF's RepetitionPenaltyLogitsProcessor, OpenAI's presence/frequency formula written as a
loop, logit_bias and min_tokens row by row, and the grammar's masks stepped token by token.

The batches mix what a real step holds: plain decode rows, verifying sequences (row j counts the
first j drafts as output), a prefill row, a moved stream (its prompt ends with prior output), and
rows that ask for nothing (left exactly as they were).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from schemas.engine import SamplingParams, StructuredOutput
from services.agent.grammar import GrammarCompiler, json_schema_constraint
from services.engine.logits_processors import GrammarService, LogitsProcessors, LogitsState, wants_logit_work
from services.engine.model_runner import LogitsRows
from services.engine.sampling import sample_tokens
from services.engine.sequence import Sequence

V = 50
EOS = 2


def make_seq(prompt: list[int], output: list[int], params: SamplingParams, drafts=(), grammar=None) -> Sequence:
    seq = Sequence("r", prompt, params, eos_token_ids=frozenset({EOS}), max_model_len=4096)
    seq.token_ids += output
    seq.draft_tokens = list(drafts)
    seq.logits_state = LogitsState(seq, grammar) if wants_logit_work(params) or grammar else None
    return seq


def rows_of(seqs: list[Sequence], counts: list[int]) -> LogitsRows:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return LogitsRows(seqs, counts, starts)


def reference_row(x: torch.Tensor, seq: Sequence, j: int) -> torch.Tensor:
    """Row j of ``seq`` (after its first j drafts), processed one rule at a time."""
    p = seq.params
    prompt = seq.token_ids[: seq.num_prompt_tokens - seq.num_prior_output_tokens]
    output = seq.generated_token_ids + seq.draft_tokens[:j]
    x = x.clone()
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([prompt + output])
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x[None])[0]
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if seq.num_output_tokens + j < p.min_tokens:
        for t in seq.stop_token_ids:
            x[t] = float("-inf")
    return x


def test_penalties_bias_and_min_tokens_match_the_references_on_an_irregular_batch():
    g = torch.Generator().manual_seed(3)
    seqs = [
        # plain decode row, everything at once (min_tokens reached: EOS free again)
        make_seq([5, 6, 7, 5], [9, 9, 11], SamplingParams(presence_penalty=0.7, frequency_penalty=0.4,
                                                         repetition_penalty=1.3, logit_bias={3: 4.0, 9: -100.0},
                                                         min_tokens=3)),
        # asks for nothing: left untouched
        make_seq([1, 2, 3], [4], SamplingParams()),
        # verifying 3 drafts: row j counts drafts[:j]; min_tokens crosses inside the drafts
        make_seq([8, 8, 13], [14], SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0, min_tokens=3,
                                                  stop_token_ids=(17,)), drafts=[14, 20, 14]),
        # a moved stream: the prompt's last 3 tokens are prior output (repetition sees them as output)
        make_seq([30, 31, 32, 33, 34, 35], [36], SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5,
                                                                num_prior_output_tokens=3)),
        # a prefill row (no output yet) with a bias and min_tokens
        make_seq([40, 41], [], SamplingParams(logit_bias={41: 1.5, 0: -2.0}, min_tokens=1, ignore_eos=True,
                                              stop_token_ids=(7, 8))),
        # verifying, nothing asked
        make_seq([1], [2, 3], SamplingParams(), drafts=[4]),
    ]
    counts = [1, 1, 4, 1, 1, 2]
    rows = rows_of(seqs, counts)
    logits = torch.randn(sum(counts), V, generator=g) * 3
    want = logits.clone()
    for seq, start, count in zip(rows.seqs, rows.starts, counts):
        for j in range(count):
            if seq.logits_state is not None:
                want[start + j] = reference_row(logits[start + j], seq, j)
    chain = LogitsProcessors(V, torch.device("cpu"))
    pending = chain.start(rows)
    got, raw, errors = chain.apply(logits.clone(), rows, pending)
    assert errors == {} and raw is None
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[-2:], logits[-2:])  # untouched rows
    # the verifying sequence (rows 2-5, one output token): output indexes 1, 2 hold EOS back, 3 and 4 not
    assert got[2, EOS] == got[3, EOS] == got[3, 17] == float("-inf")
    assert torch.isfinite(got[4:6, [EOS, 17]]).all()


def test_counts_follow_appended_tokens_and_logprobs_keep_the_raw_rows():
    seq = make_seq([5, 6], [7], SamplingParams(frequency_penalty=1.0, logprobs=2))
    chain = LogitsProcessors(V, torch.device("cpu"))
    for new in ([], [7], [8, 7]):  # tokens appended between steps are counted at the next one
        seq.token_ids += new
        rows = rows_of([seq], [1])
        logits = torch.zeros(1, V)
        got, raw, _ = chain.apply(logits, rows, chain.start(rows))
        assert raw is logits and torch.equal(raw, torch.zeros(1, V))  # the raw logits, for logprobs
        assert got[0, 7] == -seq.generated_token_ids.count(7) and got[0, 8] == -seq.generated_token_ids.count(8)


def test_rows_that_ask_for_nothing_cost_nothing():
    seqs = [make_seq([1, 2], [3], SamplingParams(temperature=0.5, seed=4)), make_seq([1], [], SamplingParams())]
    chain = LogitsProcessors(V, torch.device("cpu"))
    rows = rows_of(seqs, [1, 1])
    assert chain.start(rows) is None
    logits = torch.randn(2, V)
    got, raw, errors = chain.apply(logits, rows, None)
    assert got is logits and raw is None and errors == {}


# --- the grammar's masks ------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 2}},
          "required": ["kind", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def service(tokenizer, model_dir):
    from services.engine.model_config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    return GrammarService(tokenizer, mc.vocab_size, mc.eos_token_ids)


@pytest.fixture(scope="module")
def reference_compiler(tokenizer, model_dir):
    from services.engine.model_config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    return GrammarCompiler.from_hf(tokenizer, vocab_size=mc.vocab_size, eos_token_ids=list(mc.eos_token_ids))


def allowed(compiler: GrammarCompiler, constraint: StructuredOutput, token_ids: list[int], vocab: int) -> torch.Tensor:
    """The tokens allowed after ``token_ids``, stepping a fresh matcher (bool [vocab])."""
    matcher = compiler.rebuild(constraint, token_ids)
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_mask(mask)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def test_grammar_masks_per_row_match_stepping_and_a_failing_grammar_fails_alone(service, reference_compiler,
                                                                                 tokenizer):
    vocab = service.vocab_size
    constraint = json_schema_constraint(SCHEMA)
    text = json.dumps({"kind": "dog", "tags": ["a", "bc"]}, separators=(",", ":"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("JSON:")

    def constrained(output, drafts=(), **kw):
        params = SamplingParams(structured_output=constraint, **kw)
        seq = make_seq(prompt, output, params, drafts)
        seq.logits_state = LogitsState(seq, service.start(constraint, seq.generated_token_ids))
        return seq

    k = 4
    plain = constrained(ids[:k])
    verifying = constrained(ids[:k], drafts=ids[k : k + 3])
    eos_held = constrained(ids, min_tokens=len(ids) + 5)  # complete: only EOS is left, min_tokens yields
    moved = make_seq(prompt + ids[:k], ids[k : k + 1], SamplingParams(structured_output=constraint,
                                                                      num_prior_output_tokens=k))
    moved.logits_state = LogitsState(moved, service.start(constraint, moved.generated_token_ids[:k]))
    broken = StructuredOutput(kind="lark", spec="start: /a(/")  # does not compile
    bad = make_seq(prompt, [], SamplingParams(structured_output=broken))
    bad.logits_state = LogitsState(bad, service.start(broken, []))
    free = make_seq(prompt, [], SamplingParams(presence_penalty=0.5))
    seqs = [plain, bad, verifying, free, eos_held, moved]
    counts = [1, 1, 4, 1, 1, 1]
    rows = rows_of(seqs, counts)
    logits = torch.randn(sum(counts), vocab, generator=torch.Generator().manual_seed(5))
    chain = LogitsProcessors(vocab, torch.device("cpu"), defer_masks=False)  # every row masked up front
    got, _, errors = chain.apply(logits.clone(), rows, chain.start(rows))
    assert list(errors) == [1] and "structured output" in errors[1]  # the broken grammar, alone
    assert torch.equal(got[1], logits[1])  # its row is left as it came
    want_rows = [(0, ids[:k]), (2, ids[:k]), (3, ids[: k + 1]), (4, ids[: k + 2]), (5, ids[: k + 3]),
                 (7, ids), (8, ids[: k + 1])]
    for row, prefix in want_rows:
        ok = allowed(reference_compiler, constraint, prefix, vocab)
        assert torch.equal(torch.isfinite(got[row]), ok), row
        assert torch.equal(got[row][ok], logits[row][ok]), row
    assert torch.isfinite(got[7]).sum() >= 1  # EOS stays allowed once the grammar is complete
    # after sampling: the matchers take the tokens to append; one the grammar forbids fails its request alone
    errors = {}
    chain.accepted([plain, verifying, moved], [[ids[k]], [*ids[k : k + 3], ids[k + 3]], [tokenizer.eos_token_id]],
                   errors)
    assert list(errors) == [2] and "does not fit the grammar" in errors[2]
    assert plain.logits_state.grammar.matcher.num_tokens == k + 1


def test_bad_logit_work_is_refused_when_the_request_arrives():
    from schemas.engine import InvalidSamplingParams
    from services.engine.intake import RequestIntake
    from services.engine.outputs import RequestError

    with pytest.raises(InvalidSamplingParams, match="at most 300"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})  # OpenAI's bound
    with pytest.raises(InvalidSamplingParams, match=r"n must be in \[1, 16\]"):
        SamplingParams(n=17)
    intake = RequestIntake(tokenizer=None, vocab_size=V, max_model_len=64, eos_token_ids=frozenset({EOS}),
                           pages_for=lambda n: -(-n // 16), num_pages=8)
    for params, match in [(SamplingParams(logit_bias={V: 1.0}), rf"logit_bias token ids must be in \[0, {V}\)"),
                          (SamplingParams(num_prior_output_tokens=3), "must be less than the prompt's 3 tokens"),
                          (SamplingParams(n=2), "one sequence per request"),
                          (SamplingParams(structured_output=StructuredOutput(kind="json_object")), "needs the tokenizer")]:
        with pytest.raises(RequestError, match=match):
            intake.new_sequence("r", [1, 2, 3], params)
    seq = intake.new_sequence("ok", [1, 2, 3], SamplingParams(min_tokens=2, num_prior_output_tokens=1))
    assert seq.logits_state is not None and seq.generated_token_ids == [3] and seq.num_generated_tokens == 1
    assert intake.new_sequence("plain", [1, 2], SamplingParams(temperature=0.3)).logits_state is None


# --- deferred rows: drawn without the mask, drawn again with it when the grammar refuses -------------

def deferred_draws(service, constraint, prompt, output, logits, params: list[SamplingParams]) -> tuple[list[int], LogitsProcessors]:
    """One constrained request a row, each with ``output`` so far, drawing its next token from ``logits``
    [1, V] through the chain as the model runner does (start, apply, sample, redraw_refused, accepted)."""
    vocab = logits.shape[1]
    chain = LogitsProcessors(vocab, torch.device("cpu"))
    out = []
    for first in range(0, len(params), 100):
        seqs = []
        for p in params[first : first + 100]:
            seq = make_seq(prompt, output, p)
            seq.logits_state = LogitsState(seq, service.start(constraint, []))
            seqs.append(seq)
        rows = rows_of(seqs, [1] * len(seqs))
        pending = chain.start(rows)
        assert len(pending.deferred) == len(seqs) and not pending.rows  # no mask filled before sampling
        got, raw, errors = chain.apply(logits.expand(len(seqs), vocab).clone(), rows, pending)
        steps = [s.num_generated_tokens for s in seqs]
        tokens, lps, sample_errors = sample_tokens(got, [s.params for s in seqs], steps)
        tokens, lps = [[t] for t in tokens], [[lp] for lp in lps]
        chain.redraw_refused(got, rows, pending, tokens, lps, errors, raw)
        chain.accepted(seqs, tokens, errors)
        assert errors == {} and sample_errors == {}
        out += [t[0] for t in tokens]
    return out, chain


def test_deferred_rows_draw_exactly_the_masked_distribution(service, reference_compiler, tokenizer):
    """A temperature-only constrained row is drawn from its unmasked logits and, when the grammar refuses
    the token, drawn again from the masked row (chain.py): token a comes out with p(a) / p(A), the
    masked distribution. Seeded draws against softmax over the allowed tokens: the total variation stays
    well under what a biased redraw gives (the first draw's uniform reused: 0.23 to 0.25 here), and
    no draw falls outside the grammar."""
    vocab = service.vocab_size
    constraint = json_schema_constraint({"enum": ["cat", "dog", "cow", "bird", "bee"]})
    prompt = tokenizer.encode("Animal:")
    quote = tokenizer.encode('"', add_special_tokens=False)  # the string opened: the names' tokens come next
    ok = allowed(reference_compiler, constraint, quote, vocab)
    allowed_ids = ok.nonzero().squeeze(1)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, vocab, generator=g) - 12.0  # the rest of the vocabulary: next to no mass
    logits[0, allowed_ids] = torch.randn(len(allowed_ids), generator=g)
    mass = float(logits[0, allowed_ids].exp().sum())
    logits[0, (~ok).nonzero().squeeze(1)[:40]] = math.log(mass / 40)  # the grammar refuses about half the draws
    p = torch.softmax(logits[0], dim=0)
    want = p[allowed_ids] / p[allowed_ids].sum()
    for seeded, draws, bound in [(False, 4000, 0.03), (True, 800, 0.08)]:
        if not seeded:
            torch.manual_seed(0)  # unseeded rows draw from torch's global generator
        params = [SamplingParams(temperature=1.0, seed=i if seeded else None, structured_output=constraint)
                  for i in range(draws)]
        tokens, chain = deferred_draws(service, constraint, prompt, quote, logits, params)
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
        assert counts[~ok].sum() == 0  # every token fits the grammar
        assert chain.num_deferred_checked == draws
        assert 0.35 * draws < chain.num_deferred_redrawn < 0.65 * draws  # about 1 - p(A) of them
        tv = 0.5 * float((counts[allowed_ids] / draws - want).abs().sum())
        assert tv < bound, (seeded, tv)


def test_truncating_samplers_and_drafts_are_masked_before_sampling(service, tokenizer):
    """top-k, top-p and min-p keep a set that depends on the mask, so such a row is masked up front, as
    is a verifying row and one held by min_tokens; argmax and temperature alone are deferred."""
    constraint = json_schema_constraint({"enum": ["cat", "dog"]})
    prompt = tokenizer.encode("Animal:")

    def seq_of(drafts=(), **kw):
        seq = make_seq(prompt, [], SamplingParams(structured_output=constraint, **kw), drafts)
        seq.logits_state = LogitsState(seq, service.start(constraint, []))
        return seq

    seqs = [seq_of(temperature=0.0), seq_of(temperature=0.7), seq_of(temperature=0.7, top_k=20),
            seq_of(temperature=0.7, top_p=0.9), seq_of(temperature=0.7, min_p=0.05), seq_of(min_tokens=3),
            seq_of(temperature=0.0, drafts=[5])]
    counts = [1, 1, 1, 1, 1, 1, 2]
    pending = LogitsProcessors(service.vocab_size, torch.device("cpu")).start(rows_of(seqs, counts))
    assert [i for i, _, _ in pending.deferred] == [0, 1]
    assert pending.rows == [2, 3, 4, 5, 6, 7]
    pending.future.result()
