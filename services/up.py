"""``kvbus up``: nats-server and every service as local processes, ready to call.

Starts nats-server (unless ``--nats-url`` points at one), prepares the model,
starts each role's replicas, waits for their health subjects, serves a first
real request, prints where everything is, streams logs with a role prefix, and
on Ctrl-C stops the services, then nats-server last.

Once ready it supervises what it started: a process that dies is logged and
restarted with exponential backoff (its replacement rejoins through its
heartbeats and health subjects). Every child dies with ``kvbus up`` even when
``kvbus up`` itself is killed with SIGKILL (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from bus.nats_transport import BusConfig
from services import config as cfg
from services.natsd import free_port, port_is_taken


@dataclass
class Child:
    name: str
    argv: list[str]
    cpus: frozenset[int] | None = None  # CPU affinity set before exec; None: inherit ours
    proc: asyncio.subprocess.Process | None = None
    pump: asyncio.Task | None = None
    num_restarts: int = 0
    """Restarts in a row (reset once a replacement stays up STABLE_AFTER_S)."""
    started_at: float = 0.0
    restart_at: float | None = None
    """When the dead process is due to be restarted (None: alive, or not yet noticed)."""
    metrics_port: int | None = None
    """Port of its Prometheus endpoint (engine workers and the kv_store)."""


RESTART_DELAY_S = 1.0
"""Delay before the first restart of a dead service; doubles per restart in a row."""
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0
"""A process up this long is healthy again: its next death restarts after RESTART_DELAY_S."""
PR_SET_PDEATHSIG = 1
_libc = None


def _child_setup(cpus: frozenset[int] | None, parent_pid: int):
    """What a child runs between fork and exec: CPU set, and death with its parent."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)  # loaded here, in the parent: nothing to load after fork
    libc = _libc

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if libc is not None:
            # SIGTERM when kvbus up dies, however it dies (services drain; nats-server stops)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before prctl took hold
                os._exit(1)

    return setup


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


DISAGG_MIN_CORES = 8
"""Fewest usable cores for which ``--layout auto`` picks 1P1D on one host. Below it prefill and
decode engines share (or split) too few cores. On the 2-core dev VM, aggregated has the lower
single-stream TPOT (0.26x vLLM's against 0.30x) and starts sooner; the agentic replay ties
(1P1D 0.97-1.01x) and 8 concurrent streams favour 1P1D by 3-5% (docs/disaggregation.md, "The last
duplicate, removed"). So auto picks aggregated there."""


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def choose_layout(args: argparse.Namespace, num_cores: int) -> tuple[str, str]:
    """(aggregated | disaggregated, why): explicit flags win; auto goes by the cores found."""
    if args.aggregated or args.layout == "aggregated":
        return "aggregated", "asked for"
    if args.layout == "disaggregated" or args.prefill is not None or args.decode is not None:
        return "disaggregated", "asked for"
    if num_cores >= DISAGG_MIN_CORES:
        return "disaggregated", f"auto: {num_cores} cores >= {DISAGG_MIN_CORES}"
    return "aggregated", (f"auto: {num_cores} cores < {DISAGG_MIN_CORES}, where one engine on every core "
                          "streams with less latency than prefill and decode engines dividing them "
                          "(--layout disaggregated to override)")


SHARED_CORES_LOCAL_PREFILL = 1024
"""Decode workers' ``--local-prefill-tokens`` where the engines share cores (lease or share): a prefill
worker there adds no compute, only the trip of the pages and the tokens it lacks (a conversation's
last answer was computed on the decode worker), so a remainder of up to this many tokens is computed
where it is decoded, mixed with the decode steps. docs/disaggregation.md has the figures."""

CORE_SHARING = ("auto", "split", "share", "lease")
LEASE_BELOW_CORES_PER_ENGINE = 4
"""--core-sharing auto takes turns (a core lease) when a split would leave an engine fewer cores."""
LEASE_SLOTS = 64  # services/engine/core_lease.py SLOTS


