"""Where a demo decode step's wall-clock time goes: device work, dispatch, the per-step wait.

The demo prints two clocks that differ by ~2.6 ms on the H200 (61 layers, batch 32): its
generation loop (sample, step, wait for every step: 6.2-7.9 ms) and the same step repeated
without waiting (3.5-3.6 ms). This script measures, on one model and cache, after warm-up:

* device     -- the GPU time of one step: the sum of its kernels / memcpys in a profiler
                trace (`bench.gpu_events`), and how many there are a step (launches);
* dispatch   -- how long the jitted step's Python call takes to return (the host's work to
                enqueue the step; JAX dispatches asynchronously), the previous step done;
* repeated   -- wall clock a step, steps enqueued back to back, one wait at the end;
* waited     -- wall clock a step, waiting for each step before the next (no sampling);
* loop       -- as the demo's loop: greedy sample, step, wait.

If `waited` ~ dispatch + device, the host's enqueue is not overlapped with the GPU; if
`repeated` ~ dispatch > device, the host is the bound even back to back.

    PYTHONPATH=$PWD python3 benchmarks/profile_decode_step.py [--layers 61] [--iters 20]

Runs on CPU too (small model, wall clocks only, no device split).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench, demo
from jax_mla_cache.models import mla_demo


def _median_ms(samples: list[float]) -> float:
  return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> dict:
  on_gpu = jax.devices()[0].platform == "gpu"
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=61 if on_gpu else 2)
  parser.add_argument("--batch", type=int, default=32 if on_gpu else 4)
  parser.add_argument("--prompt-len", type=int, default=512 if on_gpu else 32)
  parser.add_argument("--iters", type=int, default=20 if on_gpu else 5)
  parser.add_argument("--attention", choices=("mla_decode", "gather"), default="mla_decode")
  args = parser.parse_args(argv)
  steps = 2 * args.iters + 8
  dargs = demo._parse([f"--layers={args.layers}", f"--batch={args.batch}",
                       f"--prompt-len={args.prompt_len}", f"--steps={steps}"], on_gpu)
  cache_cfg = demo.cache_config(dargs, on_gpu)
  model_cfg = mla_demo.MLADemoConfig(
      cache=cache_cfg, dtype=jnp.bfloat16 if on_gpu else jnp.float32,
      **(demo.GPU_MODEL if on_gpu else {}))
  B, S = args.batch, args.prompt_len
  params = mla_demo.init_params(model_cfg, seed=0)
  cache = mc.init_cache(cache_cfg)
  page_table = jnp.asarray(mla_demo.make_page_table(B, S + steps, cache_cfg))
  prompt = jnp.asarray(np.random.default_rng(1).integers(0, model_cfg.vocab_size, (B, S)),
                       jnp.int32)
  lengths = jnp.full((B,), S, jnp.int32)
  print(f"{jax.devices()[0].device_kind}: {args.layers} layers, batch {B}, prompt {S}, "
        f"{args.attention} attention; compiling...", flush=True)
  logits, cache = mla_demo.prefill(params, cache, prompt, lengths, page_table)
  greedy = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))
  tokens = greedy(logits)
  step = lambda cache, pos: mla_demo.decode(params, cache, tokens, pos, page_table,
                                            attention=args.attention)
  pos = [jnp.full((B,), S + i, jnp.int32) for i in range(steps)]
  # Warm-up (compile) on the first positions; each timing below writes fresh positions.
  k = 0
  for _ in range(3):
    logits, cache = step(cache, pos[k]); k += 1
  jax.block_until_ready(logits)

  dispatch, waited = [], []
  for _ in range(args.iters):
    t0 = time.perf_counter()
    logits, cache = step(cache, pos[k]); k += 1
    t1 = time.perf_counter()
    logits.block_until_ready()
    t2 = time.perf_counter()
    dispatch.append(t1 - t0)
    waited.append(t2 - t0)

  loop = []
  for _ in range(args.iters // 2):
    t0 = time.perf_counter()
    tok = greedy(logits)
    logits, cache = mla_demo.decode(params, cache, tok, pos[k], page_table,
                                    attention=args.attention); k += 1
    logits.block_until_ready()
    loop.append(time.perf_counter() - t0)

  # Repeated: the same position again (as the demo's repeated-step clock), back to back.
  last = pos[k - 1]
  t0 = time.perf_counter()
  for _ in range(args.iters):
    logits, cache = step(cache, last)
  logits.block_until_ready()
  repeated = (time.perf_counter() - t0) / args.iters

  result = {"dispatch_ms": _median_ms(dispatch), "waited_ms": _median_ms(waited),
            "loop_ms": _median_ms(loop), "repeated_ms": repeated * 1e3}
  if on_gpu:
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        for _ in range(args.iters):
          logits, cache = step(cache, last)
        logits.block_until_ready()
      events = bench.gpu_events(d, counts=True)
    if events is not None:
      totals, counts = events
      result["device_ms"] = sum(totals.values()) / args.iters / 1e6
      result["launches"] = sum(counts.values()) / args.iters
      top = sorted(totals.items(), key=lambda kv: -kv[1])[:12]
      print("  largest GPU events a step (us, count a step):")
      for name, ns in top:
        print(f"    {ns / args.iters / 1e3:9.1f}  {counts[name] / args.iters:5.0f}  {name[:90]}")
  print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in result.items()))
  return result


if __name__ == "__main__":
  main()
