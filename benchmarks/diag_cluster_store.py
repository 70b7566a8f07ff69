"""A store into a cluster peer's shared memory (``plgpu.async_store_smem``: ``st.async``
over distributed shared memory, completing on the peer's barrier), the mechanism of the
registers path's in-kernel merge of two splits (`DecodeConfig.cluster_merge`), alone.

Two programs a cluster, B clusters: program 1 stores a (64, 32) float32 tile (WGMMA layout)
into program 0's shared memory; program 0 waits on its barrier, adds its own tile and writes
the sum. Prints the largest error against x[:, 0] + 2 x[:, 1].

    python benchmarks/diag_cluster_store.py [--no-done] [--arrivals-per-thread] [--interpret]
        [--lower]

--no-done: program 1 exits right after its stores (no rendezvous at a cluster barrier after
program 0 has received them; CUDA asks for one).
--arrivals-per-thread: program 0's barrier set to 128 arrivals a store, as first written:
a barrier counts a warpgroup's 128 threads as one arrival, so it waits for 128 x 128 and
hangs (H100, session 2026-12-07b, `results/logs/2026-12-07b_cluster_merge_first_h100.log`).
Run each variant under `timeout`.
--interpret: interpret mode (it has no ``st.async``: fails).
--lower: lower for CUDA only (no GPU needed).
"""

import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

INTERPRET = "--interpret" in sys.argv
DONE = "--no-done" not in sys.argv
PER_THREAD = "--arrivals-per-thread" in sys.argv
WGMMA = plgpu.Layout.WGMMA
B = 4
TILE = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def body(x_ref, o_ref, box, xs, bar, tma, done):
  s = lax.axis_index("c")
  b = lax.axis_index("b")
  plgpu.copy_gmem_to_smem(x_ref.at[b, s], xs, tma)
  plgpu.barrier_wait(tma)
  x = plgpu.load(xs, layout=WGMMA)

  @pl.when(s == 1)
  def _():
    plgpu.async_store_smem(x * 2.0, box, bar, cluster_idx=0, cluster_dim="c")
    if DONE:
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)

  @pl.when(s == 0)
  def _():
    plgpu.barrier_wait(bar)
    if DONE:
      plgpu.barrier_arrive(done)
    xs[...] = x + plgpu.load(box, layout=WGMMA)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(xs, o_ref.at[b])
    plgpu.wait_smem_to_gmem(0)
    if DONE:
      plgpu.barrier_wait(done)


def run(x):
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, 64, 32), jnp.float32),
      scratch_types=[plgpu.SMEM((64, 32), jnp.float32, transforms=TILE),
                     plgpu.SMEM((64, 32), jnp.float32, transforms=TILE),
                     # (one store: each of its 128 threads arrives once, which a barrier
                     # counts as one warpgroup arrival; --arrivals-per-thread: 128, as
                     # first written, makes the barrier wait for 128 x 128)
                     plgpu.Barrier(num_arrivals=128 if PER_THREAD else 1),
                     plgpu.Barrier(num_arrivals=1),
                     plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1)],
      grid=(B,), grid_names=("b",), cluster=(2,), cluster_names=("c",),
      interpret=plgpu.InterpretGPUParams() if INTERPRET else None)(x)


def main():
  x = jnp.arange(B * 2 * 64 * 32, dtype=jnp.float32).reshape(B, 2, 64, 32) / 7
  variant = ("with" if DONE else "without") + (
      " the rendezvous, 128 arrivals a store" if PER_THREAD else " the rendezvous")
  if "--lower" in sys.argv:
    jax.jit(run).trace(x).lower(lowering_platforms=("cuda",))
    print(f"cluster store ({variant}): lowered for CUDA")
    return
  out = jax.block_until_ready(run(x))
  err = float(jnp.abs(out - (x[:, 0] + 2 * x[:, 1])).max())
  print(f"cluster store ({variant}): max error {err}", flush=True)


if __name__ == "__main__":
  main()
