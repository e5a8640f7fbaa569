"""``kvbus up``: nats-server and every service as local processes, ready to call.

Starts nats-server (unless --nats-url points at one), prepares the model, starts each role's
replicas, waits for their health subjects, serves a first real request, prints where everything
is, streams logs with a role prefix, and on Ctrl-C stops the services, then nats-server last.

Once ready it supervises what it started: a process that dies is logged and restarted with
exponential backoff (its replacement rejoins through its heartbeats and health subjects). Every
child dies with kvbus up even when kvbus up itself is killed with SIGKILL (Linux: PR_SET_PDEATHSIG).

Flags come from UpConfig (services/up/config.py); each role's command line from services/up/roles.py.
"""

from __future__ import annotations

from services.up.placement import SHARED_CORES_LOCAL_PREFILL


def up_main(argv: list[str]) -> int:
    """``kvbus up ARGS`` (the bus and the services are imported only when it runs)."""
    from services.up.command import up_main as run

    return run(argv)


__all__ = ["SHARED_CORES_LOCAL_PREFILL", "up_main"]
