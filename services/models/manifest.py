"""The manifest that marks a converted model folder complete.

It is written last, after every other file is on disk, and lists each file's
size and sha256. A folder without a valid manifest, or whose files disagree
with it, is a partial or corrupt cache: it is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from services.models.folder import ModelError, read_safetensors_header

MANIFEST_NAME = "kvbus-manifest.json"
FORMAT_VERSION = 1


def sha256_of(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(model_dir: Path, *, name: str, source: dict) -> dict:
    """Hash every file in model_dir, flush them to disk, then write the manifest last."""
    files = {}
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME):
        _fsync(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    manifest = {"format_version": FORMAT_VERSION, "name": name, "source": source, "files": files}
    manifest_path = model_dir / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync(manifest_path)
    return manifest


def read_manifest(model_dir: Path) -> dict:
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        raise ModelError(f"{model_dir} has no {MANIFEST_NAME} (partial or interrupted conversion)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path} is unreadable: {exc}") from exc
    if version != FORMAT_VERSION:
        raise ModelError(f"{path} has format version {version}, this kvbus writes {FORMAT_VERSION}")
    if not isinstance(files, dict) or not files:
        raise ModelError(f"{path} lists no files")
    return manifest


def check_manifest(model_dir: Path, *, full: bool = False) -> dict:
    """Check model_dir against its manifest; raise ModelError on the first mismatch.

    The cheap check (every start) compares sizes and parses safetensors headers;
    full=True also recomputes every sha256 (`kvbus model prepare --verify`)."""
    manifest = read_manifest(model_dir)
    for name, entry in manifest["files"].items():
        path = model_dir / name
        if not path.is_file():
            raise ModelError(f"{path} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ModelError(f"{path} is {size} bytes, the manifest says {entry['size']}")
        if name.endswith(".safetensors"):
            read_safetensors_header(path)
        if full and sha256_of(path) != entry["sha256"]:
            raise ModelError(f"{path} does not match the sha256 in the manifest (altered or corrupt)")
    return manifest
