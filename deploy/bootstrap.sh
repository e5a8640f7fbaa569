#!/usr/bin/env bash
# Set up kvbus on a fresh Debian machine (Python 3.11, root or sudo) and run it.
#
#   bash deploy/bootstrap.sh up   [kvbus up options]   install, then bring the whole system up
#   bash deploy/bootstrap.sh test [pytest options]     install with test tools, then run the tests
#
# Installs what is missing and nothing twice: Debian packages (python3-venv,
# nats-server, g++ for the native CPU kernels; for tests also libnats-dev for the
# C client test, Node.js with npm for the Node client test, Prometheus and docker-compose
# for the observability and deployment tests), a
# virtual environment in .venv with torch pinned to 2.13.0 (set KVBUS_TORCH_SPEC
# to install another build, e.g. a CUDA one), and kvbus itself (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  up|test) shift ;;
  *) echo "usage: bash deploy/bootstrap.sh up|test [args...]" >&2; exit 2 ;;
esac

export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${KVBUS_PYTHON:-$(command -v python3.11 || command -v python3)}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

say() { printf '[bootstrap] %s\n' "$*" >&2; }

apt_updated=""
apt_install() {  # apt_install PACKAGE... : install the Debian packages not yet present
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing Debian packages: ${missing[*]}"
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
}

debs=()
command -v nats-server >/dev/null || debs+=(nats-server)
"$PY" -c 'import ensurepip, venv' 2>/dev/null || debs+=(python3-venv)
command -v g++ >/dev/null || debs+=(g++)
if [ "$mode" = test ]; then
  [ -f /usr/include/nats/nats.h ] || debs+=(libnats-dev)
  # the wire-contract tests: a Node.js client and the official AsyncAPI parser (tests/clients/node)
  command -v node >/dev/null || debs+=(nodejs)
  command -v npm >/dev/null || debs+=(npm)
  # the observability tests: a real Prometheus and promtool; Compose v1 validates docker-compose.yml
  command -v prometheus >/dev/null || debs+=(prometheus)
  command -v docker-compose >/dev/null || debs+=(docker-compose)
fi
[ ${#debs[@]} -eq 0 ] || apt_install "${debs[@]}"

[ -x .venv/bin/python ] || { say "creating .venv with $PY"; "$PY" -m venv .venv; }
extras=""; [ "$mode" = test ] && extras="[test]"
stamp=".venv/.kvbus-installed$extras"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) ${KVBUS_TORCH_SPEC:-torch==2.13.0}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing Python packages into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086  # the spec may carry pip options (an index URL)
  .venv/bin/python -m pip install -q ${KVBUS_TORCH_SPEC:-torch==2.13.0}
  .venv/bin/python -m pip install -q -e ".$extras"
  echo "$want" > "$stamp"
fi
# Hugging Face's `kernels` distribution (pulled by transformers 5.25, or installed by hand) imports as
# `kernels`, our own package's name: where it is present transformers imports ours in its place and fails
if .venv/bin/python -m pip show -q kernels >/dev/null 2>&1; then
  say "removing the 'kernels' distribution: its import name is kvbus's own kernels package"
  .venv/bin/python -m pip uninstall -y -q kernels
fi
# Native CPU kernels (paged attention): built once per machine and source, ~30 s; a build that
# fails leaves the torch references in charge, so it warns instead of stopping the install.
.venv/bin/python -c "import sys, kernels.native as n; sys.exit(n.main())" || say "warning: native CPU kernels not built; the slower torch references will run"

if [ "$mode" = up ]; then
  exec .venv/bin/kvbus up "$@"
fi
# The default model is converted once (~30 s) before the tests time anything.
.venv/bin/kvbus model prepare
export TRITON_INTERPRET=1
set +e
# The whole suite runs one pytest process per test folder (tests/<folder>/test_*.py): a process that builds dozens of engines
# keeps the memory torch's allocator and glibc took for them, and one process for everything grew past
# 24 GB and was killed by the kernel. Naming tests (a path, a node id) runs one process, as pytest would.
names_tests=""
for a in "$@"; do
  case "$a" in -*) ;; *) [ -e "${a%%::*}" ] && names_tests=1 ;; esac
done
if [ -n "$names_tests" ]; then
  .venv/bin/python -m pytest "$@"
  code=$?
  [ $code -eq 5 ] && { say "pytest collected no tests"; exit 1; }
  exit $code
fi
failed=()
folders=()  # every folder under tests/ that holds test modules (a new one is never left out)
for dir in tests/*/; do
  compgen -G "${dir}test_*.py" >/dev/null && folders+=("${dir%/}")
done
if compgen -G "tests/test_*.py" >/dev/null; then
  say "tests/test_*.py: put test modules in a folder under tests/ (each folder runs in its own process)"; exit 1
fi
for dir in "${folders[@]}"; do
  say "pytest $dir"
  .venv/bin/python -m pytest "$dir" "$@"
  code=$?
  [ $code -eq 0 ] || failed+=("$dir (exit $code)")
done
if [ ${#failed[@]} -ne 0 ]; then
  say "failed: ${failed[*]}"
  exit 1
fi
say "every test folder passed"
exit 0
