"""Run one actor as a service: connect, set up, bind, announce, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from bus import Bus
from bus.discovery import announce
from bus.nats_transport import BusConfig, connect
from bus.subjects import HEALTH, WORKER_HEALTH
from bus.tracing import TracingConfig, install_log_context, setup_tracing, shutdown_tracing
from schemas.common import HealthReply, HealthRequest
from services.actor import VERSION, Actor

log = logging.getLogger(__name__)


async def bind_health(bus: Bus, actor: Actor) -> None:
    async def handle_health(req: HealthRequest) -> HealthReply:
        return HealthReply(
            role=actor.role, worker_id=actor.worker_id, ready=actor.is_ready, version=VERSION,
            uptime_s=round(time.monotonic() - actor.started_at, 3), num_inflight=bus.num_inflight,
            detail=actor.health_detail(),
        )

    await bus.serve(HEALTH, handle_health, queue=False, role=actor.role)
    await bus.serve(WORKER_HEALTH, handle_health, queue=False, role=actor.role, worker_id=actor.worker_id)


async def run_actor(actor: Actor, bus_config: BusConfig, *, drain_timeout: float = 30.0,
                    stop: asyncio.Event | None = None, tracing_config: TracingConfig | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then drain and exit.

    At start: the request id on every log line (bus/tracing/logs.py) and, with an OTLP endpoint
    (``tracing_config``, or the environment), spans exported as ``kvbus-ROLE``."""
    install_log_context()
    setup_tracing(f"kvbus-{actor.role}", tracing_config, instance_id=actor.worker_id)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    bus = await connect(bus_config, name=f"kvbus-{actor.role}-{actor.worker_id}")
    t0 = time.monotonic()
    try:
        await actor.start(bus)
        await bind_health(bus, actor)
        announcement = await announce(bus, f"kvbus-{actor.role}", VERSION,
                                      {"worker_id": actor.worker_id, "role": actor.role})
        await bus.transport.flush()
        log.info("%s %s ready in %.1fs on %s", actor.role, actor.worker_id, time.monotonic() - t0,
                 bus_config.nats_url)
        await stop.wait()
        log.info("%s %s draining (%d in flight, up to %gs)", actor.role, actor.worker_id, bus.num_inflight,
                 drain_timeout)
        actor.is_ready = False
        try:
            await announcement.withdraw()
        except Exception as exc:  # NATS gone: nobody to tell; no traceback for an expected state
            log.warning("%s %s: could not withdraw the announcement: %s", actor.role, actor.worker_id,
                        exc or type(exc).__name__)
        await actor.drain(drain_timeout)
        await bus.drain(timeout=drain_timeout)
    finally:
        await actor.stop()
        await bus.close()
        shutdown_tracing()  # the last spans go out before the process does
    log.info("%s %s stopped", actor.role, actor.worker_id)
