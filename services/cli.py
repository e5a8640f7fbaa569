"""The ``kvbus`` command: serve one role, bring the system up, prepare models, export schemas, call a
subject, ask a replica's health."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from bus.nats_transport import BusConfig
from bus.tracing.setup import TracingConfig
from services import config as cfg

log = logging.getLogger("kvbus")


def setup_logging(level: str = "INFO") -> None:
    from bus.tracing import install_log_context

    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr)
    install_log_context()  # the request id on every line logged while a request is handled


def bus_config_from(args: argparse.Namespace) -> BusConfig:
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in BusConfig.__dataclass_fields__.values()}}
    if "nats_url" not in given and "KVBUS_NATS_URL" not in os.environ and os.environ.get("NATS_URL"):
        given["nats_url"] = os.environ["NATS_URL"]
    return cfg.build(BusConfig, given)


def serve_parser(role: str, actor_cls: type) -> argparse.ArgumentParser:
    """The options of ``kvbus serve ROLE``: the bus's, then the role's config fields."""
    parser = argparse.ArgumentParser(prog=f"kvbus serve {role}", description=actor_cls.__doc__)
    parser.add_argument("--worker-id", default=os.environ.get("KVBUS_WORKER_ID"),
                        help="stable id of this replica (default: random) [env KVBUS_WORKER_ID]")
    parser.add_argument("--log-level", default=os.environ.get("KVBUS_LOG_LEVEL", "INFO"))
    parser.add_argument("--drain-timeout", type=float, default=float(os.environ.get("KVBUS_DRAIN_TIMEOUT", "30")),
                        help="on SIGTERM: seconds to finish in-flight work before it is cut off "
                             "[env KVBUS_DRAIN_TIMEOUT]")
    cfg.add_arguments(parser, BusConfig)
    cfg.add_arguments(parser, TracingConfig)
    cfg.add_arguments(parser, actor_cls.config_class)
    return parser


def cmd_serve(argv: list[str]) -> int:
    from services.registry import ROLES, actor_class
    from services.runner import run_actor

    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: kvbus serve ROLE [options]   (roles: {', '.join(sorted(ROLES))}; "
              "kvbus serve ROLE --help for its options)")
        return 0 if argv else 2
    role, rest = argv[0], argv[1:]
    try:
        actor_cls = actor_class(role)
    except ValueError as exc:
        print(f"kvbus serve: {exc}", file=sys.stderr)
        return 2
    args = serve_parser(role, actor_cls).parse_args(rest)
    setup_logging(args.log_level)
    from services.engine.host_memory import bound_kernel_cache, keep_freed_memory

    if os.environ.get("KVBUS_KEEP_FREED_MEMORY", "1") != "0":  # 0: glibc's defaults (RSS shrinks, prefill faults)
        keep_freed_memory()  # process-wide: freed activations stay mapped (a prefill no longer page-faults them in)
    bound_kernel_cache()  # process-wide: oneDNN keeps 64 kernels, not one per prompt length ever seen
    try:
        bus_config = bus_config_from(args)
        tracing_config = cfg.build(TracingConfig, {k: v for k, v in vars(args).items()
                                                   if k in TracingConfig.__dataclass_fields__})
        role_fields = set(actor_cls.config_class.__dataclass_fields__)
        config = cfg.build(actor_cls.config_class, {k: v for k, v in vars(args).items() if k in role_fields})
    except cfg.ConfigError as exc:
        print(f"kvbus serve {role}: {exc}", file=sys.stderr)
        return 2
    actor = actor_cls(config, worker_id=args.worker_id)
    try:
        asyncio.run(run_actor(actor, bus_config, drain_timeout=args.drain_timeout, tracing_config=tracing_config))
    except Exception as exc:  # startup failures: say what happened, not a traceback
        from bus.errors import BusError
        from services.models import ModelError

        if isinstance(exc, (BusError, ModelError, cfg.ConfigError)):
            print(f"kvbus serve {role}: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def cmd_schemas(argv: list[str]) -> int:
    from schemas.export import export_schemas

    parser = argparse.ArgumentParser(prog="kvbus schemas",
                                     description="The wire contract: JSON Schema of every public subject, and "
                                                 "one AsyncAPI 3.0 document (subjects, payloads, headers, errors)")
    sub = parser.add_subparsers(dest="action", required=True)
    exp = sub.add_parser("export", help="write one JSON Schema file per public subject and asyncapi.json")
    exp.add_argument("dir")
    args = parser.parse_args(argv)
    paths = export_schemas(args.dir)
    for p in paths:
        print(p)
    return 0


def cmd_call(argv: list[str]) -> int:
    """Send JSON to a subject and print the reply (or every chunk of a stream; it asks for and answers
    the server's interest probes, so Ctrl-C or a killed process stops the generation)."""
    from bus.subjects import ALL_SUBJECTS

    parser = argparse.ArgumentParser(prog="kvbus call", description=cmd_call.__doc__)
    parser.add_argument("subject", help="e.g. kvbus.v1.tokenizer.encode")
    parser.add_argument("json", nargs="?", default="{}", help="request body as JSON")
    parser.add_argument("--timeout", type=float, default=30.0)
    cfg.add_arguments(parser, BusConfig)  # --nats-url, and the credentials of an API caller (--nats-user ...)
    args = parser.parse_args(argv)
    try:
        bus_config = bus_config_from(args)
    except cfg.ConfigError as exc:
        print(f"kvbus call: {exc}", file=sys.stderr)
        return 2
    from bus.subjects import subject_for_name

    try:
        subject, params = subject_for_name(args.subject)
    except ValueError as exc:
        names = ", ".join(s.template for s in ALL_SUBJECTS if s.public)
        print(f"kvbus call: {exc}; public subjects: {names}", file=sys.stderr)
        return 2

    async def run() -> int:
        import msgspec

        from bus.codec import Encoding, decode
        from bus.errors import BusError
        from bus.nats_transport import connect

        try:
            request = decode(args.json.encode(), subject.request, Encoding.JSON)
        except BusError as exc:
            print(f"kvbus call: {exc.message}", file=sys.stderr)
            return 2
        try:
            bus = await connect(bus_config)
        except BusError as exc:  # wrong URL or credentials: say so, no traceback
            print(f"kvbus call: {exc.message}", file=sys.stderr)
            return 1
        try:
            if subject.streamed:
                async with bus.stream(subject, request, timeout=args.timeout, **params) as chunks:
                    async for chunk in chunks:
                        print(msgspec.json.encode(chunk).decode(), flush=True)
            else:
                reply = await bus.request(subject, request, timeout=args.timeout, **params)
                print(msgspec.json.encode(reply).decode())
        except BusError as exc:
            print(json.dumps({"error": {"code": exc.code.value, "message": exc.message}}), file=sys.stderr)
            return 1
        finally:
            await bus.close()
        return 0

    try:
        return asyncio.run(run())
    except BrokenPipeError:  # `kvbus call ... | head`: the reader left; leaving closes the stream
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def health_parser() -> argparse.ArgumentParser:
    from services.registry import ROLES

    parser = argparse.ArgumentParser(prog="kvbus health", description=cmd_health.__doc__)
    parser.add_argument("role", choices=sorted(ROLES.names()))
    parser.add_argument("--worker-id", default=os.environ.get("KVBUS_WORKER_ID"),
                        help="the replica to ask (default: $KVBUS_WORKER_ID; unset: any replica of the role)")
    parser.add_argument("--live", action="store_true",
                        help="liveness: any answer will do, ready or not (e.g. draining)")
    parser.add_argument("--timeout", type=float, default=3.0)
    cfg.add_arguments(parser, BusConfig)
    return parser


def cmd_health(argv: list[str]) -> int:
    """Ask one replica (or any replica of a role) whether it is ready: exit 0 ready, 1 not (or no answer).
    For container healthchecks and Kubernetes probes (deploy/)."""
    args = health_parser().parse_args(argv)
    try:
        bus_config = bus_config_from(args)
    except cfg.ConfigError as exc:
        print(f"kvbus health: {exc}", file=sys.stderr)
        return 2

    async def run() -> int:
        import msgspec

        from bus.errors import BusError
        from bus.nats_transport import connect
        from bus.subjects import HEALTH, WORKER_HEALTH
        from schemas.common import HealthRequest

        who = f"{args.role} {args.worker_id}" if args.worker_id else f"any {args.role}"
        try:
            bus = await connect(bus_config, name="kvbus-health")
        except BusError as exc:
            print(f"kvbus health: {exc.message}", file=sys.stderr)
            return 1
        try:
            if args.worker_id:
                reply = await bus.request(WORKER_HEALTH, HealthRequest(), timeout=args.timeout, role=args.role,
                                          worker_id=args.worker_id)
            else:
                reply = await bus.request(HEALTH, HealthRequest(), timeout=args.timeout, role=args.role)
        except BusError as exc:
            print(f"kvbus health: {who}: no answer ({exc.code.value}: {exc.message})", file=sys.stderr)
            return 1
        finally:
            await bus.close()
        print(msgspec.json.encode(reply).decode())
        return 0 if reply.ready or args.live else 1

    return asyncio.run(run())


def cmd_trace(argv: list[str]) -> int:
    """Print a request's trace as a waterfall: its stages, their durations and key attributes. From the
    file ``kvbus up --trace`` writes, or from Jaeger's query API with --jaeger-url."""
    from services.traces import default_file

    parser = argparse.ArgumentParser(prog="kvbus trace", description=cmd_trace.__doc__)
    parser.add_argument("ref", nargs="?", help="a request id (X-Request-Id, Kvbus-Request-Id) or a trace id")
    parser.add_argument("--last", action="store_true", help="the request that started last")
    parser.add_argument("--file", default=None, help=f"spans written by kvbus up --trace (default: {default_file()})")
    parser.add_argument("--jaeger-url", default=os.environ.get("KVBUS_JAEGER_URL"),
                        help="read the trace from Jaeger's query API instead, e.g. http://127.0.0.1:16686 "
                             "[env KVBUS_JAEGER_URL]")
    parser.add_argument("--events", action="store_true", help="print every span event (decode step summaries)")
    parser.add_argument("--json", action="store_true", help="print the spans as JSON lines instead")
    args = parser.parse_args(argv)
    if bool(args.ref) == args.last:
        parser.error("give a request id or trace id, or --last")
    from services.traces import spans as trace_spans
    from services.traces.waterfall import render

    if args.jaeger_url:
        from services.traces.jaeger import JaegerError, fetch_trace

        if args.last:
            parser.error("--last reads the local file; with --jaeger-url name the request or trace")
        try:
            found = fetch_trace(args.jaeger_url, args.ref)
        except JaegerError as exc:
            print(f"kvbus trace: {exc}", file=sys.stderr)
            return 1
    else:
        path = args.file or default_file()
        every = trace_spans.read_file(path)
        if not every:
            print(f"kvbus trace: no spans in {path} (start the system with kvbus up --trace, or pass --file "
                  "or --jaeger-url)", file=sys.stderr)
            return 1
        found = trace_spans.last_trace(every) if args.last else trace_spans.find_trace(every, args.ref)
    if not found:
        print(f"kvbus trace: no trace of {args.ref or 'a request'} found", file=sys.stderr)
        return 1
    if args.json:
        for span in sorted(found, key=lambda s: s.start_ns):
            print(span.to_json())
    else:
        print(render(found, events=args.events))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commands = {
        "serve": cmd_serve,
        "up": lambda a: __import__("services.up", fromlist=["up_main"]).up_main(a),
        "model": lambda a: __import__("services.models", fromlist=["model_main"]).model_main(a),
        "schemas": cmd_schemas,
        "call": cmd_call,
        "health": cmd_health,
        "trace": cmd_trace,
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: kvbus COMMAND [options]\n\n"
            "  up        start nats-server and every service locally, serve a first request\n"
            "  serve     run one service role (kvbus serve tokenizer --help)\n"
            "  model     prepare or inspect the model (kvbus model prepare | info)\n"
            "  call      send JSON to a subject and print the reply\n"
            "  health    ask a service replica whether it is ready (exit 0 ready, 1 not)\n"
            "  trace     print a request's trace as a waterfall (kvbus trace --last; --jaeger-url URL)\n"
            "  schemas   export the wire contract (JSON Schemas, AsyncAPI document)\n",
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
