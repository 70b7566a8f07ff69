"""The XLA work of a multi-layer decode step: does a jitted step that decodes several layers
with one page table make the kernels' page-table operand (`make_meta`) once, or once a
layer? Prints the GPU events of one step of `--layers` per_token_head decode calls by name,
count and device time (profiler trace, as bench.py); on a CPU, the number of the operand's
concatenates in the optimized HLO (the kernel in interpret mode, small shapes).

    PYTHONPATH=$PWD python3 benchmarks/diag_call_xla.py [--layers 4] [--iters 20]
        [--shape B,context]

(Session 2026-12-06i, CPU: one concatenate for four calls -- XLA merges the layers' copies.
The script's first version also compared epilogues of the registers path; the kernel has
written its output rows in order since, so there is no epilogue left to compare.)
"""

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench


def step_events(step, args, iters):
  """(us per step per GPU event name, events per step per name)."""
  jax.block_until_ready(step(*args))
  jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(iters):
        res = step(*args)
      jax.block_until_ready(res)
    totals, number = bench.gpu_events(d, counts=True)
  return ({k: v / iters / 1e3 for k, v in totals.items()},
          {k: n / iters for k, n in number.items()})


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--shape", default="64,4096", help="B,context (16 heads, s_q 1)")
  args = parser.parse_args()
  B, ctx = map(int, args.shape.split(","))
  H = 16
  gpu = jax.devices()[0].platform == "gpu"
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1, dtype=jnp.float8_e4m3fn,
                               quant_method="per_token_head")
  if not gpu:
    cfg, B, ctx = cfg.replace(size=1024, page_size=64), 2, 128
  cache = bench.decode_cache(cfg)
  table, lens, q = bench.decode_problem(np.random.default_rng(0), cfg, B, 1, H, ctx)

  @jax.jit
  def step(cache, q, table, lens):
    outs = []
    for layer in range(args.layers):   # one layer's buffers, a different q each time
      out, _ = mc.mla_decode(cache, 0, q * (layer + 1), table, lens, sm_scale=0.1,
                             implementation="pallas")
      outs.append(out)
    return outs

  operands = (cache, q, table, lens)
  if not gpu:
    text = step.lower(*operands).compile().as_text()
    print(f"{args.layers} layers (cpu): the page-table operand's concatenate in the "
          f"optimized HLO {text.count('concatenate(')} times")
    return
  us, number = step_events(step, operands, args.iters)
  print(f"{args.layers} layers, B={B} context={ctx}: {sum(us.values()):.2f} us a step")
  for name in sorted(us, key=lambda k: -us[k]):
    print(f"  {number[name]:4.1f} x  {us[name]:8.2f} us  {name}")


if __name__ == "__main__":
  main()
