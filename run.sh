#!/usr/bin/env bash
# Set-up and entry points on a fresh machine (README "Quick start"):
#   bash run.sh demo [args]   create .venv, install, run the main job (demo + benchmark; GPU if present)
#   bash run.sh test [args]   create the venvs, install, run the test suite once per jax version
#                             (what CI runs); the args go to each pytest run
#   bash run.sh bench [args]  the kernel benchmark alone (writes benchmarks/results/<device>.json)
#
# jax versions: .venv holds JAX_MAIN (what the GPU machine runs; demo and bench use it);
# `test` also runs the suite on JAX_NEXT in .venv-jax012 (CPU: its GPU tests skip).
# TEST_JAX="<versions>" or "all" picks the versions `test` runs (default: both without a GPU,
# JAX_MAIN alone on a GPU machine, whose CUDA stack is verified on JAX_MAIN only).
set -euo pipefail
cd "$(dirname "$0")"

JAX_MAIN=0.11.2
JAX_NEXT=0.12.0.1

find_python() {
  # JAX 0.11 and 0.12 need Python >= 3.12.
  for py in "${PYTHON:-}" python3.13 python3.12 /root/.pyenv/versions/3.1[2-9]*/bin/python3 \
            /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] python3; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "run.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

venv_for() {  # the venv directory of a jax version: .venv for JAX_MAIN, .venv-jax012 for 0.12.x
  if [ "$1" = "$JAX_MAIN" ]; then echo ".venv"
  else echo ".venv-jax$(echo "$1" | awk -F. '{printf "%d%02d", $1, $2}')"; fi
}

setup() {  # setup VERSION: create/refresh its venv with jax==jaxlib==VERSION; sets PY
  local version="$1" venv; venv=$(venv_for "$1")
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" - "$version" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
import chex, jax_mla_cache, pytest, safetensors  # noqa: F401
sys.exit(not version("jax") == version("jaxlib") == sys.argv[1])
PY
  then
    local py; py=$(find_python)
    echo "run.sh: setting up $venv (jax $version) with $("$py" --version)" >&2
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    local extra="test"
    if has_gpu; then extra="test,cuda13"; fi
    "$venv/bin/python" -m pip install -q -e ".[$extra]" "jax==$version" "jaxlib==$version"
  fi
  PY="$PWD/$venv/bin/python"
}

run_tests() {  # the suite once per version in TEST_JAX; fails if any run fails
  local versions="${TEST_JAX:-}" rc=0 summary="" version status
  if [ "$versions" = all ]; then
    versions="$JAX_MAIN $JAX_NEXT"
  elif [ -z "$versions" ]; then
    if has_gpu; then versions="$JAX_MAIN"; else versions="$JAX_MAIN $JAX_NEXT"; fi
  fi
  for version in $versions; do setup "$version"; done  # all installs first: fail early
  for version in $versions; do
    setup "$version"
    echo "run.sh: test suite on jax $version ($(venv_for "$version"))" >&2
    status=0; "$PY" -m pytest -q "$@" || status=$?
    summary+=" jax $version: exit $status;"
    [ "$rc" -ne 0 ] || rc=$status
  done
  echo "run.sh: test summary:${summary%;}" >&2
  return "$rc"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  setup "$JAX_MAIN"; exec "$PY" -m jax_mla_cache demo "$@" ;;
  bench) setup "$JAX_MAIN"; exec "$PY" -m jax_mla_cache bench "$@" ;;
  test)  run_tests "$@" ;;
  *) echo "usage: bash run.sh {demo|test|bench} [args]" >&2; exit 2 ;;
esac