def core_sharing(requested: str, cores: list[int], engines: list[str]) -> str:
    """How several engines on one host use its cores: ``split`` (disjoint slices), ``share`` (all
    cores each, at the same time) or ``lease`` (all cores each, one step at a time:
    services/engine/core_lease.py). ``auto``: lease when a split would give an engine fewer than
    LEASE_BELOW_CORES_PER_ENGINE cores, else split."""
    if requested not in CORE_SHARING:
        raise ValueError(f"core sharing {requested!r}: expected one of {', '.join(CORE_SHARING)}")
    if requested != "auto":
        return requested
    if len(engines) > 1 and len(cores) // len(engines) < LEASE_BELOW_CORES_PER_ENGINE:
        return "lease"
    return "split"


def split_cores(cores: list[int], engines: list[str], policy: str) -> dict[str, tuple[frozenset[int] | None, int]]:
    """Each engine worker's (CPU set, torch threads). One engine: every core. Several on one host:
    ``split``: disjoint contiguous slices (decode workers take the remainder), so their OpenMP
    pools never fight over a core; ``share`` (or fewer cores than engines with ``split``): all
    share every core with ``cores // engines`` threads each; ``lease``: every engine gets every
    core and the engines take turns stepping."""
    if len(engines) <= 1:
        return {e: (None, 0) for e in engines}
    if policy == "lease":
        return {e: (None, len(cores)) for e in engines}
    if policy == "share" or len(cores) < len(engines):
        threads = max(1, len(cores) // len(engines))
        return {e: (None, threads) for e in engines}
    base, extra = divmod(len(cores), len(engines))
    # decode workers are listed last and take the extra cores (decode steps are latency-bound)
    sizes = [base + (1 if i >= len(engines) - extra else 0) for i in range(len(engines))]
    out, start = {}, 0
    for engine, size in zip(engines, sizes):
        out[engine] = (frozenset(cores[start:start + size]), size)
        start += size
    return out


def make_lease_file() -> str:
    """A new core-lease file, owner-only, with a name nobody could have prepared (``mkstemp``);
    `kvbus up` removes it when it stops."""
    fd, path = tempfile.mkstemp(prefix="kvbus-cores-", suffix=".lease")
    try:
        os.ftruncate(fd, 2 * LEASE_SLOTS)
    finally:
        os.close(fd)
    return path


METERED_ROLES = ("kv_store", "worker", "prefill", "decode")
"""Roles that serve GET /metrics on a port of their own (the gateway has its own on its HTTP port)."""


def metrics_ports(names: list[str], base: int, avoid: set[int] = frozenset()) -> dict[str, int]:
    """A Prometheus port per service: ``base``, ``base + 1``, ... in order; free ports for ``base`` 0;
    none for ``base`` < 0. Raises RuntimeError when a port of the range is taken or in ``avoid``."""
    if base < 0:
        return {}
    if base == 0:
        ports: dict[str, int] = {}
        while len(ports) < len(names):
            port = free_port()
            if port not in avoid and port not in ports.values():
                ports[names[len(ports)]] = port
        return ports
    ports = {name: base + i for i, name in enumerate(names)}
    for name, port in ports.items():
        if port > 65535 or port in avoid or port_is_taken(port):
            raise RuntimeError(f"metrics port {port} (for {name}) is taken; pass --metrics-port 0 for free "
                               "ports, another base, or -1 for none")
    return ports


def say(text: str) -> None:
    print(f"[kvbus] {text}", flush=True)


class Supervisor:
    def __init__(self, quiet: bool = False, stop_timeout: float = 40.0):
        self.children: list[Child] = []
        self.quiet = quiet
        self.stop_timeout = stop_timeout
        self.is_stopping = False
        self.num_restarts = 0

    async def start(self, child: Child) -> None:
        await self._spawn(child)
        self.children.append(child)

    async def _spawn(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", }
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop children in order
            # the child's every thread (OpenMP's included) inherits the CPU set
            preexec_fn=_child_setup(child.cpus, os.getpid()),
        )
        child.started_at = time.monotonic()
        child.pump = asyncio.create_task(self._pump(child))

    async def supervise(self) -> None:
        """Notice dead children and restart each when its backoff is over (call it every second or so)."""
        if self.is_stopping:
            return
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or child.proc.returncode is None:
                continue
            if child.restart_at is None:
                if now - child.started_at >= STABLE_AFTER_S:
                    child.num_restarts = 0
                delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** child.num_restarts)
                child.restart_at = now + delay
                say(f"{child.name} (pid {child.proc.pid}) exited with {describe_exit(child.proc.returncode)}; "
                    f"restarting in {delay:g}s")
            elif now >= child.restart_at:
                child.restart_at = None
                child.num_restarts += 1
                self.num_restarts += 1
                await self._spawn(child)
                say(f"{child.name} restarted (pid {child.proc.pid}, restart {child.num_restarts} in a row)")

    async def _pump(self, child: Child) -> None:
        assert child.proc and child.proc.stdout
        width = max(12, len(child.name))
        async for line in child.proc.stdout:
            if not self.quiet:
                sys.stdout.write(f"{child.name:<{width}} | {line.decode(errors='replace')}")
                sys.stdout.flush()

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.returncode is not None]

    async def stop(self, child: Child, timeout: float | None = None) -> None:
        timeout = self.stop_timeout if timeout is None else timeout
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
        self.is_stopping = True
        services = [c for c in self.children if c is not last]
        await asyncio.gather(*(self.stop(c) for c in services))
        if last is not None:
            await self.stop(last)


