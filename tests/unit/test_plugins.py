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
