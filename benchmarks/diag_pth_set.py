"""Where the per_token_head set's time goes (one device call): the shipped kernel against
variants with parts of SPEC §3's quantization replaced, at the bench's T values. Timing
only: the variants' results are not the library's.

* base     -- the shipped kernel;
* recip    -- every quotient (nope and rope) as ``x * (1 / scale)``: the cost of exact
              division, whichever way the shipped kernel does it;
* clip     -- the fp8 cast with the clip to +-448 that interpret mode needs (the shipped
              kernel leaves it to the saturating conversion since session 2026-12-05f);
* bf16 set -- the plain set of the same tokens, for the ratio.

(Session 2026-12-05f, H100: base / clip / bf16 set 1.53 / 1.55 / 1.18 us at T=1, 3.18 /
3.40 / 2.48 at T=4096, 22.35 / 22.79 / 28.13 at T=32768; recip 2.79 at T=4096:
`logs/2026-12-05f_diag_pth_set_noclip_h100.log`. Runs of 2026-12-04c: before 77f3204
`recip` replaced every ``div.rn.f32`` (1.71 -> 1.23 us at T=1); in the run after it,
`recip` still replaced only `common.true_divide`, by then the rope quotients alone (1.32 ->
1.28 us). A third variant without amax or division never printed on the GPU and was
removed.)

    PYTHONPATH=$PWD python3 benchmarks/diag_pth_set.py [--tokens 1,64,512,4096,32768]
"""

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import common, rows

_true_divide = common.true_divide
_scale_divide = common.scale_divide
_to_fp8 = rows._to_fp8


def _recip_divide(x, per_row, interpret, layout=None, row_layout=None):
  del interpret, layout, row_layout
  return x * jnp.broadcast_to((1.0 / per_row)[:, None], x.shape)


@contextlib.contextmanager
def variant(name):
  try:
    if name == "recip":
      common.true_divide = common.scale_divide = _recip_divide
    if name == "clip":
      rows._to_fp8 = lambda q, interpret: common.cast_from_f32(q, jnp.float8_e4m3fn)
    yield
  finally:
    common.true_divide, common.scale_divide = _true_divide, _scale_divide
    rows._to_fp8 = _to_fp8


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", default="1,64,512,4096,32768")
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args()
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1)
  qcfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  rng = np.random.default_rng(0)
  for T in map(int, args.tokens.split(",")):
    loc = jnp.asarray(rng.permutation(cfg.rows)[:T].astype(np.int32))
    nope = jnp.asarray(rng.standard_normal((T, 1, 512)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((T, 1, 64)), jnp.bfloat16)
    f = jax.jit(lambda s, l, n, r: mc.set_mla_kv_buffer(s, 0, l, n, r), donate_argnums=0)
    us, *_ = bench.time_per_call(lambda st: (f(*st), *st[1:]),
                                 (mc.init_cache(cfg), loc, nope, rope), args.iters)
    print(f"T={T:5d} bf16 set  {us:7.2f} us", flush=True)
    for name in ("base", "clip", "recip"):
      config = dataclasses.replace(rows.tuned_config("set_per_token_head", T),
                                   kernel_tag="_" + name)
      with variant(name):
        g = jax.jit(lambda b, l, n, r, config=config: rows.set_rows_per_token_head(
            *b, l, n, r, config=config), donate_argnums=0)
        bufs = tuple(jax.tree.leaves(mc.init_cache(qcfg)))   # (nope, scale, rope) of layer 0
        us, *_ = bench.time_per_call(lambda st: (g(*st), *st[1:]), (bufs, loc, nope, rope),
                                     args.iters)
      print(f"T={T:5d} pth {name:8s} {us:7.2f} us", flush=True)


if __name__ == "__main__":
  main()
