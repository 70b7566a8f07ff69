"""Small-T row kernels without bulk copies (one device call): the bf16 get and set moving
each row with plain vector loads and stores from registers (no shared memory, no barrier,
no TMA), B tokens per program, against the shipped kernels -- results compared, then timed.
The get is the library's (`RowConfig.direct_block_tokens`, since 2026-12-04 the default for
bf16 rows; the 2026-12-04 log was taken with this script's own copy of that kernel, with an
identical jaxpr); the set stays here as the measured alternative (not faster than the
bulk-copy set).

The 576-element bf16 row is handled as bytes (1152 = 1024 nope + 128 rope): 1024 bytes are
128 threads x 8, the 128 rope bytes 128 x 1 (a 64-element rope has no layout over a
warpgroup's 128 threads in its own dtype).

    PYTHONPATH=$PWD python3 benchmarks/diag_direct.py [--tokens 1,8,64,512,4096] [--blocks 1,4]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import common, rows
from pallas_kernels.rows import as_bytes, from_bytes


def direct_set_kernel(interpret, *, T, nrows, NB, RB, B):
  """The set counterpart of the library's direct gather (same layouts, same blocks)."""
  (_, vn), (_, vr) = rows.direct_layouts(NB // 2, RB // 2, jnp.bfloat16)
  ln = plgpu.Layout.WG_STRIDED((NB,), vec_size=vn)
  lr = plgpu.Layout.WG_STRIDED((RB,), vec_size=vr)

  def body(loc_ref, n_ref, r_ref, kv_ref):
    t0 = rows._block_start(B, T)
    vals = [(plgpu.load(n_ref.at[t0 + i], layout=ln), plgpu.load(r_ref.at[t0 + i], layout=lr))
            for i in range(B)]
    for i, (n, p) in enumerate(vals):
      r = loc_ref[t0 + i]

      @pl.when(common.valid_row(r, nrows))
      def _():
        kv_ref.at[r, pl.ds(0, NB)][...] = n
        kv_ref.at[r, pl.ds(NB, RB)][...] = p

  kernel = plgpu.kernel(body, out_type=(), grid=(pl.cdiv(T, B),), grid_names=("b",),
                        kernel_name="direct_set",
                        interpret=common.interpret_params() if interpret else None)

  def run(kvb, loc, nb, rb):
    ref = jax.new_ref(kvb)
    kernel(loc, nb, rb, ref)
    return jax.freeze(ref)

  return run


def direct_get(cache, layer, loc, B):
  """The library's direct gather (`RowConfig.direct_block_tokens`) with B tokens per program
  (interpret mode off a GPU, as every library kernel)."""
  kv = cache.layer(layer)[0]
  return rows.get_rows(kv, loc, kv_lora_rank=512, dst_dtype=kv.dtype,
                       config=rows.RowConfig(direct_block_tokens=B))


def direct_set(kv, loc, nope, rope, B, interpret=False):
  nrows, _, W = kv.shape
  T = loc.shape[0]
  out = direct_set_kernel(interpret, T=T, nrows=nrows, NB=nope.shape[-1] * 2,
                          RB=rope.shape[-1] * 2, B=B)(
      as_bytes(kv.reshape(nrows, W)), loc, as_bytes(nope.reshape(T, -1)),
      as_bytes(rope.reshape(T, -1)))
  return from_bytes(out, kv.dtype).reshape(nrows, 1, W)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="1,8,64,512,4096")
  ap.add_argument("--blocks", default="1,4")
  ap.add_argument("--iters", type=int, default=20)
  a = ap.parse_args()
  interpret = jax.devices()[0].platform != "gpu"
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1)
  if interpret:
    cfg = cfg.replace(size=8192 - 64)
  rng = np.random.default_rng(0)
  for T in (int(t) for t in a.tokens.split(",")):
    loc_np = rng.permutation(cfg.rows)[:T].astype(np.int32)
    if T >= 4:
      loc_np[1], loc_np[3] = -1, cfg.rows + 7
    loc = jnp.asarray(loc_np)
    nope = jnp.asarray(rng.standard_normal((T, 1, 512)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((T, 1, 64)), jnp.bfloat16)
    cache = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, jnp.arange(cfg.rows) % 4096,
                                 jnp.asarray(rng.standard_normal((cfg.rows, 1, 512)), jnp.bfloat16),
                                 jnp.asarray(rng.standard_normal((cfg.rows, 1, 64)), jnp.bfloat16))
    want_get = mc.get_mla_kv_buffer(cache, 0, loc, implementation="pallas")
    want_kv = mc.set_mla_kv_buffer(jax.tree.map(jnp.copy, cache), 0, loc, nope, rope,
                                   implementation="pallas").layer(0)[0]
    line = []
    for B in (int(b) for b in a.blocks.split(",")):
      if B > T:
        continue
      g = jax.jit(functools.partial(direct_get, B=B), static_argnums=1)
      got = g(cache, 0, loc)
      ok_get = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(got, want_get))
      s = jax.jit(functools.partial(direct_set, B=B, interpret=interpret))
      ok_set = np.array_equal(np.asarray(s(jnp.copy(cache.layer(0)[0]), loc, nope, rope)),
                              np.asarray(want_kv))
      bd_g, bd_s = {}, {}
      if not interpret:
        bench.time_per_call(lambda st: (st[0], st[1], g(st[0], 0, st[1])), (cache, loc, None),
                            a.iters, bd_g)
        sd = jax.jit(functools.partial(direct_set, B=B), donate_argnums=0)
        bench.time_per_call(lambda st: (sd(*st), *st[1:]),
                            (jnp.copy(cache.layer(0)[0]), loc, nope, rope), a.iters, bd_s)
      line.append(f"B={B}: get {'ok' if ok_get else 'MISMATCH'} {sum(bd_g.values()):.3f} "
                  f"{ {k: round(v, 3) for k, v in bd_g.items()} } set {'ok' if ok_set else 'MISMATCH'} "
                  f"{sum(bd_s.values()):.3f} { {k: round(v, 3) for k, v in bd_s.items()} }")
    shipped = []
    if not interpret:
      bd_g, bd_s = {}, {}
      gs = jax.jit(lambda c, l: mc.get_mla_kv_buffer(c, 0, l, implementation="pallas"))
      bench.time_per_call(lambda st: (st[0], st[1], gs(st[0], st[1])), (cache, loc, None),
                          a.iters, bd_g)
      ss = jax.jit(lambda c, *x: mc.set_mla_kv_buffer(c, 0, *x, implementation="pallas"),
                   donate_argnums=0)
      bench.time_per_call(lambda st: (ss(*st), *st[1:]),
                          (jax.tree.map(jnp.copy, cache), loc, nope, rope), a.iters, bd_s)
      shipped.append(f"shipped: get {sum(bd_g.values()):.3f} set {sum(bd_s.values()):.3f}")
    print(f"T={T:<5d} " + " | ".join(line + shipped), flush=True)


if __name__ == "__main__":
  main()
