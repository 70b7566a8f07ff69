# The 61-layer demo's cold compile (empty persistent cache each run) under XLA flag variants,
# interleaved; prints each run's compile and step lines. Temporary experiment (issue 17).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PAR="--xla_gpu_enable_llvm_module_compilation_parallelism=true"
NOAT="--xla_gpu_autotune_level=0"
NOTRITON="--xla_gpu_enable_triton_gemm=false"
VARIANTS=${VARIANTS:-"default parallel autotune0 both default parallel"}
for name in $VARIANTS; do
  case $name in default) flags="";; parallel) flags="$PAR";; autotune0) flags="$NOAT";;
    both) flags="$PAR $NOAT";; notriton) flags="$NOTRITON";; par_notriton) flags="$PAR $NOTRITON";;
  esac
  d=$(mktemp -d)
  echo "== $name: XLA_FLAGS='$flags'"
  JAX_COMPILATION_CACHE_DIR=$d XLA_FLAGS="$flags" timeout ${RUN_TIMEOUT:-120} python3 -m jax_mla_cache demo \
    --no-bench --no-deepseek --steps 16 --no-compare-attention 2>&1 | tee -a "$OUT/compile_flags.log" \
    | grep -i "compile\|ms per step\|ms/step\|tokens/s\|match\|error" | head -8
  rm -rf "$d"
done
