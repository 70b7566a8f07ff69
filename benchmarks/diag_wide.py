"""Is the wide decode path (64 query rows a program, H=128) limited by moving KV blocks into
shared memory? A load-only kernel with the wide path's pipeline: a TMA producer warpgroup
streams each sequence's 64-token bf16 blocks (64 x 576) through a ring of `stages` buffers
next to a 72 KB buffer that stands for the query tile, two consumer warpgroups only wait for
each block and release it. `m_tiles` programs read the same sequence, as the M tiles of
H=128 do (2 at s_q=1, 4 at s_q=2); with `--cluster` they form a cluster and each block is
loaded once for the cluster by a TMA multicast. Device time per call (profiler, as bench.py)
and per block of one program, to set against the decode kernels' figures.

    PYTHONPATH=$PWD python3 benchmarks/diag_wide.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_mla_cache import bench
from pallas_kernels.mla_decode_parts import produce, prologue

W, BLOCK = 576, 64


def load_only(B: int, m_tiles: int, n_blocks: int, *, cluster: bool, stages: int, q_kb: int):
  pro = prologue(jnp.bfloat16, 64, 1.0)

  def body(kv_ref, pt_ref, out_ref, q_smem, kv_smem, kv_bar, free_bar):
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")

    @pl.when(wg < 2)
    def _consumers():
      @pl.loop(0, n_blocks)
      def _(i):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(kv_bar.at[slot])
        plgpu.barrier_arrive(free_bar.at[slot])

    @pl.when(wg == 2)
    def _producer():
      def load(i):
        slot = lax.rem(i, stages)
        row = pt_ref[b, i] * BLOCK
        plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, BLOCK)], kv_smem.at[slot],
                                kv_bar.at[slot], collective_axes="m" if cluster else None)
      produce(n_blocks, stages, free_bar, load)

  free = (plgpu.ClusterBarrier(collective_axes=("m",), num_arrivals=2, num_barriers=stages)
          if cluster else plgpu.Barrier(num_arrivals=2, num_barriers=stages))
  grid = dict(grid=(B,), grid_names=("b",), cluster=(m_tiles,), cluster_names=("m",)) \
      if cluster else dict(grid=(m_tiles, B), grid_names=("m", "b"))
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32),
      scratch_types=[plgpu.SMEM((q_kb * 512,), jnp.bfloat16),
                     plgpu.SMEM((stages, BLOCK, W), jnp.bfloat16, transforms=pro.tile),
                     plgpu.Barrier(num_arrivals=1, num_barriers=stages), free],
      num_threads=3, thread_name="wg", kernel_name="load_only", **grid)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--B", type=int, default=128)
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args()
  n_blocks = args.context // BLOCK
  rows = args.B * args.context
  kv = jnp.asarray(np.random.default_rng(0).standard_normal((rows, W)), jnp.bfloat16)
  pt = jnp.asarray(np.random.default_rng(1).permutation(rows // BLOCK).reshape(args.B, n_blocks),
                   jnp.int32)
  for m_tiles in (1, 2, 4):
    for cluster, stages, q_kb in ((False, 2, 72), (True, 2, 72), (False, 3, 0)):
      if cluster and m_tiles == 1:
        continue
      try:
        f = jax.jit(load_only(args.B, m_tiles, n_blocks, cluster=cluster, stages=stages,
                              q_kb=q_kb))
        us, _, method = bench.time_per_call(lambda st: (st[0], f(kv, pt)), (kv, None),
                                            args.iters)
      except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on
        print(f"m_tiles={m_tiles} cluster={cluster} stages={stages}: {type(e).__name__}: "
              f"{str(e)[:300]}", flush=True)
        continue
      programs = m_tiles * args.B
      per_block = us / -(-programs // 132) / n_blocks
      read = programs * n_blocks * BLOCK * W * 2 / (us * 1e-6) / 1e12
      print(f"-> m_tiles={m_tiles} cluster={cluster!s:5s} stages={stages} q={q_kb}KB "
            f"{us:8.1f} us  {per_block * 1e3:6.0f} ns a block a program  "
            f"{read:5.2f} TB/s into shared memory ({method})", flush=True)


if __name__ == "__main__":
  main()
