"""Tensor-core time of one m64nNk16 bf16 wgmma instruction by N, by where A comes from
(shared memory "ss" or registers "rs") and by how many independent accumulators take turns:
one warpgroup, A (64 x 64) and B (64 x N) in shared memory, `--repeats` iterations of
`--depth` K=64 products per accumulator (4 instructions each) before one wait; device time
from a profiler trace (as bench.py), divided by the instructions issued.

The decode kernels' per_token_head path at 16 query rows issues m64n16k16 products (N = the
query rows); this says what one costs against the wider shapes the wide path uses.

    PYTHONPATH=$PWD python3 benchmarks/diag_wgmma_rate.py [--ns 16,32,64,128,256]
        [--accs 1,2,4] [--modes ss,rs] [--lower]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_mla_cache import bench
from pallas_kernels import mla_decode_parts as parts

F32, BF16 = jnp.float32, jnp.bfloat16
WGMMA = plgpu.Layout.WGMMA


def kernel(N: int, mode: str, n_acc: int, depth: int, repeats: int):
  pro = parts.prologue(BF16, 64, 1.0)

  def body(a_ref, b_ref, o_ref, a_smem, b_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)
    plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
    plgpu.barrier_wait(bar)
    a = plgpu.load(a_smem, layout=WGMMA) if mode == "rs" else a_smem
    b = b_smem.transpose((1, 0))

    def step(_, accs):
      def products(refs):
        for _ in range(depth):
          for acc in refs:
            plgpu.wgmma(acc, a, b)
      return pl.run_state(products)(tuple(plgpu.ACC.init(x) for x in accs))

    zero = plgpu.layout_cast(jnp.zeros((64, N), F32), WGMMA)
    accs = jax.lax.fori_loop(0, repeats, step, (zero,) * n_acc)
    total = accs[0]
    for acc in accs[1:]:
      total = total + acc
    o_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((64, N), F32),
      scratch_types=[plgpu.SMEM((64, 64), BF16, transforms=pro.tile),
                     plgpu.SMEM((N, 64), BF16, transforms=pro.tile),
                     plgpu.SMEM((64, N), F32), plgpu.Barrier(num_arrivals=2)],
      num_threads=1, thread_name="wg", kernel_name=f"wgmma_{mode}_n{N}_acc{n_acc}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--ns", default="16,32,64,128,256")
  parser.add_argument("--accs", default="1,2,4")
  parser.add_argument("--modes", default="ss,rs")
  parser.add_argument("--depth", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=200)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--lower", action="store_true", help="only lower each for CUDA (CPU)")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.integers(-2, 3, (64, 64)), BF16)
  for N in map(int, args.ns.split(",")):
    b = jnp.asarray(rng.integers(-2, 3, (N, 64)), BF16)
    for mode in args.modes.split(","):
      for n_acc in map(int, args.accs.split(",")):
        if args.lower:
          jax.jit(kernel(N, mode, n_acc, 2, 2)).trace(a, b).lower(lowering_platforms=("cuda",))
          print(f"n{N} {mode} acc{n_acc}: lowers for CUDA", flush=True)
          continue
        got = np.asarray(jax.jit(kernel(N, mode, n_acc, 2, 3))(a, b))
        want = 6 * n_acc * (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T)
        ok = np.array_equal(got, want)
        f = jax.jit(kernel(N, mode, n_acc, args.depth, args.repeats))
        us, _, _ = bench.time_per_call(lambda st: (st[0], f(st[0], b)), (a, None), args.iters)
        n_instr = args.repeats * args.depth * n_acc * 4
        ns = us * 1e3 / n_instr
        tflops = 2 * 64 * N * 16 / ns * 1e-3 * 132
        print(f"m64n{N:<3d}k16 {mode} {n_acc} acc: {ns:6.2f} ns an instruction "
              f"({tflops:6.1f} TFLOPS if every SM did this){'' if ok else '  WRONG RESULT'}",
              flush=True)


if __name__ == "__main__":
  main()
