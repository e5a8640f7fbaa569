"""The flow of ``kvbus up``: prepare the model, start nats-server, plan and start the services, wait
until they serve, supervise until Ctrl-C, stop everything in order.

Each step's job lives in its own module: the configuration (config.py), the processes and their flags
(roles.py), the cores and ports (placement.py), starting and restarting (supervisor.py), readiness
(readiness.py) and what is printed (report.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from bus.nats_transport import BusConfig
from services import config as cfg
from services.natsd import free_port, port_is_taken
from services.up import prometheus
from services.up.config import UpConfig, parse
from services.up.placement import make_lease_file
from services.up.readiness import first_request, wait_ready
from services.up.report import SERVING, say, say_nats, say_placement, say_ready, say_scrape_config, \
    traces_destination
from services.up.roles import ENGINE_ROLES, Plan, Site, plan
from services.up.supervisor import Child, Supervisor

STOP_POLL_S = 0.5
"""How often a ready ``kvbus up`` looks for dead children to restart."""


async def start_nats(config: UpConfig, supervisor: Supervisor) -> tuple[str, Child | None]:
    """The NATS URL to use, and the nats-server child started for it (None: one was given)."""
    nats_url = config.nats_url or os.environ.get("NATS_URL")
    if nats_url:
        return nats_url, None
    server = shutil.which("nats-server")
    if server is None:
        raise RuntimeError("nats-server is not on PATH: install it with `apt-get install -y nats-server` "
                           "or pass --nats-url to use a running server")
    port = config.nats_port or free_port()
    if port_is_taken(port):
        raise RuntimeError(f"port {port} is taken; pass --nats-port 0 for a free one or --nats-url to use "
                           "the server there")
    child = Child("nats-server", [server, "-a", "127.0.0.1", "-p", str(port)])
    await supervisor.start(child)
    for _ in range(100):
        if port_is_taken(port):
            break
        await asyncio.sleep(0.05)
    return f"nats://127.0.0.1:{port}", child


async def start_trace_receiver(config: UpConfig, supervisor: Supervisor) -> tuple[str, str, Child]:
    """``--trace``: the local OTLP/HTTP receiver (services/traces/receiver.py) on a free port; its
    endpoint, its file and its child."""
    from services.traces import default_file

    path = str(Path(config.trace_file).expanduser()) if config.trace_file else str(default_file())
    port = free_port()
    child = Child("traces", [sys.executable, "-m", "services.traces.receiver", "--port", str(port), "--file", path])
    await supervisor.start(child)
    for _ in range(200):
        if port_is_taken(port):
            return f"http://127.0.0.1:{port}", path, child
        if child.proc.returncode is not None:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the trace receiver did not listen on port {port}")


def traces_endpoint(config: UpConfig) -> str | None:
    """Where the services export spans without --trace: their environment's endpoint, if any."""
    return os.environ.get("KVBUS_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def http_port(config: UpConfig) -> int:
    """The gateway's port: the configured one if free, or a free one for 0."""
    if config.http_port == 0:
        return free_port()
    if port_is_taken(config.http_port) and not config.tokenizer_only:
        raise RuntimeError(f"HTTP port {config.http_port} is taken; pass --http-port 0 for a free one")
    return config.http_port


async def start_services(config: UpConfig, site: Site, supervisor: Supervisor) -> Plan:
    planned = plan(config, site)
    num_engines = sum(len(planned.roles.get(role, [])) for role in ENGINE_ROLES)
    say_placement(planned.layout, planned.layout_why, planned.core_sharing, num_engines,
                  None if config.tokenizer_only else config.speculation())
    if num_engines:
        say("dtype: {} ({})".format(*config.engine_dtype()))
    for child in planned.children:
        if child.cpus:
            say(f"{child.name}: cores {','.join(map(str, sorted(child.cpus)))}")
        await supervisor.start(child)
    return planned


def write_scrape_config(config: UpConfig, planned: Plan, http_port: int) -> None:
    """``--prometheus-config``: every /metrics endpoint started, at the ports chosen at start."""
    targets = prometheus.scrape_targets(planned.roles, planned.children, metrics_host=config.metrics_host,
                                        http_host=config.http_host, http_port=http_port)
    try:
        prometheus.write(config.prometheus_config, targets)
    except OSError as exc:
        raise RuntimeError(f"--prometheus-config {config.prometheus_config}: {exc.strerror or exc}") from None
    say_scrape_config(config.prometheus_config, sum(len(found) for found in targets.values()))


async def ready_unless_stopped(bus, planned: Plan, supervisor: Supervisor, timeout: float,
                               stop: asyncio.Event) -> bool:
    """Wait until every service is ready (True), or until ``stop`` is set first (False)."""
    waiter = asyncio.create_task(wait_ready(bus, planned.roles, supervisor, timeout))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        waiter.cancel()
        return False
    stopper.cancel()
    waiter.result()
    return True


async def supervise_until(stop: asyncio.Event, supervisor: Supervisor) -> None:
    while not stop.is_set():
        await supervisor.supervise()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_POLL_S):
                await stop.wait()


async def up(config: UpConfig) -> int:
    from bus.nats_transport import connect
    from services.models import ModelError, resolve_model

    supervisor = Supervisor(quiet=config.quiet, stop_timeout=config.drain_timeout + 10.0)
    lease_file: str | None = None
    nats_child: Child | None = None
    receiver: Child | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    try:
        model_dir = await asyncio.to_thread(resolve_model, config.model)
    except ModelError as exc:
        say(f"error: {exc}")
        return 1
    say(f"model: {model_dir}")

    try:
        nats_url, nats_child = await start_nats(config, supervisor)
        say_nats(nats_url)
        port = http_port(config)
        lease_file = make_lease_file()
        trace_file = None
        otlp_endpoint = traces_endpoint(config)
        if config.trace:
            otlp_endpoint, trace_file, receiver = await start_trace_receiver(config, supervisor)
        site = Site(nats_url=nats_url, model_dir=str(model_dir), http_port=port, lease_file=lease_file,
                    otlp_endpoint=otlp_endpoint if config.trace else None)
        planned = await start_services(config, site, supervisor)
        if config.prometheus_config:
            write_scrape_config(config, planned, port)

        bus = await connect(cfg.build(BusConfig, {"nats_url": nats_url}))  # KVBUS_NATS_* auth/TLS, as the services
        try:
            t0 = time.monotonic()
            if not await ready_unless_stopped(bus, planned, supervisor, config.ready_timeout, stop):
                say("interrupted during start-up")
                return 130
            served = await first_request(bus, planned.roles)
            say_ready(elapsed_s=time.monotonic() - t0, roles=planned.roles, served=served, nats_url=nats_url,
                      http_host=config.http_host, http_port=port, metrics_host=config.metrics_host,
                      metrics_ports={c.name: c.metrics_port for c in planned.children if c.metrics_port is not None},
                      traces=traces_destination(trace_file, otlp_endpoint, config.trace_sample_ratio))
            if config.exit_after_ready:
                return 0
            say(SERVING)
            await supervise_until(stop, supervisor)
            return 0
        finally:
            await bus.close()
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        say("stopping services" + (", then nats-server" if nats_child else ""))
        await supervisor.stop_all(last=nats_child, after_services=(receiver,) if receiver else ())
        if lease_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(lease_file)
        say("stopped")


def up_main(argv: list[str]) -> int:
    from services import up as package

    return asyncio.run(up(parse(argv, description=package.__doc__)))
