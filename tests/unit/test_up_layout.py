"""kvbus up's choices for the machine it finds: the layout and each engine worker's cores."""

from __future__ import annotations

import argparse

import pytest

from services.up import DISAGG_MIN_CORES, choose_layout, split_cores


def _args(**kw) -> argparse.Namespace:
    base = dict(aggregated=False, layout="auto", prefill=None, decode=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("cores,want", [(1, "aggregated"), (2, "aggregated"), (DISAGG_MIN_CORES - 1, "aggregated"),
                                        (DISAGG_MIN_CORES, "disaggregated"), (64, "disaggregated")])
def test_auto_layout_goes_by_cores(cores, want):
    layout, why = choose_layout(_args(), cores)
    assert layout == want and why.startswith("auto")


def test_explicit_layout_wins_over_cores():
    assert choose_layout(_args(aggregated=True), 64)[0] == "aggregated"
    assert choose_layout(_args(layout="aggregated"), 64)[0] == "aggregated"
    assert choose_layout(_args(prefill=2), 2)[0] == "disaggregated"
    assert choose_layout(_args(decode=1), 2)[0] == "disaggregated"
    assert choose_layout(_args(layout="disaggregated"), 1) == ("disaggregated", "asked for")


def test_one_engine_takes_every_core():
    assert split_cores([0, 1, 2, 3], ["worker-0"], share=False) == {"worker-0": (None, 0)}


def test_engines_get_disjoint_slices_decode_takes_the_rest():
    got = split_cores(list(range(7)), ["prefill-0", "decode-0"], share=False)
    assert got == {"prefill-0": (frozenset({0, 1, 2}), 3), "decode-0": (frozenset({3, 4, 5, 6}), 4)}
    got = split_cores([4, 5], ["prefill-0", "decode-0"], share=False)  # the cores we may use, not 0..n
    assert got == {"prefill-0": (frozenset({4}), 1), "decode-0": (frozenset({5}), 1)}


def test_sharing_or_too_few_cores_divides_threads():
    assert split_cores([0, 1, 2, 3], ["p", "d"], share=True) == {"p": (None, 2), "d": (None, 2)}
    assert split_cores([0, 1], ["p0", "p1", "d"], share=False) == {"p0": (None, 1), "p1": (None, 1), "d": (None, 1)}