async def wait_ready(bus, roles: dict[str, list[str]], supervisor: Supervisor, timeout: float) -> None:
    """Poll each worker's health subject until it answers ready."""
    from bus.errors import BusError
    from bus.subjects import HEALTH, WORKER_HEALTH
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
    if "router" in roles:  # the router must have heard every engine worker's heartbeat
        engines = {r: len(roles[r]) for r in ("prefill", "decode", "worker") if r in roles}
        while True:
            with contextlib.suppress(BusError):
                reply = await bus.request(HEALTH, HealthRequest(), timeout=1.0, role="router")
                if all(int(reply.detail.get(f"workers_{r}", 0)) >= n for r, n in engines.items()):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not see every worker within {timeout:.0f}s")
            await asyncio.sleep(0.25)


async def first_request(bus, roles: dict[str, list[str]]) -> str:
    """The request that proves the system serves: a real call through the bus."""
    if "gateway" not in roles:
        from bus.subjects import TOKENIZER_ENCODE
        from schemas.tokenizer import EncodeRequest

        text = "Hello from kvbus!"
        reply = await bus.request(TOKENIZER_ENCODE, EncodeRequest(text=text), timeout=30)
        return f"{TOKENIZER_ENCODE.template} {{\"text\": \"{text}\"}} -> {reply.ids}"
    from bus.subjects import GENERATE_ONCE
    from schemas.engine import SamplingParams
    from schemas.generate import GenerateRequest
    from schemas.tokenizer import ChatMessage

    question = "What is the capital of France?"
    reply = await bus.request(GENERATE_ONCE, GenerateRequest(
        messages=[ChatMessage(role="user", content=question)],
        sampling=SamplingParams(max_tokens=32, temperature=0.0)), timeout=120)
    return f"{GENERATE_ONCE.template} {question!r} -> {reply.text!r} ({reply.usage.completion_tokens} tokens)"


def speculation(args: argparse.Namespace) -> tuple[str | None, bool]:
    """The engines' drafter for ``--speculative`` (None: off) and whether it serves greedy requests only."""
    choice = getattr(args, "speculative", None) or "off"
    if choice == "off":
        return None, False
    if choice == "auto":
        return "ngram", True
    return choice, False


def _port_of(url: str) -> int | None:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).port
    except ValueError:
        return None


