"""The core lease across processes (services/engine/core_lease.py): the kernel drops a killed
holder's lock, so the other engines on the host go on."""

from __future__ import annotations

import subprocess
import sys

from services.engine.core_lease import CoreLease


def test_a_killed_holder_does_not_block_the_others(tmp_path):
    path = str(tmp_path / "cores.lease")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from services.engine.core_lease import CoreLease; "
         f"CoreLease({path + ':0'!r}).acquire(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait()
        b = CoreLease(f"{path}:1")
        b.acquire()  # the kernel dropped the dead holder's lock
        b.release()
        b.close()
    finally:
        holder.kill()
        holder.wait()
