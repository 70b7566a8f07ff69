"""Where the direct move path's fixed cost goes: time vs number and kind of buffers (one GPU).

    cd repo && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/diag_moves.py

Times `pallas_kernels.move.move_rows` (profiler device time per call, every GPU event
listed) on buffer lists of 2**16 + 64 rows: plain bf16 rows (576) for 20, 61 and 183 buffers,
and per_token_head parts (fp8 nope 512, f32 scale, bf16 rope 64) alone and together, at
T = 8 and 64 (random distinct disjoint rows). The contents are zeros: only time is measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache.bench import time_per_call
from pallas_kernels.move import move_rows

ROWS = 2**16 + 64
PLAIN = ((576,), jnp.bfloat16)
NOPE, SCALE, ROPE = ((512,), jnp.float8_e4m3fn), ((1,), jnp.float32), ((64,), jnp.bfloat16)


def run(name, kinds, layers, tokens, iters=20):
  buffers = [jnp.zeros((ROWS, 1, *shape), dtype) for _ in range(layers) for shape, dtype in kinds]
  perm = np.random.default_rng(tokens).permutation(ROWS)[: 2 * tokens].astype(np.int32)
  tgt, src = jnp.asarray(perm[:tokens]), jnp.asarray(perm[tokens:])
  f = jax.jit(move_rows, donate_argnums=0)
  bd = {}
  us, _, method = time_per_call(lambda st: (f(*st), *st[1:]), (buffers, tgt, src), iters, bd)
  nbytes = 2 * tokens * layers * sum(np.prod(s) * jnp.dtype(d).itemsize for s, d in kinds)
  print(f"{name:22s} buffers={layers * len(kinds):4d} T={tokens:5d} {us:9.2f} us "
        f"{nbytes / us / 1e3:8.1f} GB/s [{method}]  " +
        "  ".join(f"{k[:40]}={v:.2f}" for k, v in sorted(bd.items(), key=lambda kv: -kv[1])),
        flush=True)


def main():
  print(f"diag_moves on {jax.devices()[0].device_kind}", flush=True)
  for tokens in (8, 64):
    run("plain", [PLAIN], 20, tokens)
    run("plain", [PLAIN], 61, tokens)
    run("plain", [PLAIN], 183, tokens)
    run("nope", [NOPE], 61, tokens)
    run("scale", [SCALE], 61, tokens)
    run("rope", [ROPE], 61, tokens)
    run("nope+rope", [NOPE, ROPE], 61, tokens)
    run("per_token_head", [NOPE, SCALE, ROPE], 61, tokens)


if __name__ == "__main__":
  main()
