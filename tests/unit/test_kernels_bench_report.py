"""bench/kernels_bench.py --against: each case's time in both checkouts and the median of each
round's own ratio."""

from __future__ import annotations

from bench.kernels_bench import against_report


def _row(text: str, case: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {case} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_rounds_report_medians_and_the_median_of_each_rounds_own_ratio():
    # (reference us, native us) per case, (before, after) per round; the native ratios are 0.9,
    # 1.2 and 0.8: their median (0.9) is not the ratio of the medians (90 / 100)
    rounds = [({"attn": (200.0, 100.0)}, {"attn": (210.0, 90.0)}),
              ({"attn": (180.0, 80.0)}, {"attn": (180.0, 96.0)}),
              ({"attn": (220.0, 120.0)}, {"attn": (200.0, 96.0)})]
    text = against_report(rounds, "@abc123", "this")
    assert "@abc123 native us" in text and "this / @abc123" in text
    case, before, after, ratio, reference = _row(text, "attn")
    assert (before, after) == ("100.0", "96.0")
    assert ratio == "0.900x (0.90 1.20 0.80)"
    assert reference == "1.000x"  # 1.05, 1.00, 0.91


def test_a_case_without_a_native_kernel_in_either_checkout_is_left_out():
    rounds = [({"norm": (50.0, None), "attn": (200.0, 100.0)}, {"norm": (55.0, None), "attn": (200.0, 50.0)})]
    text = against_report(rounds, "@old", "this")
    assert "norm" not in text
    assert _row(text, "attn")[3] == "0.500x (0.50)"
