"""The ``model`` drafter: a layer-skip copy of the default model, its KV rollback, tokenizer refusal."""

from __future__ import annotations

import json
import shutil

import pytest

from schemas.engine import SamplingParams
from services.draft.base import DraftError, make_drafter
from services.draft.model import ModelDrafter
from services.models.truncate import write_truncated_model
from tests.engine.conftest import make_engine
from tests.engine.test_spec_decode import EXTRA_TEXTS, _run_in_groups, twenty_prompts  # noqa: F401 (fixture)


ONCE = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    return write_truncated_model(model_dir, tmp_path_factory.mktemp("draft") / "smol-8l", 8)


@pytest.fixture(scope="module")
def deep_draft_dir(model_dir, tmp_path_factory):
    # 24 of 30 layers: drafts a mix of accepted and rejected tokens (measured: ~25% accepted on
    # short greedy prompts; the 8-layer cut has nearly none, so adaptive k mutes it and a run
    # may accept nothing, which would leave the acceptance side of this test unexercised)
    return write_truncated_model(model_dir, tmp_path_factory.mktemp("draft") / "smol-24l", 24)


def test_truncated_folder_is_a_loadable_model(draft_dir, model_dir):
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 8
    assert (draft_dir / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    d = ModelDrafter(model=str(draft_dir), target_dir=str(model_dir))
    assert 0 < d.cost_per_token < 1


def test_draft_model_with_another_tokenizer_is_refused(draft_dir, model_dir, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens mean other text
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftError, match="tokenizer"):
        make_drafter("model", model=str(other), target_dir=str(model_dir))
    bigger = tmp_path / "bigger-vocab"
    shutil.copytree(draft_dir, bigger)
    config = json.loads((bigger / "config.json").read_text())
    config["vocab_size"] += 8
    (bigger / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftError):
        make_drafter("model", model=str(bigger), target_dir=str(model_dir))


def test_drafter_kv_follows_commits(draft_dir, model_dir, tokenizer):
    d = ModelDrafter(model=str(draft_dir), target_dir=str(model_dir))
    prompt = tokenizer.encode(EXTRA_TEXTS[2])
    d.open("r", prompt)
    p1 = d.propose("r", 3)
    assert p1.position == len(prompt) and len(p1.tokens) == 3
    seq = d.seqs["r"]
    assert seq.num_computed_tokens == len(prompt) + 2
    # the target accepted the first draft and corrected the second
    wrong = (p1.tokens[1] + 1) % 1000
    d.commit("r", [p1.tokens[0], wrong])
    assert seq.token_ids == prompt + [p1.tokens[0], wrong]
    assert seq.num_computed_tokens == len(prompt) + 1  # the accepted draft's KV is kept
    assert len(seq.page_ids) == d.bm.pages_for(seq.num_computed_tokens)
    # a fresh drafter on the committed stream proposes the same (the rollback was exact)
    p2 = d.propose("r", 3)
    fresh = ModelDrafter(model=str(draft_dir), target_dir=str(model_dir))
    fresh.open("r", prompt + [p1.tokens[0], wrong])
    assert fresh.propose("r", 3) == p2
    d.close("r")
    fresh.close("r")
    assert d.bm.num_used_pages == 0


@pytest.mark.timeout(900)
def test_a_full_copy_drafts_what_the_target_decodes(model_dir, tokenizer, tmp_path):
    """A draft model with all the target's layers must propose the target's own greedy tokens:
    its paged KV, catch-up passes and rollbacks are right (acceptance near 1, fp32 near-ties aside)."""
    full = write_truncated_model(model_dir, tmp_path / "full", json.loads((model_dir / "config.json").read_text())
                                 ["num_hidden_layers"])
    eng = make_engine(model_dir, num_speculative_tokens=3)
    eng.set_drafter(ModelDrafter(model=str(full), target_dir=str(model_dir), cost_per_token=0.0))
    prompts = [tokenizer.encode(EXTRA_TEXTS[1]), tokenizer.encode(ONCE)]
    eng.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    st = eng.stats
    assert st.num_drafted_tokens > 10
    assert st.num_accepted_tokens >= 0.9 * st.num_drafted_tokens, (st.num_accepted_tokens, st.num_drafted_tokens)
    assert eng.drafter.bm.num_used_pages == 0


@pytest.mark.timeout(1500)
def test_greedy_identical_with_model_drafter_for_twenty_prompts(engine, deep_draft_dir, twenty_prompts):
    eng = make_engine(engine.model_dir, speculative_method="model", draft_model=str(deep_draft_dir),
                      num_speculative_tokens=3)
    # cost 0: drafting stays on; most drafts of a layer-skip cut are rejected, some accepted
    eng.set_drafter(ModelDrafter(model=str(deep_draft_dir), target_dir=str(engine.model_dir), cost_per_token=0.0))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    plain = _run_in_groups(engine, twenty_prompts, params)
    spec = _run_in_groups(eng, twenty_prompts, params)
    assert [i for i, (a, b) in enumerate(zip(plain, spec)) if a.token_ids != b.token_ids] == []
    assert eng.stats.num_drafted_tokens > 100 and eng.stats.num_accepted_tokens > 0
    assert not eng.has_unfinished() and eng.block_manager.num_used_pages == 0
    assert eng.drafter.bm.num_used_pages == 0  # every request closed its draft KV
