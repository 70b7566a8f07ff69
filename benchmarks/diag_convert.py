"""The per_token_head decode kernels' fp8 -> bf16 block conversion alone: one warpgroup
converts a (64, 512) block in shared memory `--repeats` times (to bf16 through float32,
to f16 directly), in the register layouts the kernels use (WGMMA_UPCAST_2X, WGMMA) and
WGMMA_UPCAST_4X (slower: logs/2026-12-05g_convert_layout_4x_not_kept_h100.log); device time
per block (profiler, as bench.py). Its first run (logs/2026-12-04b_diag_convert_bit_moves.log)
also timed integer bit moves (prmt/shift/mask + an exact bf16x2 multiply), slower, since
removed.

    PYTHONPATH=$PWD python3 benchmarks/diag_convert.py [--repeats 400]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_mla_cache import bench
from pallas_kernels import mla_decode_parts as parts


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=400)
  parser.add_argument("--iters", type=int, default=5)
  args = parser.parse_args()
  x = np.random.default_rng(0).integers(0, 256, (64, 512)).astype(np.uint8)
  x = jnp.asarray(x.view(jnp.float8_e4m3fn))
  for dtype in (jnp.bfloat16, jnp.float16):
    for layout in ("WGMMA_UPCAST_4X", "WGMMA_UPCAST_2X", "WGMMA"):
      f = jax.jit(parts.convert_tile_kernel(512, layout=getattr(plgpu.Layout, layout),
                                            repeats=args.repeats, dtype=dtype))
      us, _, method = bench.time_per_call(lambda st: (st[0], f(st[0])), (x, None), args.iters)
      print(f"-> {jnp.dtype(dtype).name:8s} {layout:16s} {us / args.repeats * 1e3:8.1f} ns a "
            f"64x512 block ({method}, {args.repeats} blocks a call)", flush=True)


if __name__ == "__main__":
  main()