def plan(args: argparse.Namespace, nats_url: str, model_dir) -> tuple[dict[str, list[str]], list[Child]]:
    """Which processes to start: role -> worker ids, and their command lines."""
    from services.registry import ROLES

    roles: dict[str, list[str]] = {"tokenizer": [f"tokenizer-{i}" for i in range(args.tokenizers)]}
    if getattr(args, "hicache", False) and not args.tokenizer_only:
        roles["kv_store"] = ["kv_store-0"]
    if "gateway" in ROLES and not args.tokenizer_only:
        roles["router"] = ["router-0"]
        if args.layout == "aggregated":
            roles["worker"] = [f"worker-{i}" for i in range(args.workers)]
        else:
            roles["prefill"] = [f"prefill-{i}" for i in range(args.prefill or 1)]
            roles["decode"] = [f"decode-{i}" for i in range(args.decode or 1)]
        roles["gateway"] = ["gateway-0"]
        if speculation(args)[0] and args.draft_placement == "remote":
            roles["draft"] = ["draft-0"]
    engines = [wid for role in ("worker", "prefill", "decode") for wid in roles.get(role, [])]
    cores = usable_cores()
    sharing = core_sharing("share" if getattr(args, "share_cores", False) else getattr(args, "core_sharing", "auto"),
                           cores, engines)
    args.core_sharing_used = sharing
    placement = split_cores(cores, engines, sharing)
    slots = {wid: i for i, wid in enumerate(engines)}
    metered = [wid for role in METERED_ROLES for wid in roles.get(role, [])]
    ports = metrics_ports(metered, getattr(args, "metrics_port", -1),
                          {p for p in (getattr(args, "http_port", 0), _port_of(nats_url)) if p})
    py = sys.executable
    children = []
    for role, ids in roles.items():
        for wid in ids:
            argv = [py, "-m", "services.cli", "serve", role, "--worker-id", wid, "--nats-url", nats_url,
                    "--drain-timeout", str(getattr(args, "drain_timeout", 30.0))]
            cpus = None
            if role in ("tokenizer", "prefill", "decode", "worker"):
                argv += ["--model", str(model_dir)]
            if role in ("prefill", "decode", "worker"):
                cpus, threads = placement[wid]
                local = (["--local-prefill-tokens", str(SHARED_CORES_LOCAL_PREFILL)]
                         if role == "decode" and sharing in ("lease", "share") else [])
                argv += ["--kv-cache-memory", str(args.kv_cache_memory), "--dtype", args.dtype,
                         "--num-threads", str(args.num_threads or threads), *local, *shlex.split(args.engine_args)]
                if sharing == "lease" and len(engines) > 1:
                    argv += ["--core-lease", f"{args.core_lease_file}:{slots[wid]}"]
                if role != "worker":
                    argv += ["--kv-transfer", args.kv_transfer]
                method, greedy_only = speculation(args)
                if method and role != "prefill":
                    argv += ["--speculative-method", method, "--draft-placement", args.draft_placement,
                             "--num-speculative-tokens", str(args.num_speculative_tokens)]
                    if greedy_only:
                        argv += ["--speculative-greedy-only"]
                    if args.draft_model:
                        argv += ["--draft-model", args.draft_model]
                if getattr(args, "hicache", False):
                    argv += ["--hicache", "--hicache-write-policy", args.hicache_write_policy]
                    if not args.hicache_prefault:
                        argv += ["--no-hicache-prefault"]
            if role == "draft":
                argv += ["--model", str(model_dir), "--speculative-method", speculation(args)[0],
                         "--num-speculative-tokens", str(args.num_speculative_tokens)]
                if args.draft_model:
                    argv += ["--draft-model", args.draft_model]
            if role == "kv_store":
                argv += ["--hicache-ratio", str(args.hicache_ratio), "--hicache-l3-admit-hits",
                         str(args.hicache_l3_admit_hits)]
                if args.hicache_size is not None:
                    argv += ["--hicache-size", str(args.hicache_size)]
                if args.hicache_storage_dir:
                    argv += ["--hicache-storage-dir", args.hicache_storage_dir]
                if not args.hicache_prefault:
                    argv += ["--no-hicache-prefault"]
            if role == "gateway":
                argv += ["--http-host", args.http_host, "--http-port", str(args.http_port)]
                if args.api_key_file:  # keys themselves travel in KVBUS_API_KEY (inherited), never in argv
                    argv += ["--api-key-file", args.api_key_file]
            if wid in ports:
                argv += ["--metrics-port", str(ports[wid]), "--metrics-host", args.metrics_host]
            children.append(Child(wid, argv, cpus if not args.num_threads else None, metrics_port=ports.get(wid)))
    return roles, children


