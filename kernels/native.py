"""Native CPU kernels: C++ sources in ``kernels/cpu/``, built once per machine, loaded as torch ops.

Built with torch's C++ extension machinery (g++, ninja, OpenMP, ``-march=native``) into
``~/.cache/kvbus/native/<key>`` (``KVBUS_NATIVE_DIR`` moves it), where the key hashes the
sources, the torch version and the CPU's flags: a new source, torch or machine builds anew, an
unchanged one loads in milliseconds. ``deploy/bootstrap.sh`` builds them at install time
(``kernels.native.main``); a process that finds no build makes one (~25 s on 2 cores) and
logs it. The ops run on torch's own OpenMP pool (``at::parallel_for``), so they use the threads
``torch.set_num_threads`` gave the process.

``KVBUS_NATIVE=0`` turns them off (the torch references run instead). A build that fails is
logged once with the compiler's error and the references run: slower, never wrong.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "cpu" / name for name in ("paged_attention.cpp", "packed_gemm.cpp", "layer_ops.cpp",
                                                           "decode_stack.cpp"))
HEADERS = tuple(Path(__file__).parent / "cpu" / name for name in ("vec_math.h", "ops.h"))
ENV_ENABLE = "KVBUS_NATIVE"
ENV_DIR = "KVBUS_NATIVE_DIR"
NAME = "kvbus_cpu"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the torch.ops namespace, or "error": why not


def is_enabled() -> bool:
    value = os.environ.get(ENV_ENABLE, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{ENV_ENABLE}={value!r}: use 1 or 0")
    return value not in ("0", "false", "off")


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:  # the path too: ninja rebuilds when another checkout's sources use the folder
        h.update(str(src.resolve()).encode())
        h.update(src.read_bytes())
    h.update(" ".join([torch.__version__, *CFLAGS, _cpu_flags()]).encode())
    root = Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "kvbus" / "native")
    return root.expanduser() / h.hexdigest()[:16]


def _build_and_load(verbose: bool):
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not (out / f"{NAME}.so").exists():
        log.warning("building the native CPU kernels once into %s (about a minute on 2 cores)", out)
    t0 = time.perf_counter()
    cpp_extension.load(
        name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
        build_directory=str(out), is_python_module=False, verbose=verbose,
    )
    log.debug("native CPU kernels loaded from %s in %.2f s", out, time.perf_counter() - t0)
    return getattr(torch.ops, NAME)


def ops(verbose: bool = False):
    """The loaded ``torch.ops.kvbus_cpu`` namespace, or None (disabled, or the build failed)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            if not is_enabled():
                _state["ops"], _state["error"] = None, f"disabled by {ENV_ENABLE}=0"
            else:
                try:
                    _state["ops"] = _build_and_load(verbose)
                except Exception as exc:  # no compiler, no ninja, a compile error: run the references
                    _state["ops"], _state["error"] = None, f"{type(exc).__name__}: {exc}"
                    log.warning("native CPU kernels unavailable, using the torch references: %s", _state["error"])
    return _state["ops"]


def as_value_error(exc: RuntimeError) -> Exception:
    """A native op's own check (message "kvbus: ...") as the ValueError the references raise;
    any other RuntimeError unchanged."""
    msg = str(exc)
    if "kvbus: " not in msg:
        return exc
    return ValueError(msg.split("kvbus: ", 1)[1].splitlines()[0])


def available() -> bool:
    return ops() is not None


def unavailable_reason() -> str | None:
    ops()
    return _state.get("error")  # type: ignore[return-value]


def main() -> int:
    """Build (or find) the native kernels, say where, exit 1 on failure (deploy/bootstrap.sh runs it)."""
    logging.basicConfig(level=logging.INFO, format="kvbus native: %(message)s")
    t0 = time.perf_counter()
    if ops(verbose="-v" in sys.argv) is None:
        print(f"kvbus native: not built: {unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"kvbus native: CPU kernels ready in {build_dir()} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
