"""Drafters by name (services/draft/base.py): the registry owns the choices and their validation,
each drafter builds itself from its own options and says what a drafted token costs."""

from __future__ import annotations

import pytest

from services.config import ConfigError
from services.draft import base
from services.draft.base import Drafter, DraftError, Proposal, drafter_class
from services.draft.config import DraftConfig
from services.draft.model import ModelDrafter
from services.draft.ngram import NgramDrafter
from services.engine.config import EngineConfig
from services.plugins import Registry


class EchoDrafter(Drafter):
    """A drafter from another package: proposes the stream's last token ``repeat`` times."""

    name = "echo"
    cost_per_token = 0.25

    def __init__(self, *, repeat: int):
        self.repeat = repeat
        self.streams: dict[str, list[int]] = {}

    @classmethod
    def from_config(cls, config, *, target_dir=None):
        return cls(repeat=config.num_speculative_tokens)

    def has(self, request_id):
        return request_id in self.streams

    def open(self, request_id, prompt_ids):
        self.streams[request_id] = list(prompt_ids)

    def propose(self, request_id, k):
        stream = self.streams[request_id]
        return Proposal(position=len(stream), tokens=[stream[-1]] * min(k, self.repeat))

    def commit(self, request_id, tokens):
        self.streams[request_id] += tokens

    def close(self, request_id):
        self.streams.pop(request_id, None)


@pytest.fixture
def with_echo(monkeypatch):
    """The built-in drafters plus ``echo``, registered with one line (undone after the test)."""
    registry = Registry("drafter", {"ngram": "services.draft.ngram:NgramDrafter",
                                    "model": "services.draft.model:ModelDrafter"})
    registry.register("echo", EchoDrafter, doc="the last token again")
    monkeypatch.setattr(base, "DRAFTERS", registry)


def test_an_unknown_method_is_a_config_error_naming_the_registered_ones():
    for make in (lambda: EngineConfig(speculative_method="lookahead"),
                 lambda: DraftConfig(speculative_method="lookahead")):
        with pytest.raises(ConfigError, match="speculative_method.*model, ngram.*lookahead"):
            make()
    with pytest.raises(DraftError, match="model, ngram"):
        drafter_class("lookahead")
    assert EngineConfig().speculative_method is None  # off needs no drafter


def test_each_drafter_checks_and_reads_its_own_options():
    for make in (lambda: EngineConfig(speculative_method="model"), lambda: DraftConfig(speculative_method="model")):
        with pytest.raises(ConfigError, match="draft_model"):
            make()
    with pytest.raises(ConfigError, match="ngram_min"):
        DraftConfig(speculative_method="ngram", ngram_min=5, ngram_max=2)
    EngineConfig(speculative_method="model", ngram_min=5, ngram_max=2, draft_model="/d")  # not ngram's business
    d = drafter_class("ngram").from_config(EngineConfig(speculative_method="ngram", ngram_min=1, ngram_max=3))
    assert isinstance(d, NgramDrafter) and (d.min_n, d.max_n) == (1, 3)


def test_a_registered_drafter_is_validated_built_and_costed_like_the_built_in_ones(with_echo):
    config = EngineConfig(speculative_method="echo", num_speculative_tokens=3)
    drafter = drafter_class("echo").from_config(config)
    assert isinstance(drafter, EchoDrafter) and drafter.repeat == 3
    assert drafter_class("echo").cost_for(config) == 0.25
    assert DraftConfig(speculative_method="echo").speculative_method == "echo"


def test_costs_come_from_the_drafter_class(model_dir, tmp_path):
    assert drafter_class("ngram").cost_for(EngineConfig(speculative_method="ngram")) == 0.0
    # a worker whose drafts come from the draft service: the draft model's weights over the target's
    same = EngineConfig(speculative_method="model", draft_model=str(model_dir))
    assert drafter_class("model").cost_for(same, target_dir=str(model_dir)) == 1.0
    unseen = EngineConfig(speculative_method="model", draft_model=str(tmp_path / "elsewhere"))
    assert drafter_class("model").cost_for(unseen, target_dir=str(model_dir)) == ModelDrafter.UNKNOWN_COST
