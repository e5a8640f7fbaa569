"""The core lease (services/engine/core_lease.py): one holder at a time, a release hands the lease
to an engine that waits, a dead holder's lock is dropped by the kernel. Two CoreLease objects on
one file behave like two processes (flock locks belong to the open file, not the process); a
killed holder process: tests/integration/test_core_lease_process.py."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.config import ConfigError, EngineConfig
from services.engine.core_lease import CoreLease, parse_spec


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def _waiting(lease: CoreLease, slot: int) -> bool:
    return lease._map[2 * slot] == 1


def test_spec_is_path_and_slot():
    assert parse_spec("/tmp/x.lease:3") == ("/tmp/x.lease", 3)
    for bad in ("/tmp/x.lease", "/tmp/x.lease:", ":1", "/tmp/x:64", "/tmp/x:-1"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    with pytest.raises(ConfigError, match="core_lease"):
        EngineConfig(core_lease="no-slot")


def test_one_holder_and_a_release_hands_off_to_the_waiter(tmp_path):
    path = str(tmp_path / "cores.lease")
    a = CoreLease(f"{path}:0", handoff_timeout=30.0)
    b = CoreLease(f"{path}:1", handoff_timeout=30.0)
    order: list[str] = []
    a.acquire()
    t = threading.Thread(target=lambda: (b.acquire(), order.append("b"), b.release()))
    t.start()
    _wait_for(lambda: _waiting(a, 1))  # b is blocked on the lock
    assert order == []  # ... and cannot take it while a holds it
    a.release()  # returns only once b has taken the lease
    assert b.acquisitions == 1
    a.acquire()
    order.append("a")
    a.release()
    t.join()
    assert order == ["b", "a"]
    assert a.handoff_seconds > 0 and b.wait_seconds > 0
    a.close(), b.close()


def test_release_without_waiters_returns_at_once(tmp_path):
    a = CoreLease(f"{tmp_path / 'cores.lease'}:0", handoff_timeout=30.0)
    for _ in range(100):
        with a:
            pass
    assert a.acquisitions == 100 and a.handoff_seconds == 0.0
    a.close()


def test_a_waiter_that_never_takes_it_is_forgotten(tmp_path):
    path = str(tmp_path / "cores.lease")
    a = CoreLease(f"{path}:0", handoff_timeout=0.05)
    a._map[2 * 5] = 1  # slot 5 marked waiting by a process that died
    with a:
        pass
    assert a._map[2 * 5] == 0  # cleared after one timeout, so later releases do not wait
    a.acquire()
    a.release()
    a.close()
