#!/usr/bin/env bash
# One device call: GPU tests, memcheck with hostile slots, diagnostics, benchmark.
# Usage (device tool): bash benchmarks/gpu_session.sh
#   [tests|decode|ab|ncu_ab|decode_bench|diag_decode|stacked|trace|ncu|regs|demo|step_profile|compile|eager|deepseek|moves|rope|
#    rope_bench|sanitize|diag|diag_rows|diag_pth|diag_moves|ptx|bench|sweep_pth|sweep]...  (DIAG_ARGS: diag_moves flags; BENCH_ARGS: extra bench flags)
#
# Budget notes (H200, jax 0.11.2; 30 min of device time a session, a cold start ~1-1.5 min):
# a 61-layer Mosaic move kernel lowers in < 2 s of host time; the move GPU tests take ~100 s,
# the decode GPU tests ~330 s (H100, 32 tests), `decode_bench` (4 impls, 7 shapes) ~150 s, `demo` ~2 x 75 s,
# the full benchmark ~5 min and the GPU tests ~6 min. Each part has its own timeout; pytest
# gets SIGINT so it still prints its summary (and SIGKILL 20 s later: a kernel that hangs
# ignores SIGINT, and one hung test once took a whole call), and every part writes its log
# under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
parts=("${@:-tests}")
want() { for p in "${parts[@]}"; do [ "$p" = all ] || [ "$p" = "$1" ] && return 0; done; return 1; }
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short)
# Nsight Compute's command line (empty where the machine has none).
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
ptxas_of() {  # SHAPE VARIANT: ptxas's registers and spills of that diag_decode.py variant
  local d; d=$(mktemp -d)
  MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$d timeout 60 python3 benchmarks/diag_decode.py \
    --shape "$1" --only "$2" --iters 1 > /dev/null 2>&1
  grep -h 'Used\|spill stores' $d/*.ptxas 2>/dev/null | sed 's/ptxas info *: //' | tr -s ' \n' ' '
  rm -rf "$d"
}
nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if want tests; then   # everything but the 61-layer move kernels (~150 s warm, ~220 s cold)
  timeout -s INT -k 20 300 "${PYTEST[@]}" tests/test_gpu_host_tier.py tests/test_gpu_seed.py \
    tests/test_inplace.py tests/test_pallas_rows.py tests/test_sharding.py \
    > "$OUT/gpu_tests.log" 2>&1; tail -15 "$OUT/gpu_tests.log"
fi
if want decode; then  # mla_decode kernel vs the XLA reference
  timeout -s INT -k 20 ${DECODE_TIMEOUT:-420} "${PYTEST[@]}" --durations=5 tests/test_mla_decode.py \
    > "$OUT/gpu_decode_tests.log" 2>&1; tail -25 "$OUT/gpu_decode_tests.log"
fi
if want diag_decode; then  # per_token_head decode kernel variants + its SASS
  timeout 150 python3 benchmarks/diag_decode.py ${DIAG_DECODE_ARGS:-} 2>&1 | tee "$OUT/diag_decode.log"
  mkdir -p "$OUT/sass"   # (the dump goes only into an existing folder)
  MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$OUT/sass" timeout 60 python3 benchmarks/diag_decode.py \
    --only pth --iters 1 > /dev/null 2>&1; ls "$OUT/sass" | head
fi
if want ab; then  # A/B of diag_decode.py variants (AB_ONLY) at AB_SHAPES: the revision unpacked
  # in alt/ before the call (`git archive REV | tar -x -C alt`) against the working tree, shape
  # by shape in one machine; then the working tree's ptxas registers for AB_SASS
  for shape in ${AB_SHAPES:-64,1,16,4096 128,1,16,4096 128,1,16,16384}; do
    for tree in alt .; do
      (cd $tree && PYTHONPATH=$PWD timeout 120 python3 benchmarks/diag_decode.py --shape $shape \
        --only ${AB_ONLY:-pth-registers-s4} 2>&1 | grep -v Warning | sed "s|^|$tree $shape  |")
    done
  done | tee "$OUT/ab.log"
  echo "ptxas: $(ptxas_of 2,1,16,256 ${AB_SASS:-pth-registers-s4})" | tee -a "$OUT/ab.log"
fi
if want stacked; then  # StackedMLAKVCache: the scanned decode step in place on the GPU, then
  # the demo's cold compile with its 61 layers unrolled and under lax.scan (empty caches)
  timeout -s INT -k 20 150 "${PYTEST[@]}" tests/test_stacked.py > "$OUT/gpu_stacked_tests.log" 2>&1
  tail -4 "$OUT/gpu_stacked_tests.log"
  for variant in "" "--scan"; do
    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) timeout ${DEMO_TIMEOUT:-200} python3 -m jax_mla_cache \
      demo --no-bench --no-deepseek --steps 8 --no-compare-attention $variant 2>&1 \
      | grep --line-buffered -v "^  decode \|Warning" | tee -a "$OUT/demo_compile_scan.log"
  done
fi
if want trace; then  # in-kernel profile of one decode path (TRACE_ARGS, e.g. --path narrow)
  mkdir -p "$OUT/trace"
  timeout ${TRACE_TIMEOUT:-120} python3 benchmarks/trace_decode.py --out "$OUT/trace" \
    ${TRACE_ARGS:-} 2>&1 | tee -a "$OUT/trace_decode.log"
fi
if want ncu; then  # Nsight Compute on one decode launch (NCU_VARIANT: a diag_decode.py variant):
  # the full set into a report, then its details (stall reasons, pipes, shared memory) and
  # the SASS with per-instruction samples (CSV)
  if [ -n "$NCU" ]; then
    "$NCU" --version | tail -1
    timeout ${NCU_TIMEOUT:-300} "$NCU" --set full -o "$OUT/ncu_report" -f \
      -k regex:${NCU_KERNEL:-mla_decode} --launch-skip ${NCU_SKIP:-0} --launch-count 1 \
      python3 benchmarks/diag_decode.py --only ${NCU_VARIANT:-pth-registers-s4} --iters 1 \
      ${NCU_DIAG_ARGS:-} > "$OUT/ncu_run.log" 2>&1; tail -3 "$OUT/ncu_run.log"
    "$NCU" -i "$OUT/ncu_report.ncu-rep" --page details --print-details all > "$OUT/ncu.log" 2>&1
    "$NCU" -i "$OUT/ncu_report.ncu-rep" --page source --print-source sass --csv \
      > "$OUT/ncu_sass.csv" 2>&1
    grep -i "stall\|pipe\|bank\|Issue\|Eligible\|Throughput" "$OUT/ncu.log" | head -80
    wc -l "$OUT/ncu_sass.csv"
  else
    echo "ncu: not on this machine" | tee "$OUT/ncu.log"
  fi
fi
if want ncu_ab; then  # Nsight Compute's duration and cycles of one launch per (tree, variant,
  # shape), the trees as in `ab`: under ncu the SM clock is locked to its base (~1.4 GHz on
  # an H100) while memory keeps its clock, so an SM-bound difference shows more than at full
  # clock -- a stand-in for an H200 (1.4x an H100's bandwidth, the same multiprocessors).
  for shape in ${AB_SHAPES:-64,1,16,4096 128,1,16,16384}; do
    for run in ${NCU_RUNS:-alt:pth-registers-s4 .:pth-registers-s4 .:bf16-narrow-s2}; do
      tree=${run%%:*}; variant=${run#*:}
      (cd $tree && PYTHONPATH=$PWD timeout 120 "$NCU" -k regex:mla_decode --launch-count 1 \
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 benchmarks/diag_decode.py --shape $shape --only $variant --iters 1 2>&1 \
        | grep -E "^ +(gpu__|sm__|smsp__|dram__)" | tr -s ' ' | tr '\n' ';' \
        | sed "s|^|$tree $shape $variant:|"; echo)
    done
  done | tee "$OUT/ncu_ab.log"
fi
if want regs; then  # ptxas registers and spills of every decode kernel path (small shapes)
  # A launch of 3+ warpgroups caps ptxas at 65536 / threads registers (168 for 384), whatever
  # setmaxnreg asks later: spills show up here (logs/2026-12-04d_ptxas_registers.log).
  for v in "2,1,16,256 pth-registers-s4" "2,2,16,256 pth-narrow-s2" "2,2,16,256 bf16-narrow-s2" \
           "2,2,64,256 pth-wide-s2" "2,2,64,256 bf16-wide-s2"; do
    set -- $v
    echo "$2 ($1): $(ptxas_of $1 $2)"
  done | tee "$OUT/ptxas_registers.log"
fi
if want demo; then  # the 61-layer demo, cold (empty compilation cache) and again warm
  export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
  for run in cold warm; do
    echo "== demo, $run compilation cache"
    timeout ${DEMO_TIMEOUT:-200} python3 -m jax_mla_cache demo --no-bench --no-deepseek \
      ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo_$run.log" | grep -v "^  step"
  done
  unset JAX_COMPILATION_CACHE_DIR
fi
if want step_profile; then  # the demo step: device time, dispatch, waited vs repeated clocks
  # Twice: XLA's defaults, then without command buffers (CUDA graphs): if the second is no
  # slower, the step's kernels were launched one by one in the first as well.
  for flags in "" "--xla_gpu_enable_command_buffer="; do
    echo "== XLA_FLAGS='$flags'"
    XLA_FLAGS=$(echo "${XLA_FLAGS:-} $flags" | xargs) timeout ${STEP_PROFILE_TIMEOUT:-150} \
      python3 benchmarks/profile_decode_step.py ${STEP_PROFILE_ARGS:-}
  done 2>&1 | tee "$OUT/step_profile.log"
fi
if want compile; then  # where the demo steps' XLA compile goes: per layer, Mosaic vs XLA ops
  { timeout ${COMPILE_TIMEOUT:-360} python3 benchmarks/lower_demo.py --compile --repeat 1 \
      --layers 1 61 --impl pallas xla
    echo "== without XLA's autotuning (--xla_gpu_autotune_level=0)"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 150 \
      python3 benchmarks/lower_demo.py --compile --repeat 1 --layers 61; } 2>&1 \
    | tee "$OUT/compile_breakdown.log"
fi
if want eager; then  # the pool's per-layer calls outside a jit: first pass (compiles), second
  timeout 120 python3 benchmarks/eager_layers.py 2>&1 | tee "$OUT/eager_layers.log"
fi
if want decode_bench; then
  timeout ${DECODE_BENCH_TIMEOUT:-240} python3 -m jax_mla_cache bench --ops decode --iters 10 \
    --no-plot --out "$OUT/decode.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/decode_bench.log"
fi
if want deepseek; then  # DeepSeek-V3 on the cache vs transformers' logits, then the demo section
  timeout -s INT -k 20 ${DEEPSEEK_TIMEOUT:-300} "${PYTEST[@]}" -s --durations=5 tests/test_deepseek_v3.py \
    > "$OUT/gpu_deepseek_tests.log" 2>&1; tail -25 "$OUT/gpu_deepseek_tests.log"
  timeout ${DEEPSEEK_DEMO_TIMEOUT:-300} python3 -c "from jax_mla_cache import demo; demo.deepseek_main()" \
    2>&1 | tee "$OUT/deepseek_demo.log"
fi
if want moves; then   # 61-layer move kernels (~100 s)
  timeout -s INT -k 20 ${MOVES_TIMEOUT:-300} "${PYTEST[@]}" --durations=5 tests/test_pallas_move.py \
    > "$OUT/gpu_move_tests.log" 2>&1; tail -15 "$OUT/gpu_move_tests.log"
fi
if want rope; then    # the fused RoPE write and the sanitizing writes: GPU tests
  timeout -s INT -k 20 ${ROPE_TIMEOUT:-420} "${PYTEST[@]}" --durations=5 tests/test_rope_set.py \
    tests/test_sanitize.py > "$OUT/gpu_rope_tests.log" 2>&1; tail -15 "$OUT/gpu_rope_tests.log"
fi
if want rope_bench; then   # the fused RoPE write's benchmark rows alone (pallas/unfused/xla)
  timeout 400 python3 -m jax_mla_cache bench --ops rope --iters 10 --breakdown --no-plot \
    --out "$OUT/h200_rope.json" 2>&1 | tee "$OUT/bench_rope.log"
fi
if want sanitize; then
  # Line-buffered all the way, so a run cut by its timeout still leaves what it printed.
  # No autotuning: under memcheck each XLA gemm candidate is slow to run.
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool memcheck python3 -u \
    benchmarks/hostile_slots.py ${SANITIZE_ARGS:-} 2>&1 \
    | grep --line-buffered -v "Host Frame" > "$OUT/memcheck.log"; tail -8 "$OUT/memcheck.log"
fi
if want diag_rows; then   # small-T row kernels: floors, zeroing variants, direct loads/stores
  timeout 170 python3 benchmarks/diag_get.py 2>&1 | tee "$OUT/diag_get.log"
  timeout 170 python3 benchmarks/diag_direct.py 2>&1 | grep -v "Warning" | tee "$OUT/diag_direct.log"
  timeout 120 python3 benchmarks/diag_floor.py 2>&1 | tee "$OUT/diag_floor.log"
fi
if want diag_pth; then   # the per_token_head set: its GPU tests (stored bits), then variants timed
  timeout -s INT -k 20 ${DIAG_PTH_TEST_TIMEOUT:-200} "${PYTEST[@]}" tests/test_pallas_rows.py \
    -k "gpu_per_token_head" > "$OUT/gpu_pth_tests.log" 2>&1; tail -4 "$OUT/gpu_pth_tests.log"
  timeout 150 python3 benchmarks/diag_pth_set.py 2>&1 | tee "$OUT/diag_pth_set.log"
  timeout 150 python3 benchmarks/diag_pth_direct.py 2>&1 | grep -v Warning \
    | tee "$OUT/diag_pth_direct.log"   # the one-token kernel vs the block kernel, T = 1 ... 4096
fi
if want diag; then
  timeout 100 python3 benchmarks/diag_gpu.py 2>&1 | tee "$OUT/diag.log"
fi
if want diag_moves; then   # the direct move path's cost vs number and kind of buffers
  timeout ${DIAG_TIMEOUT:-150} python3 benchmarks/diag_moves.py ${DIAG_ARGS:-} 2>&1 \
    | tee -a "$OUT/diag_moves.log"
fi
if want ptx; then   # the direct kernel's PTX and SASS for 61 per_token_head layers
  MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" \
    timeout 120 python3 benchmarks/dump_move_ptx.py > "$OUT/ptx.log" 2>&1; tail -3 "$OUT/ptx.log"
fi
if want bench; then
  timeout 540 python3 -m jax_mla_cache bench --iters 10 --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log"
fi
if want sweep_pth; then   # the per_token_head set's block and stage choices (sweep_rows.py)
  timeout ${SWEEP_PTH_TIMEOUT:-240} python3 benchmarks/sweep_rows.py --ops pth \
    --budget ${SWEEP_BUDGET:-180} 2>&1 | tee "$OUT/sweep_rows_pth.log"
fi
if want sweep; then
  timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/sweep_moves.py --cases ${SWEEP_CASES:-pth} \
    --budget ${SWEEP_BUDGET:-240} 2>&1 | tee "$OUT/sweep.log"
fi
