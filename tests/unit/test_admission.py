"""Admission control: the queue is bounded by count and by expected wait (no engine, no clock)."""

from __future__ import annotations

import pytest

from bus.errors import Overloaded
from services.workers.admission import Admission


def test_count_bound_before_any_service_time_is_known():
    a = Admission(max_running=4, max_queue=2, max_queue_wait=30.0)
    for n in range(6):
        a.check(n, None, "w")
    with pytest.raises(Overloaded, match="full: 6 requests") as info:
        a.check(6, None, "w")
    assert info.value.retry_after >= 0.5 and a.num_refused == 1


def test_expected_wait_from_mean_service_time():
    a = Admission(max_running=4, max_queue=100, max_queue_wait=10.0)
    a.observe_finished(8.0)
    assert a.expected_wait(3) == 0.0  # a slot is free
    assert a.expected_wait(4) == pytest.approx(2.0)  # one must finish: 8 s / 4 slots
    assert a.expected_wait(7) == pytest.approx(8.0)
    a.check(8, None, "w")  # 10 s: at the bound, still taken
    with pytest.raises(Overloaded, match="expected queue wait 12.0s exceeds max_queue_wait=10s") as info:
        a.check(9, None, "w")
    assert info.value.retry_after == pytest.approx(2.0)


def test_deadline_refuses_what_could_not_finish_in_time():
    a = Admission(max_running=2, max_queue=100, max_queue_wait=100.0)
    a.observe_finished(4.0, num_tokens=40)  # 0.1 s per token
    a.check(1, 4.5, "w", max_tokens=40)  # starts at once, done in ~4 s
    a.check(1, 3.0, "w", max_tokens=20)  # a short one fits a short deadline
    with pytest.raises(Overloaded, match="deadline"):
        a.check(1, 3.0, "w", max_tokens=40)
    with pytest.raises(Overloaded, match="deadline"):
        a.check(3, 5.0, "w", max_tokens=20)  # waits ~4 s, then 2 s of service
    a.check(3, 5.0, "w")  # no max_tokens: only its start must fit


def test_moving_average_follows_recent_service_times():
    a = Admission(max_running=1, max_queue=1, max_queue_wait=1.0)
    a.observe_finished(10.0)
    for _ in range(40):
        a.observe_finished(1.0)
    assert a.mean_service_s == pytest.approx(1.0, abs=0.01)


def test_retry_after_travels_in_headers():
    from bus.errors import error_from_headers

    headers = Overloaded("busy", retry_after=2.5).to_headers()
    again = error_from_headers(headers)
    assert isinstance(again, Overloaded) and again.retry_after == 2.5
    assert error_from_headers(Overloaded("busy").to_headers()).retry_after is None
