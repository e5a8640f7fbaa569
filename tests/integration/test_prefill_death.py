"""A prefill worker that dies (or freezes) while it holds a request, on the real 1P1D system.

The decode worker watches the prefill worker's heartbeats: the request is prefilled locally
about peer_ttl (3 s) after the last beat, not after the 30 s transfer timeout. kvbus up then
restarts the killed prefill worker, and no page or segment is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE_ONCE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from services.local_system import LocalSystem
from tests.leaks import Snapshot, engine_states, pid_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
WORKERS = [("prefill", "prefill-0"), ("decode", "decode-0")]
PROMPT = "Summarize the history of the river city and its bridges, " * 12  # well above min_disagg_tokens



async def test_a_frozen_then_killed_prefill_worker_costs_seconds_and_is_restarted(model_dir):
    # --local-prefill-tokens 0: every prompt goes to the prefill worker (on this small host kvbus up
    # would keep short ones on the decode worker); least_loaded: the kv policy would prefill the resent
    # prompt on the decode worker that holds its pages, and the frozen prefill worker would never be asked
    with LocalSystem("--prefill", "1", "--decode", "1", "--num-threads", "1", "--router-policy", "least_loaded",
                     "--engine-args", "--heartbeat-interval 0.5 --local-prefill-tokens 0", model_dir=model_dir) as system:
        bus = await connect(BusConfig(nats_url=system.nats_url, request_timeout=60))
        try:
            snapshot = Snapshot(bus, WORKERS)
            req = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=8))
            want = (await bus.request(GENERATE_ONCE, req)).token_ids  # through the prefill worker
            victim = pid_of(system, "prefill-0")
            os.kill(victim, signal.SIGSTOP)  # frozen: takes the request, never answers, never beats
            try:
                t0 = time.monotonic()
                got = (await bus.request(GENERATE_ONCE, req)).token_ids
                took = time.monotonic() - t0
            finally:
                os.kill(victim, signal.SIGKILL)
            assert got == want
            assert took < 20, f"{took:.1f}s: waited for the transfer timeout, not for the heartbeats"
            decode = (await bus.request(WORKER_HEALTH, HealthRequest(), role="decode", worker_id="decode-0")).detail
            assert decode["prefill_failures"] == "1" and int(decode["local_prefills"]) >= 1, decode
            deadline = time.monotonic() + 120
            while not all((await engine_states(bus, WORKERS)).values()):
                assert time.monotonic() < deadline, "the killed prefill worker was not restarted"
                await asyncio.sleep(0.5)
            assert "prefill-0 restarted (pid" in system.log(400)
            await snapshot.assert_no_leaks()
        finally:
            await bus.close()
