"""``kvbus up``: nats-server and every service as local processes, ready to call.

Starts nats-server (unless ``--nats-url`` points at one), prepares the model,
starts each role's replicas, waits for their health subjects, serves a first
real request, prints where everything is, streams logs with a role prefix, and
on Ctrl-C stops the services, then nats-server last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

from bus.nats_transport import BusConfig


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def say(text: str) -> None:
    print(f"[kvbus] {text}", flush=True)


class Supervisor:
    def __init__(self, quiet: bool = False):
        self.children: list[Child] = []
        self.quiet = quiet

    async def start(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **child.extra_env}
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop children in order
        )
        child.pump = asyncio.create_task(self._pump(child))
        self.children.append(child)

    async def _pump(self, child: Child) -> None:
        assert child.proc and child.proc.stdout
        width = max(12, len(child.name))
        async for line in child.proc.stdout:
            if not self.quiet:
                sys.stdout.write(f"{child.name:<{width}} | {line.decode(errors='replace')}")
                sys.stdout.flush()

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.returncode is not None]

    async def stop(self, child: Child, timeout: float = 20.0) -> None:
        if child.proc is None or child.proc.returncode is not None:
            return
        child.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.proc.wait(), timeout)
        except asyncio.TimeoutError:
            child.proc.kill()
            await child.proc.wait()
        if child.pump:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.pump, 2)

    async def stop_all(self, last: Child | None = None) -> None:
        services = [c for c in self.children if c is not last]
        await asyncio.gather(*(self.stop(c) for c in services))
        if last is not None:
            await self.stop(last)


async def wait_ready(bus, roles: dict[str, list[str]], supervisor: Supervisor, timeout: float) -> None:
    """Poll each worker's health subject until it answers ready."""
    from bus.errors import BusError
    from bus.subjects import WORKER_HEALTH
    from schemas.common import HealthRequest

    pending = {(role, wid) for role, ids in roles.items() for wid in ids}
    deadline = time.monotonic() + timeout
    while pending:
        dead = supervisor.dead()
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f}s: {sorted(w for _, w in pending)}")
        for role, wid in list(pending):
            with contextlib.suppress(BusError):
                reply = await bus.request(WORKER_HEALTH, HealthRequest(), timeout=1.0, role=role, worker_id=wid)
                if reply.ready:
                    pending.discard((role, wid))
        if pending:
            await asyncio.sleep(0.25)


async def first_request(bus) -> str:
    """The request that proves the system serves: a real call through the bus."""
    from bus.subjects import TOKENIZER_ENCODE
    from schemas.tokenizer import EncodeRequest

    text = "Hello from kvbus!"
    reply = await bus.request(TOKENIZER_ENCODE, EncodeRequest(text=text), timeout=30)
    return f"{TOKENIZER_ENCODE.template} {{\"text\": \"{text}\"}} -> {reply.ids}"


async def up(args: argparse.Namespace) -> int:
    from bus.nats_transport import connect
    from services.models import ModelError, resolve_model

    supervisor = Supervisor(quiet=args.quiet)
    nats_child: Child | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    try:
        model_dir = await asyncio.to_thread(resolve_model, args.model)
    except ModelError as exc:
        say(f"error: {exc}")
        return 1
    say(f"model: {model_dir}")

    nats_url = args.nats_url or os.environ.get("NATS_URL")
    try:
        if not nats_url:
            server = shutil.which("nats-server")
            if server is None:
                say("error: nats-server is not on PATH: install it with `apt-get install -y nats-server` "
                    "or pass --nats-url to use a running server")
                return 1
            port = args.nats_port or free_port()
            if port_is_taken(port):
                say(f"error: port {port} is taken; pass --nats-port 0 for a free one or --nats-url to use "
                    "the server there")
                return 1
            nats_url = f"nats://127.0.0.1:{port}"
            nats_child = Child("nats-server", [server, "-a", "127.0.0.1", "-p", str(port)])
            await supervisor.start(nats_child)
            for _ in range(100):
                if port_is_taken(port):
                    break
                await asyncio.sleep(0.05)
        say(f"NATS: {nats_url}")

        roles: dict[str, list[str]] = {"tokenizer": [f"tokenizer-{i}" for i in range(args.tokenizers)]}
        py = sys.executable
        for role, ids in roles.items():
            for wid in ids:
                argv = [py, "-m", "services.cli", "serve", role, "--worker-id", wid, "--nats-url", nats_url,
                        "--model", str(model_dir)]
                await supervisor.start(Child(wid, argv))

        bus = await connect(BusConfig(nats_url=nats_url))
        try:
            t0 = time.monotonic()
            waiter = asyncio.create_task(wait_ready(bus, roles, supervisor, args.ready_timeout))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                waiter.cancel()
                say("interrupted during start-up")
                return 130
            stopper.cancel()
            waiter.result()
            result = await first_request(bus)
            say(f"ready in {time.monotonic() - t0:.1f}s: "
                + ", ".join(f"{len(ids)} {role}" for role, ids in roles.items()))
            say(f"served: {result}")
            say(f"call it:  kvbus call {result.split(' ', 1)[0]} '{{\"text\": \"your text\"}}' --nats-url {nats_url}")
            say("traces: set OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4318) before `kvbus up`")
            if args.exit_after_ready:
                return 0
            say("Ctrl-C stops everything")
            while not stop.is_set():
                dead = supervisor.dead()
                if dead:
                    say(f"{dead[0].name} exited with code {dead[0].proc.returncode}; stopping")
                    return 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            return 0
        finally:
            await bus.close()
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        say("stopping services" + (", then nats-server" if nats_child else ""))
        await supervisor.stop_all(last=nats_child)
        say("stopped")


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvbus up", description=__doc__)
    parser.add_argument("--model", default=os.environ.get("KVBUS_MODEL"),
                        help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, prepared on first use)")
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    parser.add_argument("--nats-port", type=int, default=4222, help="port for the started nats-server (0: free port)")
    parser.add_argument("--tokenizers", type=int, default=1, help="tokenizer replicas")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--exit-after-ready", action="store_true",
                        help="stop everything once the first request was served (smoke test)")
    parser.add_argument("--quiet", action="store_true", help="don't stream service logs")
    args = parser.parse_args(argv)
    if args.tokenizers < 1:
        parser.error("--tokenizers must be >= 1")
    return asyncio.run(up(args))
