"""`python -m jax_mla_cache {demo,bench} [args]`.

demo   the main job: a DeepSeek-style MLA model's prefill + decode steps on the
       cache (GPU if present), then DeepSeek-V3 from a Hugging Face checkpoint on the cache
       (`--deepseek*` options, `--no-deepseek` skips it), then the kernel benchmark table
       (`--no-bench` skips it).
bench  the kernel benchmark alone; writes benchmarks/results/<device>.json + .png.

Both keep JAX's persistent compilation cache in $JAX_COMPILATION_CACHE_DIR, or
~/.cache/jax_mla_cache/xla (`--no-compilation-cache` turns it off): a second run of the
same shapes loads its compiled steps instead of compiling them again.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] in (["-h"], ["--help"]):
    cmd = argv.pop(0)
  else:
    cmd = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
  if cmd in ("bench", "demo"):
    from jax_mla_cache import demo
    use_cache = "--no-compilation-cache" not in argv
    argv = [a for a in argv if a != "--no-compilation-cache"]
    if use_cache:
      print(f"JAX persistent compilation cache: {demo.use_compilation_cache()}", flush=True)
  if cmd == "bench":
    from jax_mla_cache import bench
    bench.main(argv)
    return 0
  if cmd == "demo":
    from jax_mla_cache import demo
    run_bench = "--no-bench" not in argv
    argv = [a for a in argv if a != "--no-bench"]
    argv, deepseek_argv = demo.split_deepseek_args(argv)
    demo.check_deepseek_args(deepseek_argv)
    demo.main(argv)
    demo.deepseek_main(deepseek_argv)
    if run_bench:
      from jax_mla_cache import bench
      print()
      bench.main(["--out", _bench_out()])
    return 0
  print(__doc__, file=sys.stderr)
  return 0 if cmd in ("-h", "--help", "help") else 2


def _bench_out() -> str:
  """The demo's benchmark writes next to the committed results, not over them, off-GPU."""
  import jax
  return ("benchmarks/results/h200.json" if "H200" in jax.devices()[0].device_kind
          else "benchmarks/results/local_" + jax.devices()[0].platform + ".json")


if __name__ == "__main__":
  sys.exit(main())
