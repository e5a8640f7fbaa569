"""bench/decode_attention_bench.py's child run: the timing it reports is of real native calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_child_times_every_case():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_attention_bench.py"), "--child", "--steps", "2",
                          "--cases", "1x40", "2x70"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-2000:]
    times = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(times) == {"1x40", "2x70"} and all(t > 0 for t in times.values())
