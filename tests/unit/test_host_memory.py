"""services.engine.host_memory: freed activation memory stays mapped, so a step stops page-faulting it in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One prefill's activation pattern (the default model's shapes at 1,024 tokens): per layer, buffers
# of 2-13 MB allocated and freed in turn. Prints the minor page faults of one step after warm-up.
SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from services.engine.host_memory import keep_freed_memory
    assert keep_freed_memory()
torch.set_num_threads(1)
def step():
    h = torch.ones(1024, 576)
    for _ in range(30):
        qkv = torch.empty(1024, 960).fill_(1.0)
        a = torch.empty(1024, 576).fill_(1.0); del qkv
        o = torch.empty(1024, 576).fill_(1.0); del a
        h = h + o; del o
        gu = torch.empty(1024, 3072).fill_(1.0)
        act = torch.empty(1024, 1536).fill_(1.0); del gu
        d = torch.empty(1024, 576).fill_(1.0); del act
        h = h + d; del d
step(); step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 5)
"""


def _faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_activations_stay_mapped():
    # each in its own process: the setting is process-wide and never undone
    plain, kept = _faults_per_step("plain"), _faults_per_step("keep")
    assert kept * 3 < plain, (plain, kept)
