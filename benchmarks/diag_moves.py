"""Where the direct move path's fixed cost goes: time vs number and kind of buffers (one GPU).

    cd repo && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/diag_moves.py

Times `pallas_kernels.move.move_rows` (profiler device time per call, every GPU event
listed) on buffer lists of 2**16 + 64 rows: plain bf16 rows (576) for 20, 61 and 183 buffers,
and per_token_head parts (fp8 nope 512, f32 scale, bf16 rope 64) alone and together, at
T = 8 and 64 (random distinct disjoint rows). The contents are zeros: only time is measured.
`--select=chain --select=tree`: each case for each way of finding a buffer's address.
`--rounds`: instead, the direct path in rounds (`MoveTiling(direct_rounds=True)`) against
the default path (streamed for plain rows, rounds for per_token_head) at T = 2048 and 4096, 61 layers of 2**18 + 64 rows, disjoint
and overlapping (swaps) index sets. `--large`: the same at T = 8192 and 16384, rounds
against the default (two-pass) path (`--no-default`: rounds only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache.bench import time_per_call
import sys

from pallas_kernels.move import MoveTiling, move_rows

ROWS = 2**16 + 64
PLAIN = ((576,), jnp.bfloat16)
NOPE, SCALE, ROPE = ((512,), jnp.float8_e4m3fn), ((1,), jnp.float32), ((64,), jnp.bfloat16)


def run(name, kinds, layers, tokens, iters=20, tiling=MoveTiling(), rows=None, swaps=False):
  rows = rows or ROWS
  buffers = [jnp.zeros((rows, 1, *shape), dtype) for _ in range(layers) for shape, dtype in kinds]
  perm = np.random.default_rng(tokens).permutation(rows)[: 2 * tokens].astype(np.int32)
  tgt, src = perm[:tokens], perm[tokens:]
  if swaps:  # every pair's source is another pair's target
    tgt = np.concatenate([tgt[: tokens // 2], src[: tokens - tokens // 2]])
    src = np.concatenate([src[: tokens // 2], tgt[: tokens - tokens // 2]])
  tgt, src = jnp.asarray(tgt), jnp.asarray(src)
  f = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling), donate_argnums=0)
  bd = {}
  us, _, method = time_per_call(lambda st: (f(*st), *st[1:]), (buffers, tgt, src), iters, bd)
  nbytes = 2 * tokens * layers * sum(np.prod(s) * jnp.dtype(d).itemsize for s, d in kinds)
  print(f"{name:22s} buffers={layers * len(kinds):4d} T={tokens:5d} {us:9.2f} us "
        f"{nbytes / us / 1e3:8.1f} GB/s [{method}]  " +
        "  ".join(f"{k[:40]}={v:.2f}" for k, v in sorted(bd.items(), key=lambda kv: -kv[1])),
        flush=True)


def main():
  print(f"diag_moves on {jax.devices()[0].device_kind}", flush=True)
  select = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--select=")]
  if "--large" in sys.argv:  # beyond the streamed path's indices: rounds vs two-pass
    rounds = MoveTiling(path="direct", direct_rounds=True)
    for tokens in (8192, 16384):
      for kinds, name in (([PLAIN], "plain"), ([NOPE, SCALE, ROPE], "per_token_head")):
        for tiling, label in ((rounds, "rounds"), (MoveTiling(), "default")):
          if label == "default" and "--no-default" in sys.argv:
            continue  # two-pass: two launches and a few seconds of lowering
          for swaps in (False, True):
            run(f"{name} {label}{' swaps' if swaps else ''}", kinds, 61, tokens, 5, tiling,
                2**18 + 64, swaps)
    return
  if "--rounds" in sys.argv:
    rounds = MoveTiling(path="direct", direct_rounds=True,
                        direct_select=(select or ["chain"])[0])
    for tokens in (4096, 2048):
      for kinds, name in (([PLAIN], "plain"), ([NOPE, SCALE, ROPE], "per_token_head")):
        for tiling, label in ((rounds, "rounds"), (MoveTiling(), "default")):
          if tokens == 2048 and label == "default":
            continue  # a few seconds of lowering per streamed case
          for swaps in (False, True) if label == "rounds" else (False,):
            run(f"{name} {label}{' swaps' if swaps else ''}", kinds, 61, tokens, 10, tiling,
                2**18 + 64, swaps)
    return
  for tokens in (8, 64):
    for sel in select or ["chain"]:
      t = MoveTiling(direct_select=sel)
      run(f"plain {sel}", [PLAIN], 20, tokens, tiling=t)
      run(f"plain {sel}", [PLAIN], 61, tokens, tiling=t)
      run(f"plain {sel}", [PLAIN], 183, tokens, tiling=t)
      run(f"nope {sel}", [NOPE], 61, tokens, tiling=t)
      run(f"scale {sel}", [SCALE], 61, tokens, tiling=t)
      run(f"rope {sel}", [ROPE], 61, tokens, tiling=t)
      run(f"nope+rope {sel}", [NOPE, ROPE], 61, tokens, tiling=t)
      run(f"per_token_head {sel}", [NOPE, SCALE, ROPE], 61, tokens, tiling=t)


if __name__ == "__main__":
  main()
