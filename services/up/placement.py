"""Where ``kvbus up``'s processes go on this host: the layout for the cores found, how several engine
workers share those cores (split, share or lease, and the lease file), and the Prometheus ports.

Pure decisions (no process is started here), so the unit tests pin them exactly.
"""

from __future__ import annotations

import os
import tempfile
import typing
from urllib.parse import urlsplit

from services.natsd import free_port, port_is_taken
from services.up.config import CoreSharing, UpConfig

DISAGG_MIN_CORES = 8
"""Fewest usable cores for which ``--layout auto`` picks 1P1D on one host. Below it prefill and
decode engines share (or split) too few cores. On the 2-core dev VM, aggregated has the lower
single-stream TPOT (0.26x vLLM's against 0.30x) and starts sooner; the agentic replay ties
(1P1D 0.97-1.01x) and 8 concurrent streams favour 1P1D by 3-5% (docs/disaggregation.md, "The last
duplicate, removed"). So auto picks aggregated there."""

SHARED_CORES_LOCAL_PREFILL = 1024
"""Decode workers' ``--local-prefill-tokens`` where the engines share cores (lease or share): a prefill
worker there adds no compute, only the trip of the pages and the tokens it lacks (a conversation's
last answer was computed on the decode worker), so a remainder of up to this many tokens is computed
where it is decoded, mixed with the decode steps. docs/disaggregation.md has the figures."""

CORE_SHARING: tuple[str, ...] = typing.get_args(CoreSharing)
LEASE_BELOW_CORES_PER_ENGINE = 4
"""--core-sharing auto takes turns (a core lease) when a split would leave an engine fewer cores."""
LEASE_SLOTS = 64  # services/engine/core_lease.py SLOTS


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def choose_layout(config: UpConfig, num_cores: int) -> tuple[str, str]:
    """(aggregated | disaggregated, why): explicit flags win; auto goes by the cores found."""
    if config.aggregated or config.layout == "aggregated":
        return "aggregated", "asked for"
    if config.layout == "disaggregated" or config.prefill is not None or config.decode is not None:
        return "disaggregated", "asked for"
    if num_cores >= DISAGG_MIN_CORES:
        return "disaggregated", f"auto: {num_cores} cores >= {DISAGG_MIN_CORES}"
    return "aggregated", (f"auto: {num_cores} cores < {DISAGG_MIN_CORES}, where one engine on every core "
                          "streams with less latency than prefill and decode engines dividing them "
                          "(--layout disaggregated to override)")


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


def lease_slots(engines: list[str], sharing: str) -> dict[str, int]:
    """Each engine's slot in the core-lease file, where the engines take turns (else none)."""
    if sharing != "lease" or len(engines) <= 1:
        return {}
    return {wid: slot for slot, wid in enumerate(engines)}


def make_lease_file() -> str:
    """A new core-lease file, owner-only, with a name nobody could have prepared (``mkstemp``);
    `kvbus up` removes it when it stops."""
    fd, path = tempfile.mkstemp(prefix="kvbus-cores-", suffix=".lease")
    try:
        os.ftruncate(fd, 2 * LEASE_SLOTS)
    finally:
        os.close(fd)
    return path


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


def port_of(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        return None
