"""First and second pass of per-layer calls outside any jit, as the stateful pool's users
make them (the seed's API: `pool.set_mla_kv_buffer(layer, ...)` layer by layer).

    PYTHONPATH=$PWD python3 benchmarks/eager_layers.py [--layers 61]

For a plain and a per_token_head pool (`mc.SMALL` geometry, `layer_num` layers), the wall
seconds of one set + get on every layer the first time (compiling whatever each call
needs) and a second time (dispatch only). On any backend; the CPU runs XLA's ops.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, default=61)
  a = ap.parse_args()
  L = a.layers
  print(f"({os.path.dirname(mc.__file__)}, jax {jax.__version__}, {jax.devices()[0].platform})")
  for quant in (None, "per_token_head"):
    dtype = jnp.float8_e4m3fn if quant else jnp.bfloat16
    cfg = mc.SMALL
    pool = mc.MLATokenToKVPool(size=cfg.size, page_size=cfg.page_size, model_dtype=jnp.bfloat16,
                               dtype=dtype, quant_method=quant, kv_lora_rank=cfg.kv_lora_rank,
                               qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=L)
    loc = np.arange(4, dtype=np.int32) + 3
    nope = jnp.ones((4, 1, cfg.kv_lora_rank), jnp.bfloat16)
    rope = jnp.ones((4, 1, cfg.qk_rope_head_dim), jnp.bfloat16)
    times = []
    for _ in range(2):
      t0 = time.perf_counter()
      for layer in range(L):
        pool.set_mla_kv_buffer(layer, loc, nope, rope)
        out = pool.get_mla_kv_buffer(layer, loc)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
    print(f"{quant or 'plain'}: {L} layers x (set + get): first pass {times[0]:.2f} s, "
          f"second pass {times[1]:.3f} s", flush=True)


if __name__ == "__main__":
  main()
