"""The converted default model in the kvbus cache, and resolving `--model`.

Layout: `<cache>/models/SmolLM2-135M-Instruct/` where `<cache>` is
KVBUS_CACHE_DIR, else `$XDG_CACHE_HOME/kvbus`, else `~/.cache/kvbus`.

A build happens in a temp sibling (`.SmolLM2-135M-Instruct.tmp-*`) under an
exclusive file lock, gets its manifest last and is renamed into place, so
readers see either no folder, the old folder or the complete new one. Temp and
replaced folders a crash left behind are removed by the next build.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services.models.folder import ModelError, is_hub_id, validate_model_dir
from services.models.gguf_source import GGUF_SHA256, convert_gguf, obtain_gguf
from services.models.manifest import MANIFEST_NAME, check_manifest, write_manifest

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "KVBUS_CACHE_DIR"


def log_stderr(message: str) -> None:
    print(f"kvbus model: {message}", file=sys.stderr, flush=True)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The kvbus cache folder: the argument, else KVBUS_CACHE_DIR, else the XDG cache."""
    if cache_dir is None:
        env = os.environ.get(CACHE_DIR_ENV)
        if env is not None and not env.strip():
            raise ModelError(f"{CACHE_DIR_ENV} is set but empty; unset it or give a folder")
        if env:
            cache_dir = env
        else:
            cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbus"
    return Path(cache_dir).expanduser().absolute()


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def cache_problem(model_dir: Path, *, verify: bool = False) -> str | None:
    """Why model_dir is not a complete converted model, or None when it is."""
    if not model_dir.is_dir():
        return "not prepared yet"
    try:
        manifest = check_manifest(model_dir, full=verify)
        validate_model_dir(model_dir)
    except ModelError as exc:
        return str(exc)
    if manifest.get("source", {}).get("sha256") != GGUF_SHA256:
        return "converted from a different source file than this kvbus pins"
    return None


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, log):
    """Serialize builds across processes (several services may start at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, the atomic rename still holds
        yield
        return
    with open(lock_path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("waiting for another kvbus process that is preparing the model")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_default_model(out_dir: Path, log, source: Path | None = None) -> dict:
    """Write the converted default model into out_dir (no manifest); returns its provenance."""
    with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}.download-", dir=out_dir.parent) as work:
        gguf, provenance = obtain_gguf(Path(work), log, source)
        convert_gguf(gguf, out_dir, log)
    return provenance


def _remove_leftovers(models_dir: Path, log) -> None:
    # Only called under the lock, so no other process is writing these.
    for kind in ("tmp", "old", "download"):
        for leftover in models_dir.glob(f".{DEFAULT_MODEL_NAME}.{kind}-*"):
            log(f"removing leftover {leftover.name} from an interrupted build")
            shutil.rmtree(leftover, ignore_errors=True)


def _swap_into_place(new_dir: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.exists():
        final.rename(old)
    new_dir.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def prepare_default_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    verify: bool = False,
    source: str | os.PathLike | None = None,
    log=log_stderr,
) -> Path:
    """Return the converted default model folder, converting it first if it is missing,
    partial or corrupt (or always with force). verify=True also checks every sha256."""
    final = default_model_dir(cache_dir)
    if not force and cache_problem(final, verify=verify) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{DEFAULT_MODEL_NAME}.lock", log):
        problem = "--force" if force else cache_problem(final, verify=verify)
        if problem is None:  # another process finished it while we waited
            return final
        log(f"preparing {final} ({problem})")
        started = time.monotonic()
        _remove_leftovers(final.parent, log)
        build_dir = final.with_name(f".{DEFAULT_MODEL_NAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        build_dir.mkdir()
        try:
            provenance = build_default_model(build_dir, log, Path(source) if source else None)
            log(f"hashing files and writing {MANIFEST_NAME}")
            write_manifest(build_dir, name=DEFAULT_MODEL_NAME, source=provenance)
            validate_model_dir(build_dir)
            _swap_into_place(build_dir, final)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        log(f"ready in {time.monotonic() - started:.1f} s: {final}")
    return final


def ensure_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The default model folder, prepared if needed (tests and first starts)."""
    return prepare_default_model(cache_dir)


def resolve_model(model: str | os.PathLike | None, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Turn a `--model` value into a validated local folder.

    None means the default model (converted on first use). Anything else must be
    a local Hugging Face folder of a supported architecture; hub ids are refused."""
    if model is None:
        return prepare_default_model(cache_dir)
    text = os.fspath(model)
    path = Path(text).expanduser()
    if not path.exists() and is_hub_id(text):
        raise ModelError(
            f"{text!r} is not a local folder and looks like a Hugging Face Hub id, but kvbus never"
            " downloads from a hub;"
            f" download the model elsewhere (e.g. `huggingface-cli download {text} --local-dir DIR`),"
            " copy the folder here and pass --model DIR, or omit --model to use the default"
            f" {DEFAULT_MODEL_NAME}"
        )
    path = path.absolute()
    validate_model_dir(path)
    if (path / MANIFEST_NAME).is_file():
        try:
            check_manifest(path)
        except ModelError as exc:
            raise ModelError(f"{exc}; rebuild it with `kvbus model prepare --force`") from exc
    return path
