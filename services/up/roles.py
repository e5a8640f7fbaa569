"""Which processes ``kvbus up`` starts, and their command lines: one ``RoleLaunch`` per role.

A role's entry says how many replicas the configuration and layout give it, and the flags each replica
gets after ``kvbus serve ROLE`` and ``common_flags`` (then its ``--metrics-port``, for the roles that
serve one). To pass a new option to a role: a field on ``UpConfig`` (services/up/config.py) and one line
in that role's ``*_flags`` function here (in ``common_flags`` for every role).

Adding a role: its actor in services/registry.py, then one ``RoleLaunch`` in ``ROLE_LAUNCHES``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.up.config import UpConfig
from services.up.placement import (
    SHARED_CORES_LOCAL_PREFILL,
    choose_layout,
    core_sharing,
    lease_slots,
    metrics_ports,
    port_of,
    split_cores,
    usable_cores,
)
from services.up.supervisor import Child

ENGINE_ROLES = ("worker", "prefill", "decode")
"""The roles that hold an engine, in the order they are placed on cores (decode last: the extra cores)."""


@dataclass(frozen=True)
class Site:
    """What ``kvbus up`` found or made before starting the services (not configuration)."""

    nats_url: str
    model_dir: str
    http_port: int
    """The gateway's HTTP port: a free one already chosen where the configuration says 0."""
    lease_file: str | None = None
    """The core-lease file of engines that take turns on the cores (made by kvbus up, removed at stop)."""
    otlp_endpoint: str | None = None
    """Where every service exports its spans: the trace receiver kvbus up started (--trace), else None
    (the services' own environment decides, e.g. OTEL_EXPORTER_OTLP_ENDPOINT)."""


@dataclass(frozen=True)
class LaunchContext:
    """What every replica's flags draw on."""

    config: UpConfig
    site: Site
    core_sharing: str
    """split, share or lease (placement.core_sharing), as decided for the engines started."""
    engine_cores: dict[str, tuple[frozenset[int] | None, int]]
    """Engine worker id -> (CPU set or None, torch threads) from placement.split_cores."""
    lease_slots: dict[str, int]
    """Engine worker id -> its slot in the lease file, where the engines take turns (else empty)."""


@dataclass(frozen=True)
class RoleLaunch:
    """How ``kvbus up`` starts one role."""

    role: str
    replicas: Callable[[UpConfig, str], int]
    """(config, layout) -> how many replicas to start (0: none)."""
    flags: Callable[[LaunchContext, str], list[str]]
    """(context, worker id) -> that replica's own flags."""
    has_metrics_port: bool = False
    """Serves GET /metrics on a port of its own (assigned in ROLE_LAUNCHES order from --metrics-port)."""


def _option(flag: str, value: object) -> list[str]:
    """``[flag, value]``, or nothing for an unset (None or empty) value: the role's default applies."""
    return [] if value is None or value == "" else [flag, str(value)]


def _switch(flag: str, is_on: bool) -> list[str]:
    return [flag] if is_on else []


def common_flags(context: LaunchContext, wid: str) -> list[str]:
    """What every replica gets, before its role's own flags."""
    return ["--worker-id", wid, "--nats-url", context.site.nats_url,
            "--drain-timeout", str(context.config.drain_timeout),
            *_option("--otlp-endpoint", context.site.otlp_endpoint),
            "--trace-sample-ratio", str(context.config.trace_sample_ratio)]


def tokenizer_flags(context: LaunchContext, wid: str) -> list[str]:
    return ["--model", context.site.model_dir]


def router_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    local = decode_local_prefill_tokens(context)
    # The router decides which worker prefills (and predicts what it finds cached, and counts its load) by
    # the uncached part on the decode worker; a decode worker keeping up to `local` tokens itself would
    # overrule it, so the router draws the line where the workers do.
    disagg = _option("--min-disagg-tokens", local + 1 if local else None)
    return ["--policy", config.router_policy, "--router-temperature", str(config.router_temperature),
            "--kv-overlap-weight", str(config.kv_overlap_weight), "--session-ttl", str(config.session_ttl),
            *disagg]


def decode_local_prefill_tokens(context: LaunchContext) -> int:
    """The uncached prompt tokens a decode worker prefills itself (0: none): ``--local-prefill-tokens``
    in --engine-args, else kvbus up's default (:func:`_default_local_prefill`)."""
    value = context.config.engine_arg("--local-prefill-tokens")
    if value is not None and value.isdigit():  # (anything else: the worker refuses it, clearly)
        return int(value)
    return _default_local_prefill(context) or 0


def _default_local_prefill(context: LaunchContext) -> int | None:
    """kvbus up's --local-prefill-tokens for decode workers: SHARED_CORES_LOCAL_PREFILL where the engines
    share cores, else none (the worker's own default)."""
    return SHARED_CORES_LOCAL_PREFILL if context.core_sharing in ("lease", "share") else None


def gateway_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    return ["--http-host", config.http_host, "--http-port", str(context.site.http_port),
            # the keys themselves travel in KVBUS_API_KEY (inherited), never in argv
            "--tool-call-parser", config.tool_call_parser, *_option("--reasoning-parser", config.reasoning_parser),
            *_switch("--session-from-user", config.session_from_user),
            *_option("--api-key-file", config.api_key_file)]


def kv_store_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    # every engine started here shares this host's store: each gets hicache_ratio pools of it
    return ["--hicache-ratio", str(config.hicache_ratio), "--hicache-engines", str(len(context.engine_cores)),
            "--hicache-l3-admit-hits", str(config.hicache_l3_admit_hits),
            *_option("--hicache-size", config.hicache_size),
            *_option("--hicache-storage-dir", config.hicache_storage_dir),
            *_switch("--no-hicache-prefault", not config.hicache_prefault)]


