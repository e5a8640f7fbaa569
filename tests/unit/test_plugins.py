"""The one plug-in registry every extension kind uses (services/plugins.py)."""

from __future__ import annotations

import collections

import pytest

from services.plugins import Registry, UnknownPlugin


def test_lazy_import_and_choices():
    reg = Registry("thing", {"od": "collections:OrderedDict", "dq": "collections:deque"}, docs={"dq": "a deque"})
    assert reg.names() == ["dq", "od"] and list(reg) == ["dq", "od"] and len(reg) == 2
    assert "od" in reg and "nope" not in reg
    assert reg.get("od") is collections.OrderedDict
    assert reg.help() == "dq: a deque; od"


def test_unknown_name_lists_the_known_ones():
    reg = Registry("router policy", {"a": "collections:deque"})
    with pytest.raises(UnknownPlugin, match=r"unknown router policy 'b'; choose one of: a"):
        reg.get("b")
    with pytest.raises(ValueError):  # config validation catches ValueError
        reg.check("b")


def test_third_party_registration_replaces_and_takes_objects():
    reg = Registry("drafter", {"x": "collections:deque"})

    class Mine:
        pass

    reg.register("x", Mine, doc="mine")
    assert reg.get("x") is Mine and reg.doc("x") == "mine"
    reg.register("dotted", "collections:OrderedDict.fromkeys")
    assert reg.get("dotted") == collections.OrderedDict.fromkeys
    with pytest.raises(ValueError, match="module:attribute"):
        reg.register("bad", "no_colon")


def test_config_fields_take_their_choices_from_the_registry(monkeypatch):
    """A plug-in field (services.config.plugin): argparse offers the registry's names, an environment
    value or a config built in code is checked against it, and a name registered later is accepted."""
    import argparse

    from services import config as cfg
    from services.router.config import RouterConfig
    from services.router.policy import POLICIES
    from services.up.config import UpConfig

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, UpConfig)
    help_text = parser.format_help()
    assert "--router-policy {kv,least_loaded,random,round_robin}" in help_text
    assert "--reasoning-parser {deepseek_r1,qwen3,none}" in help_text  # optional: none turns it off
    assert "--speculative {auto,off,model,ngram}" in help_text  # extra choices first
    assert cfg.build(UpConfig, parser.parse_args(["--reasoning-parser", "none"])).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "xml"])
    with pytest.raises(cfg.ConfigError, match="UpConfig.tool_call_parser: unknown tool-call parser 'xml'; "
                                              "choose one of: hermes, llama3_json"):
        cfg.build(UpConfig, {}, {"KVBUS_TOOL_CALL_PARSER": "xml"})
    with pytest.raises(cfg.ConfigError, match="choose one of: auto, off, model, ngram"):
        UpConfig(speculative="medusa")

    monkeypatch.setattr(POLICIES, "_targets", dict(POLICIES._targets))  # undone after the test
    monkeypatch.setattr(POLICIES, "_docs", dict(POLICIES._docs))
    with pytest.raises(cfg.ConfigError, match="unknown router policy 'mine'"):
        RouterConfig(policy="mine")
    POLICIES.register("mine", "services.router.policy:POLICIES", doc="a third party's")
    assert RouterConfig(policy="mine").policy == "mine"
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, RouterConfig)
    assert "mine: a third party's" in " ".join(parser.format_help().split())  # (argparse wraps lines)
