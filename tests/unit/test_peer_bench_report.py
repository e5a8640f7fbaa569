"""bench/peer_bench.py's table: medians over cycles and each cycle's own ratio against the baseline."""

from __future__ import annotations

import argparse

from bench.common import against_label
from bench.peer_bench import baseline, ratio_pairs, report


def _q() -> argparse.Namespace:
    return argparse.Namespace(workloads=["agentic"], agentic_conversations=4, agentic_rounds=6, concurrency=[])


def _run(system: str, wall: float, errors: int = 0) -> dict:
    return {"system": system, "ready_s": 10.0, "errors": errors,
            "workloads": {"agentic": {"metrics": {"wall_s": wall}}}}


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if label in line)
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_baseline_is_vllm_when_it_ran_else_the_first_system():
    assert baseline(["kvbus-aggregated", "vllm", "kvbus-1p1d"]) == "vllm"
    assert baseline(["kvbus-aggregated", "kvbus-1p1d"]) == "kvbus-aggregated"


def test_one_cycle_reports_its_values_and_ratios():
    text = report([{"kvbus-aggregated": _run("kvbus-aggregated", 40.0), "kvbus-1p1d": _run("kvbus-1p1d", 44.0)}], _q())
    assert "kvbus-1p1d / kvbus-aggregated" in text
    assert _row(text, "wall time") == ["agentic 4x6 turns: wall time s (lower better)", "40.00", "44.00", "1.10x"]


def test_cycles_report_medians_and_the_median_of_each_cycles_own_ratio():
    # the cycles' ratios are 1.10, 0.90 and 1.25: their median (1.10) is not the ratio of the medians
    walls = [(40.0, 44.0), (50.0, 45.0), (36.0, 45.0)]
    cycles = [{"kvbus-aggregated": _run("kvbus-aggregated", a, errors=1), "kvbus-1p1d": _run("kvbus-1p1d", b)}
              for a, b in walls]
    text = report(cycles, _q())
    assert _row(text, "wall time") == ["agentic 4x6 turns: wall time s (lower better)", "40.00", "45.00",
                                       "1.10x (1.10 0.90 1.25)"]
    assert _row(text, "failed requests") == ["failed requests (lower better)", "3", "0", "-"]  # totals, no ratio
    assert "3 cycles" in text


def test_with_another_checkout_each_system_reads_against_its_twin():
    assert ratio_pairs(["vllm", "kvbus-aggregated@abc1234", "kvbus-aggregated", "kvbus-1p1d@abc1234", "kvbus-1p1d"]) == [
        ("kvbus-aggregated", "kvbus-aggregated@abc1234"), ("kvbus-1p1d", "kvbus-1p1d@abc1234")]
    assert ratio_pairs(["vllm", "kvbus-aggregated"]) == [("kvbus-aggregated", "vllm")]
    runs = {"kvbus-aggregated@abc1234": _run("kvbus-aggregated@abc1234", 40.0), "kvbus-aggregated": _run("kvbus-aggregated", 36.0),
            "kvbus-1p1d@abc1234": _run("kvbus-1p1d@abc1234", 50.0), "kvbus-1p1d": _run("kvbus-1p1d", 55.0)}
    text = report([runs], _q())
    assert "kvbus-aggregated / kvbus-aggregated@abc1234" in text and "kvbus-1p1d / kvbus-1p1d@abc1234" in text
    assert _row(text, "wall time")[-2:] == ["0.90x", "1.10x"]


def test_against_names_the_other_checkout_by_its_commit(tmp_path):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert against_label(root) == "@" + head.stdout.strip()
    assert against_label(tmp_path) == "@" + tmp_path.name  # not a git checkout
