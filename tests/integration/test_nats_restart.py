"""nats-server restarted under load: every service reconnects by itself and serving resumes.

A real nats-server on a fixed free port is stopped while requests are in flight and started
again on the same port. Requests in flight end (an error, or a complete reply) within their
own timeouts; none hangs. Serving resumes within 5 s of the server's return.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from bus.errors import BusError
from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE, GENERATE_ONCE
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from services.local_system import LocalSystem
from services.natsd import free_port, wait_port
from tests.leaks import Snapshot, engine_states

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
PROMPT = "Tell me about the history of rivers:"
RESUME_WITHIN_S = 5.0


def nats_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["nats-server", "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, 10)
    return proc


async def test_services_reconnect_and_serving_resumes_after_nats_restart(model_dir):
    port = free_port()
    server = nats_server(port)
    url = f"nats://127.0.0.1:{port}"
    system = None
    try:
        with LocalSystem("--aggregated", "--nats-url", url, "--num-threads", "1",
                         "--engine-args", "--heartbeat-interval 0.5", model_dir=model_dir) as system:
            bus = await connect(BusConfig(nats_url=url, request_timeout=30))
            try:
                workers = [("worker", "worker-0")]
                snapshot = Snapshot(bus, workers)
                long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
                medium = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

                async def streamed() -> str:
                    try:
                        async with bus.stream(GENERATE, GenerateRequest(prompt=PROMPT, sampling=long),
                                              timeout=10) as chunks:
                            async for _ in chunks:
                                pass
                        return "complete"
                    except BusError as exc:
                        print("stream across the restart:", exc.code.value, exc.message)
                        return exc.code.value

                async def once() -> str:
                    try:
                        await bus.request(GENERATE_ONCE, GenerateRequest(prompt=PROMPT, sampling=medium), timeout=20)
                        return "complete"
                    except BusError as exc:
                        print("generate.once across the restart:", exc.code.value, exc.message)
                        return exc.code.value

                inflight = [asyncio.create_task(streamed()), asyncio.create_task(once())]
                await asyncio.sleep(1.0)  # both running
                t_stop = time.monotonic()
                server.terminate()
                server.wait(10)
                await asyncio.sleep(1.0)
                server = nats_server(port)
                t_back = time.monotonic()

                # serving resumes: the first success counted from the server's return (probed meanwhile)
                short = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=2))

                async def first_success() -> float:
                    while True:
                        try:
                            await bus.request(GENERATE_ONCE, short, timeout=2.0)
                            return time.monotonic() - t_back
                        except BusError:
                            assert time.monotonic() - t_back < 60, "serving did not resume"
                            await asyncio.sleep(0.1)

                probe = asyncio.create_task(first_success())
                # in-flight requests end within their timeouts (10 s per chunk, 20 s per call), never hang:
                # the call's reply or its timeout; the stream goes on after the reconnect, or stalls and ends
                once_outcome = await asyncio.wait_for(inflight[1], timeout=25)
                assert once_outcome in ("complete", "timeout", "unavailable"), once_outcome
                assert time.monotonic() - t_stop < 25
                stream_outcome = await asyncio.wait_for(inflight[0], timeout=120)
                assert stream_outcome in ("complete", "timeout", "unavailable"), stream_outcome
                print(f"in flight across the restart: generate.once -> {once_outcome}, stream -> {stream_outcome}")
                resumed = await probe
                print(f"serving resumed {resumed:.2f}s after nats-server returned")
                assert resumed < RESUME_WITHIN_S, f"serving resumed only after {resumed:.1f}s"
                await snapshot.assert_no_leaks()
                assert all((await engine_states(bus, workers)).values())
            finally:
                await bus.close()
            # then nats-server goes away for good, and kvbus up stops: every service drains without it
            server.terminate()
            server.wait(10)
            t_exit = time.monotonic()
            system.__exit__(None, None, None)
            assert system.proc.returncode == 0 and time.monotonic() - t_exit < 45, system.log(60)
        assert "Traceback" not in "\n".join(system.lines), system.log(200)
    finally:
        server.terminate()
        server.wait(10)
