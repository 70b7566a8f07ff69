"""The per_token_head decode products without a converted tile: one warpgroup, one 64-token
fp8 block (64 x 512) in shared memory, `--repeats` times, device time per block from a
profiler trace (as bench.py).

Parts (``--parts``):

* ``values``: out^T (512 x 16) += V^T P^T.
* ``scores``: S^T (64 x 16) = K q^T over the 512 nope columns.

Ways:

* ``tile`` -- as the decode kernels do now: the block converted to bf16 into a shared tile
  (`mla_decode_parts.convert_fp8`, exact), then m64n16k16 products reading the tile as their
  A operand (transposed for the values) and P^T / q^T (bf16) as B.
* ``f16`` / ``bf16`` -- no tile: the fp8 block is read as 16-bit pairs of columns into the
  WGMMA register layout and converted in registers (``cvt.rn.f16x2.e4m3x2``, exact; for bf16
  then through float32, also exact), and the results are the A operands of the products.
  Values: Mosaic's 16-bit transposed shared-memory load (``ldmatrix.trans``) gives a thread
  columns (2j, 2j+1) of tokens (t, t+1) in one 32-bit register; one ``prmt`` splits them into
  the two columns' token pairs, the A operands of two 64-row tiles of V^T whose rows are the
  even and the odd columns (a row permutation of V^T, so of out^T, undone when the output is
  read). Scores: a plain load gives a thread columns 4c .. 4c+3 of a token in one register;
  its two halves are A operands whose K positions are a fixed permutation of the columns
  (`mla_decode_registers.score_columns`), which q (B) takes too. (Loading 2 columns a
  16-bit register instead keeps the order but took 774 vs 666 ns for bf16,
  `logs/2026-12-06c_diag_register_operands_16bit_keys_h100.log`.)
  (`pallas_kernels/mla_decode_registers.py` builds its products this way.)

Every way checks its output against numpy (float64 sums of the exact products) before timing.
GPU only (``inline_mgpu`` has no interpret mode).

    PYTHONPATH=$PWD python3 benchmarks/diag_register_operands.py [--repeats 400]
        [--parts values,scores] [--ways tile,f16,bf16] [--lower]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_mla_cache import bench
from pallas_kernels import mla_decode_parts as parts
from pallas_kernels import mla_decode_registers as registers

F32, FP8 = jnp.float32, jnp.float8_e4m3fn
T, R, N = 64, 512, 16               # tokens a block, nope columns, query rows
CHUNK = registers.PAIRS              # 16-bit column pairs a load (128 fp8 columns)
WGMMA = plgpu.Layout.WGMMA


def kernel(part: str, way: str, repeats: int):
  dtype = jnp.float16 if way == "f16" else jnp.bfloat16
  pro = parts.prologue(dtype, 64, 1.0)
  convert = registers.value_operands if part == "values" else registers.key_operands
  out_shape = (R // 64, 64, N) if part == "values" else (64, N)
  n_acc = R // 64 if part == "values" else 1

  def body(v_ref, b_ref, o_ref, v_smem, b_smem, tile, o_smem, bar):
    plgpu.copy_gmem_to_smem(v_ref, v_smem, bar)
    plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
    plgpu.barrier_wait(bar)

    def block(_, accs):
      if way == "tile":
        parts.convert_fp8(v_smem, tile, [pl.ds(c, 64) for c in range(0, R, 64)],
                          jnp.bfloat16, plgpu.Layout.WGMMA_UPCAST_2X)
        plgpu.commit_smem()

        def products(refs):
          if part == "values":
            for m, acc in enumerate(refs):
              plgpu.wgmma(acc, tile.at[:, pl.ds(64 * m, 64)].transpose((1, 0)),
                          b_smem.transpose((1, 0)))
          else:
            plgpu.wgmma(refs[0], tile, b_smem.transpose((1, 0)))
      else:
        def products(refs):
          for c in range(R // (2 * CHUNK)):
            if part == "values":
              src = v_smem.at[:, pl.ds(CHUNK * c, CHUNK)]
              even, odd = convert(plgpu.load(src.transpose((1, 0)), layout=WGMMA), dtype)
              plgpu.wgmma(refs[2 * c], even, b_smem.transpose((1, 0)))
              plgpu.wgmma(refs[2 * c + 1], odd, b_smem.transpose((1, 0)))
            else:
              quads = plgpu.load(v_smem.at[:, pl.ds(CHUNK * c, CHUNK)], layout=WGMMA)
              for h, key in enumerate(convert(quads, dtype)):
                cols = pl.ds(2 * CHUNK * c + CHUNK * h, CHUNK)
                plgpu.wgmma(refs[0], key, b_smem.at[:, cols].transpose((1, 0)))
      return pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in accs))

    zero = plgpu.layout_cast(jnp.zeros((64, N), F32), WGMMA)
    accs = jax.lax.fori_loop(0, repeats, block, (zero,) * n_acc)
    for m, acc in enumerate(accs):
      (o_smem.at[m] if part == "values" else o_smem)[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  v_type = (plgpu.SMEM((T, R), FP8, transforms=pro.fp8_tile) if way == "tile"
            else plgpu.SMEM((T, R // 2), jnp.uint16, transforms=registers.U16_TILE))
  b_type = plgpu.SMEM((N, T) if part == "values" else (N, R), dtype, transforms=pro.tile)
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(out_shape, F32),
      scratch_types=[v_type, b_type, plgpu.SMEM((T, R), jnp.bfloat16, transforms=pro.tile),
                     plgpu.SMEM(out_shape, F32), plgpu.Barrier(num_arrivals=2)],
      num_threads=1, thread_name="wg", kernel_name=f"{part}_{way}")


def problem(part: str, way: str, rng):
  """(kernel operands, expected output in the kernel's order)."""
  codes = rng.integers(0, 256, (T, R)).astype(np.uint8)
  codes[(codes & 0x7F) == 0x7F] = 0                 # no NaN codes
  v = np.asarray(jnp.asarray(codes.view(FP8)).astype(F32)).astype(np.float64)
  dtype = jnp.float16 if way == "f16" else jnp.bfloat16
  v_in = jnp.asarray(codes.view(FP8)) if way == "tile" else jnp.asarray(codes.view(np.uint16))
  if part == "values":
    p = jnp.asarray(rng.random((N, T), dtype=np.float32)).astype(dtype)
    out_t = v.T @ np.asarray(p.astype(F32)).astype(np.float64).T        # (512, N)
    if way != "tile":   # tile 2m + s, row r  <->  column 2 (64 m + r) + s
      out_t = out_t.reshape(R // 128, 64, 2, N).transpose(0, 2, 1, 3)
    return (v_in, p), out_t.reshape(R // 64, 64, N)
  q = jnp.asarray(rng.standard_normal((N, R), dtype=np.float32)).astype(dtype)
  want = v @ np.asarray(q.astype(F32)).astype(np.float64).T            # (64, N)
  if way != "tile":
    q = q[:, registers.score_columns(R)]
  return (v_in, q), want


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=400)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--parts", default="values,scores")
  parser.add_argument("--ways", default="tile,f16,bf16")
  parser.add_argument("--lower", action="store_true", help="only lower each for CUDA (CPU)")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  for part in args.parts.split(","):
    for way in args.ways.split(","):
      (a, b), want = problem(part, way, rng)
      if args.lower:
        jax.jit(kernel(part, way, 4)).trace(a, b).lower(lowering_platforms=("cuda",))
        print(f"{part} {way}: lowers for CUDA", flush=True)
        continue
      got = np.asarray(jax.jit(kernel(part, way, 1))(a, b))
      err = np.abs(got - want).max() / np.abs(want).max()
      f = jax.jit(kernel(part, way, args.repeats))
      us, _, method = bench.time_per_call(lambda st: (st[0], f(st[0], b)), (a, None),
                                          args.iters)
      print(f"-> {part:6s} {way:4s}: {us / args.repeats * 1e3:7.1f} ns a 64 x 512 block "
            f"(max |out - numpy| / max |numpy| = {err:.1e}; {method}, {args.repeats} "
            f"blocks a call)", flush=True)


if __name__ == "__main__":
  main()