async def up(args: argparse.Namespace) -> int:
    from bus.nats_transport import connect
    from services.models import ModelError, resolve_model

    supervisor = Supervisor(quiet=args.quiet, stop_timeout=args.drain_timeout + 10.0)
    lease_file: str | None = None
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

        if args.http_port == 0:
            args.http_port = free_port()
        elif port_is_taken(args.http_port) and not args.tokenizer_only:
            say(f"error: HTTP port {args.http_port} is taken; pass --http-port 0 for a free one")
            return 1
        args.core_lease_file = lease_file = make_lease_file()
        roles, children = plan(args, nats_url, model_dir)
        say(f"layout: {args.layout} ({args.layout_why})")
        method, greedy_only = speculation(args)
        if not args.tokenizer_only:
            say("speculative decoding: " + ("off" if method is None else
                f"{method}, greedy requests only (--speculative auto; off: --speculative off)" if greedy_only
                else f"{method}, every request"))
        engines = [wid for role in ("worker", "prefill", "decode") for wid in roles.get(role, [])]
        if len(engines) > 1:
            say(f"engines on this host: core sharing {args.core_sharing_used}")
        for child in children:
            if child.cpus:
                say(f"{child.name}: cores {','.join(map(str, sorted(child.cpus)))}")
            await supervisor.start(child)

        bus = await connect(cfg.build(BusConfig, {"nats_url": nats_url}))  # KVBUS_NATS_* auth/TLS, as the services
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
            result = await first_request(bus, roles)
            say(f"ready in {time.monotonic() - t0:.1f}s: "
                + ", ".join(f"{len(ids)} {role}" for role, ids in roles.items()))
            say(f"served: {result}")
            if "gateway" in roles:
                port = args.http_port
                say(f"HTTP (OpenAI API): http://{args.http_host}:{port}/v1  (curl http://{args.http_host}:{port}"
                    "/v1/chat/completions -H 'Content-Type: application/json' -d '{"
                    "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}')")
                say(f"call over NATS: kvbus call kvbus.v1.generate '{{\"prompt\": \"Once upon a time\"}}' --nats-url {nats_url}")
            else:
                say(f"call it:  kvbus call kvbus.v1.tokenizer.encode '{{\"text\": \"your text\"}}' "
                    f"--nats-url {nats_url}")
            for child in children:
                if child.metrics_port is not None:
                    say(f"metrics (Prometheus): {child.name} http://{args.metrics_host}:{child.metrics_port}/metrics")
            say("traces: set OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://127.0.0.1:4318) before `kvbus up`")
            if args.exit_after_ready:
                return 0
            say("Ctrl-C stops everything")
            while not stop.is_set():
                await supervisor.supervise()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            return 0
        finally:
            await bus.close()
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        say("stopping services" + (", then nats-server" if nats_child else ""))
        await supervisor.stop_all(last=nats_child)
        if lease_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(lease_file)
        say("stopped")


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvbus up", description=__doc__)
    parser.add_argument("--model", default=os.environ.get("KVBUS_MODEL"),
                        help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, prepared on first use)")
    parser.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    parser.add_argument("--nats-port", type=int, default=4222, help="port for the started nats-server (0: free port)")
    parser.add_argument("--tokenizers", type=int, default=1, help="tokenizer replicas")
    parser.add_argument("--layout", choices=["auto", "aggregated", "disaggregated"], default="auto",
                        help=f"auto: disaggregated (1P1D) on machines with >= {DISAGG_MIN_CORES} cores, "
                             "else aggregated (what serves best on the machine found; docs/engine.md)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill workers (implies disaggregated; default 1)")
    parser.add_argument("--decode", type=int, default=None, help="decode workers (implies disaggregated; default 1)")
    parser.add_argument("--aggregated", action="store_true", help="same as --layout aggregated")
    parser.add_argument("--core-sharing", choices=CORE_SHARING, default="auto",
                        help="several engine workers on one host: split (disjoint core slices), share (every "
                             "core each, stepping at once), lease (every core each, taking turns); auto: lease "
                             f"when a split would give an engine fewer than {LEASE_BELOW_CORES_PER_ENGINE} cores, "
                             "else split")
    parser.add_argument("--share-cores", action="store_true", help="same as --core-sharing share")
    parser.add_argument("--workers", type=int, default=1, help="aggregated workers (with --aggregated)")
    parser.add_argument("--tokenizer-only", action="store_true", help="start only the tokenizer service")
    parser.add_argument("--kv-transfer", default="auto", choices=["auto", "shm", "nats"])
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GB of KV cache per engine worker")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads per engine worker (0: chosen by layout: all cores for one engine, "
                             "a disjoint slice each for several; a set value turns core pinning off)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations of every engine (auto: the checkpoint's; bfloat16 uses "
                             "the CPU's bf16 instructions through oneDNN where it has them)")
    parser.add_argument("--engine-args", default="",
                        help="more options for every engine worker, e.g. \"--max-running-requests 8 --page-size 32\"")
    parser.add_argument("--speculative", choices=["auto", "ngram", "model", "off"], default="auto",
                        help="speculative decoding on the decode (or aggregated) workers. auto (default): n-gram "
                             "drafts for greedy requests only, whose output is the same token for token (sampled "
                             "ones decode plainly); ngram / model: that drafter for every request; off: none "
                             "(docs/speculative.md)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="most tokens drafted per step")
    parser.add_argument("--draft-model", default=None, help="--speculative model: local HF folder of the draft model")
    parser.add_argument("--draft-placement", choices=["local", "remote"], default="local",
                        help="local: drafter inside each worker; remote: one draft service (kvbus serve draft) shared by the workers")
    parser.add_argument("--hicache", action="store_true",
                        help="start the host's kv_store and let every engine write evicted KV pages back to it "
                             "and load prefix hits back (docs/hicache.md)")
    parser.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size in engine KV pools")
    parser.add_argument("--hicache-size", type=float, default=None, help="L2 size in GB (overrides the ratio)")
    parser.add_argument("--hicache-storage-dir", default=None, help="L3 directory (none: no disk tier)")
    parser.add_argument("--hicache-l3-admit-hits", type=int, default=1,
                        help="L2 hits a page needs to be written to L3 when L2 evicts it")
    parser.add_argument("--hicache-write-policy", default="write_back",
                        choices=["write_back", "write_through", "write_through_selective"])
    parser.add_argument("--hicache-prefault", action=argparse.BooleanOptionalAction, default=True,
                        help="commit L2's memory when the kv_store makes it and map it into every engine ahead, in "
                             "the background (a first touch of a slot costs ~7x the copy; docs/hicache.md)")
    parser.add_argument("--http-host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=9400,
                        help="first Prometheus port: the kv_store and the engine workers serve GET /metrics on "
                             "this port and the next ones, in that order (0: free ports; -1: none)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the /metrics endpoints listen on")
    parser.add_argument("--api-key-file", default=None,
                        help="file of HTTP API keys, one per line (or set KVBUS_API_KEY=key1,key2)")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on stop: seconds each service may take to finish in-flight work (then it is cut off)")
    parser.add_argument("--exit-after-ready", action="store_true",
                        help="stop everything once the first request was served (smoke test)")
    parser.add_argument("--quiet", action="store_true", help="don't stream service logs")
    args = parser.parse_args(argv)
    for name in ("tokenizers", "prefill", "decode", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if not -1 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be a port, 0 (free ports) or -1 (none)")
    if args.aggregated and (args.prefill or args.decode or args.layout == "disaggregated"):
        parser.error("--aggregated contradicts --prefill/--decode/--layout disaggregated")
    args.layout, args.layout_why = choose_layout(args, len(usable_cores()))
    return asyncio.run(up(args))
