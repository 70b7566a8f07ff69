"""Dump the PTX/SASS of the direct move kernel for 61 per_token_head layers (one GPU).

    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx \\
      PYTHONPATH=$PWD python3 benchmarks/dump_move_ptx.py

Shows how the kernel receives its 183 buffers (the ``.param`` list) and what finding one
buffer's address costs per thread, for each ``direct_select``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.move import MoveTiling, move_rows

ROWS = 4096 + 64
KINDS = (((512,), jnp.float8_e4m3fn), ((1,), jnp.float32), ((64,), jnp.bfloat16))


def main():
  for select in ("chain", "tree"):
    buffers = [jnp.zeros((ROWS, 1, *s), d) for _ in range(61) for s, d in KINDS]
    tgt, src = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, 16, dtype=jnp.int32)
    tiling = MoveTiling(direct_select=select)
    out = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling), donate_argnums=0)(
        buffers, tgt, src)
    jax.block_until_ready(out)
    print(select, "ran", np.asarray(out[0][0, 0, :4]).tolist(), flush=True)


if __name__ == "__main__":
  main()
