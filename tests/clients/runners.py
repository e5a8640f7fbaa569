"""Building and running the clients in other languages that the wire-contract tests use.

Node.js: tests/clients/node (package.json and its lock file) is installed once per lock file with
``npm ci`` into ``~/.cache/kvbus/node/<hash>`` (``KVBUS_NODE_CACHE`` overrides), so test runs and
fresh clones share it; the scripts find it through ``NODE_PATH``. C: tests/clients/generate_stream.c,
compiled with Debian's libnats-dev.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent
NODE_DIR = CLIENTS / "node"
NODE_FILES = ("package.json", "package-lock.json")
NATS_HEADER = Path("/usr/include/nats/nats.h")


def node_missing() -> str | None:
    """Why the Node.js clients cannot run here, or None."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "needs Node.js and npm (`apt-get install -y nodejs npm`; `bash deploy/bootstrap.sh test` installs them)"
    return None


def c_missing() -> str | None:
    if not NATS_HEADER.exists() or shutil.which("gcc") is None:
        return "needs gcc and Debian's libnats-dev (`apt-get install -y libnats-dev`)"
    return None


def node_modules() -> Path:
    """The installed dependencies of tests/clients/node (``npm ci`` the first time: about 30 s)."""
    digest = hashlib.sha256(b"".join((NODE_DIR / f).read_bytes() for f in NODE_FILES)).hexdigest()[:16]
    cache = Path(os.environ.get("KVBUS_NODE_CACHE") or Path.home() / ".cache" / "kvbus" / "node")
    target = cache / digest
    if (target / "node_modules" / ".kvbus-installed").exists():
        return target / "node_modules"
    staging = cache / f"{digest}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in NODE_FILES:
        shutil.copy(NODE_DIR / name, staging / name)
    # --ignore-scripts: nothing runs at install time (no package here needs a build step)
    done = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                          cwd=staging, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"npm ci of tests/clients/node failed:\n{done.stdout}\n{done.stderr}")
    (staging / "node_modules" / ".kvbus-installed").touch()
    try:
        staging.rename(target)
    except OSError:  # another run installed it meanwhile: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return target / "node_modules"


def node(modules: Path, script: str, *args: str, **popen) -> subprocess.Popen:
    """Start ``tests/clients/node/<script>`` with ``args``; its stdout is a pipe of text lines."""
    env = {**os.environ, "NODE_PATH": str(modules)}
    return subprocess.Popen(["node", str(NODE_DIR / script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run_node(modules: Path, script: str, *args: str, stdin: str | None = None,
             timeout: float = 300) -> list[dict]:
    """Run a Node.js script to the end; its JSON lines (fails with its stderr when it fails)."""
    proc = node(modules, script, *args, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
    out, err = proc.communicate(stdin, timeout=timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert proc.returncode == 0, f"node {script} exited {proc.returncode}:\n{err}\n{out[-4000:]}"
    return lines


def build_c_client(directory: Path) -> Path:
    exe = directory / "generate_stream"
    subprocess.run(["gcc", "-O1", "-Wall", "-o", str(exe), str(CLIENTS / "generate_stream.c"), "-lnats"],
                   check=True)
    return exe
