#!/usr/bin/env bash
# One device call: environment, GPU tests, memcheck with hostile slots, benchmark.
# Usage (device tool): bash benchmarks/gpu_session.sh [tests|sanitize|bench|all]...
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
parts=("${@:-all}")
want() { for p in "${parts[@]}"; do [ "$p" = all ] || [ "$p" = "$1" ] && return 0; done; return 1; }
nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if want tests; then
  timeout 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if want sanitize; then
  timeout 300 compute-sanitizer --tool memcheck --target-processes all python3 benchmarks/hostile_slots.py \
    2>&1 | tee "$OUT/memcheck.log" | tail -15
fi
if want bench; then
  timeout 420 python3 -m jax_mla_cache bench --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log"
fi
