"""The gateway's Prometheus series for speculative decoding, fed from finished requests' usage."""

from __future__ import annotations

from schemas.engine import Usage
from services.gateway.metrics import GatewayMetrics


def _series(metrics: GatewayMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvbus_spec_decode_")}


def test_speculating_requests_feed_acceptance_length_and_draft_share():
    m = GatewayMetrics()
    m.observe_usage(Usage(prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=40, draft_tokens=30,
                          accepted_draft_tokens=20, mean_accepted_length=2.25, draft_seconds=0.1), decode_seconds=1.0)
    m.observe_usage(Usage(prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=8, draft_tokens=4,
                          accepted_draft_tokens=1, mean_accepted_length=1.5, draft_seconds=0.6), decode_seconds=0.5)
    s = _series(m)
    assert s["kvbus_spec_decode_num_draft_tokens_total"] == 34
    assert s["kvbus_spec_decode_num_accepted_tokens_total"] == 21
    assert s["kvbus_spec_decode_accept_length_count"] == 2
    assert s["kvbus_spec_decode_accept_length_sum"] == 3.75
    assert s['kvbus_spec_decode_accept_length_bucket{le="1.5"}'] == 1
    assert s['kvbus_spec_decode_accept_length_bucket{le="2.5"}'] == 2
    # shares 0.1 and 1.2 -> clamped to 1.0
    assert s["kvbus_spec_decode_draft_time_share_sum"] == 1.1
    assert s['kvbus_spec_decode_draft_time_share_bucket{le="0.1"}'] == 1


def test_plain_requests_leave_the_speculative_series_at_zero():
    m = GatewayMetrics()
    m.observe_usage(Usage(prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=40), decode_seconds=1.0)
    s = _series(m)
    assert s["kvbus_spec_decode_num_draft_tokens_total"] == 0
    assert s["kvbus_spec_decode_accept_length_count"] == 0
    assert s["kvbus_spec_decode_draft_time_share_count"] == 0


def _sample(metrics: GatewayMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_tpot_is_decode_time_over_the_tokens_after_the_first():
    m = GatewayMetrics()
    m.observe_usage(Usage(prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=11), decode_seconds=0.5)
    m.observe_usage(Usage(prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=1), decode_seconds=0.0)
    assert _sample(m, "kvbus_request_time_per_output_token_seconds_count") == 1  # one token: no TPOT
    assert _sample(m, "kvbus_request_time_per_output_token_seconds_sum") == 0.05


def test_migrations_are_read_from_the_pipeline_at_scrape_time():
    counts = [0, 0]
    m = GatewayMetrics(migrations=lambda: tuple(counts))
    assert _sample(m, "kvbus_migrations_total") == 0 and _sample(m, "kvbus_migrations_failed_total") == 0
    counts[:] = [3, 1]
    assert _sample(m, "kvbus_migrations_total") == 3 and _sample(m, "kvbus_migrations_failed_total") == 1
