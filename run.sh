#!/usr/bin/env bash
# Set-up and entry points on a fresh machine (README "Quick start"):
#   bash run.sh demo [args]   create .venv, install, run the main job (demo + benchmark; GPU if present)
#   bash run.sh test [args]   create .venv, install, run the test suite (what CI runs)
#   bash run.sh bench [args]  the kernel benchmark alone (writes benchmarks/results/<device>.json)
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  # JAX 0.11 needs Python >= 3.12.
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

setup() {
  local venv=".venv"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import jax_mla_cache, pytest, chex, safetensors' 2>/dev/null; then
    local py; py=$(find_python)
    echo "run.sh: setting up $venv with $("$py" --version)" >&2
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    local extra="test"
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra="test,cuda13"; fi
    "$venv/bin/python" -m pip install -q -e ".[$extra]"
  fi
  PY="$PWD/$venv/bin/python"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  setup; exec "$PY" -m jax_mla_cache demo "$@" ;;
  bench) setup; exec "$PY" -m jax_mla_cache bench "$@" ;;
  test)  setup; exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash run.sh {demo|test|bench} [args]" >&2; exit 2 ;;
esac
