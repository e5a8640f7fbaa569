"""When ``kvbus up`` may call the system ready: every replica's health subject answers ready, the router
has heard every engine worker's heartbeat, and a first real request was served.

Asked over the bus, never read from log text.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from bus.errors import BusError
from bus.subjects import GENERATE_ONCE, HEALTH, TOKENIZER_ENCODE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from schemas.tokenizer import ChatMessage, EncodeRequest
from services.up.roles import ENGINE_ROLES
from services.up.supervisor import Supervisor

POLL_INTERVAL_S = 0.25


async def wait_ready(bus, roles: dict[str, list[str]], supervisor: Supervisor, timeout: float) -> None:
    """Every replica ready, then (with a router) the router aware of every engine worker.

    RuntimeError when a replica exits meanwhile or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    await wait_healthy(bus, roles, supervisor, deadline, timeout)
    if "router" in roles:
        await wait_router_knows_engines(bus, roles, deadline, timeout)


async def wait_healthy(bus, roles: dict[str, list[str]], supervisor: Supervisor, deadline: float,
                       timeout: float) -> None:
    """Poll each replica's health subject until it answers ready."""
    pending = {(role, wid) for role, ids in roles.items() for wid in ids}
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
            await asyncio.sleep(POLL_INTERVAL_S)


async def wait_router_knows_engines(bus, roles: dict[str, list[str]], deadline: float, timeout: float) -> None:
    """Poll the router's health until it counts every engine worker started (from their heartbeats):
    before that, a first request could find no worker to route to."""
    engines = {role: len(roles[role]) for role in ENGINE_ROLES if role in roles}
    while True:
        with contextlib.suppress(BusError):
            reply = await bus.request(HEALTH, HealthRequest(), timeout=1.0, role="router")
            if all(int(reply.detail.get(f"workers_{role}", 0)) >= n for role, n in engines.items()):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not see every worker within {timeout:.0f}s")
        await asyncio.sleep(POLL_INTERVAL_S)


async def first_request(bus, roles: dict[str, list[str]]) -> str:
    """The request that proves the system serves: a real call through the bus (a chat completion
    through gateway, router and engines; with the tokenizer only, an encode)."""
    if "gateway" not in roles:
        text = "Hello from kvbus!"
        reply = await bus.request(TOKENIZER_ENCODE, EncodeRequest(text=text), timeout=30)
        return f"{TOKENIZER_ENCODE.template} {{\"text\": \"{text}\"}} -> {reply.ids}"
    question = "What is the capital of France?"
    reply = await bus.request(GENERATE_ONCE, GenerateRequest(
        messages=[ChatMessage(role="user", content=question)],
        sampling=SamplingParams(max_tokens=32, temperature=0.0)), timeout=120)
    return f"{GENERATE_ONCE.template} {question!r} -> {reply.text!r} ({reply.usage.completion_tokens} tokens)"
