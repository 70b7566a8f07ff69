"""The per_token_head set's two kernels side by side: one token a program with plain loads
and stores (`RowConfig.direct_block_tokens=1`, `rows._set_pth_direct`) and the bulk-copy
block kernel (`direct_block_tokens=0`, otherwise the tuned config), each checked bit for bit
against the reference, then timed next to the bf16 set (device time from a profiler trace).
Where the direct kernel's bound in `rows.TUNED_CONFIGS` comes from.

    PYTHONPATH=$PWD python3 benchmarks/diag_pth_direct.py [--tokens 1,64,512] [--check-only]

(On a CPU host: XLA_FLAGS=--xla_force_host_platform_device_count=8 and --rows 4096.)
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench, reference
from pallas_kernels import rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="1,8,64,128,256,384,512,4096")
  ap.add_argument("--rows", type=int, default=1 << 18)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--check-only", action="store_true")
  args = ap.parse_args()
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1, size=args.rows)
  qcfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  rng = np.random.default_rng(0)
  for T in map(int, args.tokens.split(",")):
    loc = jnp.asarray(rng.choice(args.rows, T, replace=False).astype(np.int32))
    nope = jnp.asarray(rng.standard_normal((T, 1, 512)) * 3, jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((T, 1, 64)), jnp.bfloat16)
    layer = lambda: tuple(jax.tree.leaves(mc.init_cache(qcfg)))   # (nope, scale, rope)
    want = jax.jit(reference.set_rows_per_token_head)(*layer(), loc, nope, rope)
    tuned = rows.tuned_config("set_per_token_head", T)
    line = f"T={T:5d}"
    times = {}
    for name, direct in (("direct", 1), ("block", 0)):
      config = dataclasses.replace(tuned, direct_block_tokens=direct, kernel_tag="_" + name)
      f = jax.jit(lambda b, l, n, r, config=config: rows.set_rows_per_token_head(
          *b, l, n, r, config=config), donate_argnums=0)
      got = f(layer(), loc, nope, rope)
      same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                 for a, b in zip(got, want))
      line += f"  {name} {'bit-equal' if same else 'MISMATCH'}"
      if not args.check_only:
        times[name], *_ = bench.time_per_call(lambda st, f=f: (f(*st), *st[1:]),
                                              (layer(), loc, nope, rope), args.iters)
    if not args.check_only:
      g = jax.jit(lambda s, l, n, r: mc.set_mla_kv_buffer(s, 0, l, n, r), donate_argnums=0)
      times["bf16"], *_ = bench.time_per_call(lambda st: (g(*st), *st[1:]),
                                              (mc.init_cache(cfg), loc, nope, rope), args.iters)
      line += "  " + "  ".join(f"{k} {v:.3f} us" for k, v in times.items())
      line += "  " + "  ".join(f"{k}/bf16 {times[k] / times['bf16']:.2f}x"
                               for k in ("direct", "block"))
    print(line, flush=True)


if __name__ == "__main__":
  main()
