"""Host time to lower the 61-layer move kernels for CUDA (no GPU needed).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 benchmarks/lower_moves.py [case ...]

For each case (DeepSeek-V3 buffers: 2**18 + 64 rows, 61 layers, plain bf16 or per_token_head
trios; T or page counts of `jax_mla_cache.bench`'s move records and the path boundaries)
prints the wall and CPU seconds of ``jax.jit(...).trace(...).lower(lowering_platforms=
("cuda",))``, the path `pallas_kernels.move.choose` takes and the number of distinct Mosaic
kernels in the lowered module. The first case also pays JAX's one-time start-up; run a
small case first when timing one case alone.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.move import choose, move_pages, move_rows

ROWS = 2**18 + 64
PLAIN = [jax.ShapeDtypeStruct((ROWS, 1, 576), jnp.bfloat16)] * 61
PTH = [s for _ in range(61) for s in (
    jax.ShapeDtypeStruct((ROWS, 1, 512), jnp.float8_e4m3fn),
    jax.ShapeDtypeStruct((ROWS, 1, 1), jnp.float32),
    jax.ShapeDtypeStruct((ROWS, 1, 64), jnp.bfloat16))]
PAGE_SIZE = 64

# name -> (buffers, count, page_size or None for a token move)
CASES = {
    "rows plain T=64": (PLAIN, 64, None),
    "rows plain T=1024": (PLAIN, 1024, None),
    "rows plain T=4096": (PLAIN, 4096, None),
    "rows plain T=8192": (PLAIN, 8192, None),
    "rows pth T=64": (PTH, 64, None),
    "rows pth T=4096": (PTH, 4096, None),
    "rows pth T=32768": (PTH, 32768, None),
    "pages plain P=1": (PLAIN, 1, PAGE_SIZE),
    "pages plain P=16": (PLAIN, 16, PAGE_SIZE),
    "pages plain P=256": (PLAIN, 256, PAGE_SIZE),
    "pages plain P=1024": (PLAIN, 1024, PAGE_SIZE),
    "pages pth P=16": (PTH, 16, PAGE_SIZE),
}


def lower(buffers, count: int, page_size: int | None) -> tuple[float, float, int]:
  """(wall s, CPU s, distinct Mosaic kernels) of one CUDA lowering."""
  index = jax.ShapeDtypeStruct((count,), jnp.int32)
  fn = move_rows if page_size is None else (
      lambda b, t, s: move_pages(b, t, s, page_size=page_size))
  wall, cpu = time.perf_counter(), time.process_time()
  lowered = jax.jit(fn, donate_argnums=0).trace(buffers, index, index).lower(
      lowering_platforms=("cuda",))
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  return wall, cpu, lowered.as_text().count("custom_call @mosaic_gpu_v2(")


def main(names: list[str]) -> None:
  for name in names or list(CASES):
    buffers, count, page_size = CASES[name]
    path, _ = choose(buffers, count, page_size or 1)
    wall, cpu, kernels = lower(buffers, count, page_size)
    print(f"{name:20s} {path:8s} {wall:6.2f} s wall {cpu:6.2f} s cpu  kernels={kernels}",
          flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
