"""Where a small gather's time goes (one device call): the bulk-copy get kernels as shipped
(zero the rows of bad slots, then fence; for bf16 rows forced with direct_block_tokens=0,
as the default now gathers them without bulk copies: diag_direct.py), with the fence only when a block has a bad slot (a uniform
branch; the callers' own fence is then still there, so on this code that variant measures
an extra branch: the measured experiment is commit "Experiment: get kernels fence only..."),
and with no zeroing at all (a lower bound, wrong for bad slots), next to two floor kernels:
one program that only TMA-stores a row, and one that TMA-loads a row and stores it (the least
a one-row gather does on Mosaic GPU with bulk copies).

    PYTHONPATH=$PWD python3 benchmarks/diag_get.py [--tokens 1,64,512,4096] [--iters 20]

H200 (logs/2026-12-04_diag_get_fence_if_bad.log, on the experiment's code): floors 0.75 us
(store only) and 1.10 us (load + store); the one-token get 1.09 us, at the bulk-copy floor;
the seed's Triton get (0.91 us) uses plain loads and stores. Fencing only when a slot is bad
changed T <= 512 by -0.01..-0.05 us and T = 4096 by +0.2 us: not kept.
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import common, rows

SHIPPED = rows._zero_bad_rows


def _fence_if_bad(slots, nrows, blocks, first=0, fence=True):
  """Zero the bad rows and fence, inside one branch taken only when a slot is bad."""
  bad = [common.invalid_row(r, nrows) for r in slots]

  @pl.when(functools.reduce(jnp.logical_or, bad))
  def _():
    for i, b in enumerate(bad):
      @pl.when(b)
      def _():
        for block in blocks:
          rows._store_zeros(block.at[first + i])
    if fence:
      plgpu.commit_smem()


def _no_zeroing(slots, nrows, blocks, first=0, fence=True):
  del slots, nrows, blocks, first, fence


VARIANTS = {"shipped": SHIPPED, "fence_if_bad": _fence_if_bad, "no_zeroing": _no_zeroing}


def floor_kernels(W: int = 576):
  """(name, jitted fn, arg): a store-only and a load+store one-program kernel."""
  def store_only(o_ref, sm):
    sm[...] = jnp.zeros(sm.shape, sm.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sm, o_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def load_store(x_ref, o_ref, sm, bar):
    for j in range(W // 64):
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(j * 64, 64)], sm.at[pl.ds(j * 64, 64)], bar)
    plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(sm, o_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out = jax.ShapeDtypeStruct((W,), jnp.bfloat16)
  k1 = plgpu.kernel(store_only, out_type=jax.ShapeDtypeStruct((512,), jnp.bfloat16),
                    scratch_types=[plgpu.SMEM((512,), jnp.bfloat16)],
                    grid=(1,), grid_names=("b",), kernel_name="floor_store_only")
  k2 = plgpu.kernel(load_store, out_type=out,
                    scratch_types=[plgpu.SMEM((W,), jnp.bfloat16),
                                   plgpu.Barrier(num_arrivals=W // 64)],
                    grid=(1,), grid_names=("b",), kernel_name="floor_load_store")
  x = jnp.ones((W,), jnp.bfloat16)
  return [("floor_store_only", jax.jit(lambda x: k1()), x),
          ("floor_load_store", jax.jit(k2), x)]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="1,64,512,4096")
  p.add_argument("--iters", type=int, default=20)
  a = p.parse_args()
  for name, f, x in floor_kernels() if jax.devices()[0].platform == "gpu" else ():
    bd = {}
    bench.time_per_call(lambda s, f=f: (f(s[0]),), (x,), a.iters, bd)
    print(f"{name:18s} {bd}", flush=True)
  rng = np.random.default_rng(0)
  for cfg, op in ((mc.DEEPSEEK_V3.replace(layer_num=1), "get"),
                  (mc.DEEPSEEK_V3_FP8.replace(layer_num=1), "get_pth")):
    for T in (int(t) for t in a.tokens.split(",")):
      loc = jnp.asarray(rng.permutation(cfg.rows)[:T].astype(np.int32))
      line = []
      for vname, fn in VARIANTS.items():
        rows._zero_bad_rows = fn
        common._cached_kernel_fn.cache_clear()
        jax.clear_caches()
        if op == "get":  # the bulk-copy gather (bf16 rows otherwise take the direct one)
          bulk = dataclasses.replace(rows.tuned_config("get", T), direct_block_tokens=0)
          f = jax.jit(lambda c, l, bulk=bulk: rows.get_rows(
              c.layer(0)[0], l, kv_lora_rank=512, dst_dtype=jnp.bfloat16, config=bulk))
        else:
          f = jax.jit(lambda c, l: mc.get_mla_kv_buffer(c, 0, l, jnp.bfloat16,
                                                        implementation="pallas"))
        cache = mc.init_cache(cfg)
        bd = {}
        bench.time_per_call(lambda s: (s[0], s[1], f(s[0], s[1])), (cache, loc, None),
                            a.iters, bd)
        kern = {k: round(v, 3) for k, v in bd.items()}
        line.append(f"{vname} {sum(bd.values()):.3f} {kern}")
      rows._zero_bad_rows = SHIPPED
      print(f"{op:8s} T={T:<5d} " + " | ".join(line), flush=True)


if __name__ == "__main__":
  main()