def draft_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    method, _ = config.speculation()
    return ["--model", context.site.model_dir, "--speculative-method", str(method),
            "--num-speculative-tokens", str(config.num_speculative_tokens),
            *_option("--draft-model", config.draft_model)]


def _engine_flags(context: LaunchContext, wid: str, *role_defaults: str) -> list[str]:
    """What every engine worker gets. ``role_defaults`` come before the user's ``--engine-args``, so
    theirs win; kvbus up's own placement (the core lease) comes after."""
    config = context.config
    _, threads = context.engine_cores[wid]
    flags = ["--model", context.site.model_dir, "--kv-cache-memory", str(config.kv_cache_memory),
             "--dtype", config.engine_dtype()[0], "--num-threads", str(config.num_threads or threads),
             *role_defaults, *shlex.split(config.engine_args)]
    if wid in context.lease_slots:
        flags += ["--core-lease", f"{context.site.lease_file}:{context.lease_slots[wid]}"]
    return flags


def _transfer_flags(config: UpConfig) -> list[str]:
    return ["--kv-transfer", config.kv_transfer]


def _speculation_flags(config: UpConfig) -> list[str]:
    method, is_greedy_only = config.speculation()
    if method is None:
        return []
    return ["--speculative-method", method, "--draft-placement", config.draft_placement,
            "--num-speculative-tokens", str(config.num_speculative_tokens),
            *_switch("--speculative-greedy-only", is_greedy_only),
            *_option("--draft-model", config.draft_model)]


def _hicache_flags(config: UpConfig) -> list[str]:
    if not config.hicache:
        return []
    return ["--hicache", "--hicache-write-policy", config.hicache_write_policy,
            *_switch("--no-hicache-prefault", not config.hicache_prefault)]


def worker_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    return [*_engine_flags(context, wid), *_speculation_flags(config), *_hicache_flags(config)]


def prefill_flags(context: LaunchContext, wid: str) -> list[str]:
    # no drafter: a prefill engine never decodes past its first token
    config = context.config
    return [*_engine_flags(context, wid), *_transfer_flags(config), *_hicache_flags(config)]


def decode_flags(context: LaunchContext, wid: str) -> list[str]:
    config = context.config
    local = _option("--local-prefill-tokens", _default_local_prefill(context))
    return [*_engine_flags(context, wid, *local), *_transfer_flags(config), *_speculation_flags(config),
            *_hicache_flags(config)]


def _uses_draft_service(config: UpConfig) -> bool:
    return config.speculation()[0] is not None and config.draft_placement == "remote"


ROLE_LAUNCHES: tuple[RoleLaunch, ...] = (
    RoleLaunch("tokenizer", lambda config, layout: config.tokenizers, tokenizer_flags, has_metrics_port=True),
    RoleLaunch("kv_store", lambda config, layout: int(config.hicache), kv_store_flags, has_metrics_port=True),
    RoleLaunch("router", lambda config, layout: 1, router_flags, has_metrics_port=True),
    RoleLaunch("worker", lambda config, layout: config.workers if layout == "aggregated" else 0, worker_flags,
               has_metrics_port=True),
    RoleLaunch("prefill", lambda config, layout: (config.prefill or 1) if layout == "disaggregated" else 0,
               prefill_flags, has_metrics_port=True),
    RoleLaunch("decode", lambda config, layout: (config.decode or 1) if layout == "disaggregated" else 0,
               decode_flags, has_metrics_port=True),
    RoleLaunch("gateway", lambda config, layout: 1, gateway_flags),
    RoleLaunch("draft", lambda config, layout: int(_uses_draft_service(config)), draft_flags, has_metrics_port=True),
)
"""Every role kvbus up may start, in start order (``--tokenizer-only``: the first alone)."""


@dataclass(frozen=True)
class Plan:
    """What to start: the layout chosen, how the engines share the cores, and each process."""

    layout: str
    layout_why: str
    core_sharing: str
    roles: dict[str, list[str]]
    """Role -> its replicas' worker ids, in start order."""
    children: list[Child]


def plan(config: UpConfig, site: Site, cores: list[int] | None = None) -> Plan:
    """The processes for ``config`` on ``cores`` (default: the cores this process may use).

    RuntimeError when a Prometheus port it needs is taken."""
    cores = usable_cores() if cores is None else cores
    layout, layout_why = choose_layout(config, len(cores))
    launches = ROLE_LAUNCHES[:1] if config.tokenizer_only else ROLE_LAUNCHES
    roles = {r.role: [f"{r.role}-{i}" for i in range(n)] for r in launches if (n := r.replicas(config, layout))}
    engines = [wid for role in ENGINE_ROLES for wid in roles.get(role, [])]
    sharing = core_sharing(config.requested_core_sharing, cores, engines)
    engine_cores = split_cores(cores, engines, sharing)
    context = LaunchContext(config, site, sharing, engine_cores, lease_slots(engines, sharing))
    metered = [wid for r in launches if r.has_metrics_port for wid in roles.get(r.role, [])]
    ports = metrics_ports(metered, config.metrics_port, {p for p in (site.http_port, port_of(site.nats_url)) if p})
    children = []
    for r in launches:
        for wid in roles.get(r.role, []):
            argv = [sys.executable, "-m", "services.cli", "serve", r.role, *common_flags(context, wid),
                    *r.flags(context, wid)]
            if wid in ports:
                argv += ["--metrics-port", str(ports[wid]), "--metrics-host", config.metrics_host]
            cpus = engine_cores[wid][0] if wid in engine_cores and not config.num_threads else None
            children.append(Child(wid, argv, cpus, metrics_port=ports.get(wid)))
    return Plan(layout, layout_why, sharing, roles, children)
