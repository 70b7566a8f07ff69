"""mla_decode path "registers": per_token_head, at most 16 query rows, no converted tile.

The "narrow" path (like "converter", this path's predecessor, since removed) converts each
fp8 nope block to q's dtype into a shared tile (64 KB written, then read by the score and
the value products): measured on an H100, one warpgroup's conversion plus the products it
feeds takes 1.57 us a 64-token block for the values and 1.46 us for the scores
(`benchmarks/diag_register_operands.py`, `logs/2026-12-06c_diag_register_operands_h100.log`).
Here the products take their A operands from registers, converted from the fp8 ring as
they are loaded (exact; for bf16 through f16 and float32 as Mosaic does): 0.74 and 0.67
us, and no tile at all.

    S^T (64 tokens x N)   = K (64 x R) . Q^T + K_rope (64 x Rr) . Q_rope^T
    out^T (R x N)        += V^T (R x 64) . P^T (64 x N)     (V = K: the fp8 nope plane)

* Scores: the ring's fp8 block read as 16-bit column pairs in the WGMMA register layout
  gives a thread 4 consecutive columns of a token per 32-bit register; its two halves
  become the A operands of two 64-column products (`key_operands`), whose K positions
  take each 128 columns' even column pairs, then the odd ones (`score_columns`): q's nope
  columns are put in that order in shared memory by warpgroup 0 once a program, as
  products with 0/1 matrices on the tensor cores (`_ordered_nope`: the order moves 4-byte
  pieces, below what a TMA copy can; before, an XLA fusion did it, ~2.3 us a call on an
  H100), so S^T is unchanged. The nope products run in float16 whatever q's dtype (one ``cvt`` a pair
  instead of four for bf16): warpgroup 0 rescales q's rows in shared memory once a
  program (`scale_q_rows`: a power of two a row, exact for the values that matter, folded
  into the row's score factor). Measured on an H100 against the bf16 products
  (`logs/2026-12-06e_registers_f16_inkernel_ab_h100.log`): call 75.3 vs 78.4 us at B = 64,
  context 4096; 129.7 vs 134.2 at B = 128; 455.3 vs 460.3 at B = 128, context 16384. (The
  same rescaling as three XLA fusions before the kernel cost ~5 us a call, more than the
  kernel gained; f16 value products as well, with the weights divided by their running
  maximum, made warpgroup 0's softmax the longer part: tag `attic/registers-f16`.) (Loading
  2 columns a 16-bit register keeps the columns in order but costs more: H100, 73.5 vs
  67.5 us at B = 64, context 4096; 504 vs 448 at B = 128, context 16384,
  `logs/2026-12-06c_diag_decode_registers_16bit_keys_not_kept_h100.log`.)
* Values: Mosaic's 16-bit transposed shared-memory load (``ldmatrix.trans``) of the block
  seen as column pairs gives a thread columns (2j, 2j+1) of tokens (t, t+1) per 32-bit
  register; one ``prmt`` splits them into the two columns' token pairs: the A operands of
  two 64-row tiles of V^T, of the even and the odd columns of 128 (`value_operands`), in
  float16 as the keys (one ``cvt`` a pair; bf16 took four): the weights W = P x scale / S
  go to the product divided by a power of two S of the block (`block_power`: the largest
  scale a query may see, one integer max across warpgroup 0's warps while its score
  products run), so they lie in [0, 1) and keep 11 significant bits down to 2^-14 of the
  block's largest scale; the accumulators are kept in units of the current S (the unit
  change is one more factor in alpha, exact from the exponents; S never falls below 2^-64
  of the largest S before it, so float32 cannot overflow), and warpgroup 0 hands over the
  sums divided by the last S. Measured on an H100 against bf16 value products (session
  2026-12-06g): under Nsight Compute, whose locked ~1.4 GHz SM clock leaves the kernel
  bound by its multiprocessors as an H200's bandwidth would, 68.1 vs 73.3 us at B = 64,
  context 4096 and 455.5 vs 523.4 at B = 128, context 16384 (26% fewer instructions;
  `logs/2026-12-06g_ncu_ab_f16_values_h100.log`); at full clock, where the H100's memory
  bounds it, kernel 65.0 vs 65.3 / 122.0 vs 119.4 (B = 128, 4096) / 451.2 vs 445.0
  (`logs/2026-12-06g_registers_f16_values_ab_h100.log`). What float16 weights cost: in one
  block, a token whose scale is below 2^-14 of the block's largest gets a subnormal
  weight (exact to 2^-24 of the largest only), so a block mixing rows of very different
  magnitudes where the small rows carry the softmax loses precision -- one row in 8 at ~3e6
  times the others' scale (weight ~e^-40): 8% error against 0.2% with bf16 weights; at
  ~3e4: 0.2% (interpret mode; tests/test_mla_decode.py). Blocks of different magnitudes are
  not affected (~2^40 between blocks: tested). A DeepSeek cache's nope rows follow an
  RMSNorm: their scales differ little from token to token.

  The value tiles' rows are every other column (tile 2c + s, row r is column 128 c + 2 r +
  s). Warpgroup 1 puts the output rows in order itself (`store_out_rows`): each tile
  transposed into shared memory (16-bit transposed stores lower; 32-bit ones do not, and
  a strided store into the staging, faster in one H100 run, is refused by jax 0.12's
  Mosaic GPU as bank-conflicting), then one product with a 0/1 matrix on the tensor cores
  interleaves the even and odd columns, exactly, for four chunks at once (16 rows each),
  staged in the fp8 ring's bytes (idle by then) and stored by TMA as (N, R) rows. The
  call's XLA work is then the splits' merge alone (nothing at one split); before, an XLA
  transpose of packed column pairs (~4 us a call on an H100). What it costs: an output
  value that overflows q's dtype (inf) makes its row's other columns of that 128-column
  chunk NaN (0 x inf in the product), as q's order does for an inf in q.
* Two warpgroups (as "narrow", without conversions): warpgroup 0 computes S^T, the online
  softmax (scale folded into the scores and the weights), hands W and alpha to warpgroup
  1 and goes on to the next block while warpgroup 1 accumulates the values, zeroes the
  rows no query may see in the raw fp8 block first (0 x NaN), and refills the ring
  (`mla_decode_parts.ring_loader`). With no converted tile the ring is deeper
  (`DecodeConfig.stages`; by default the deepest that fits, up to `MAX_STAGES`), in tiles
  of 8 rows x 128 bytes (`SWIZZLE`): 4 sectors an L2 request instead of 2.2 with 64-byte
  tiles (ncu). Two weight slots (warpgroup 0 publishing step i + 1 while warpgroup 1
  multiplies step i's) were measured no faster, with bf16 and with f16 scores.

  A third warpgroup taking half the score product and half the values (384 threads, at
  most 168 registers a thread) was built and measured: no faster (H100, B = 64, 16 heads,
  context 4096: 66.1 vs 67.1 us; B = 128, context 16384: 446.3 vs 448.5;
  `logs/2026-12-06c_diag_decode_registers_3wg_not_kept_h100.log`): the warpgroups share
  the multiprocessor's issue slots, so splitting the conversions does not shorten them.
* At most 16 query rows: at 32 (s_q = 2 at 16 heads) this path was no faster than the
  narrow path's converted tile (H100, B = 64, context 4096: kernel 99.6 vs 100.5 us;
  `logs/2026-12-06c_diag_decode_registers_first_h100.log` and `..._16bit_keys_...`), and
  its value warpgroup holds 128 accumulator registers a thread there.

Interpret mode (CPU tests) has no ``inline_mgpu`` and no register A operands: there the
blocks are converted into a float16 shared tile per stage and both products read it (the
values in this path's row order, so `store_out_rows` is exercised; q's rows are rescaled
by the same `scale_q_rows` and keep their column order) -- the pipeline, barriers and
masking are the same; the register operands themselves are checked on the GPU
(tests/test_mla_decode.py, `-m gpu`), q's order products in interpret mode through shared
memory and on the GPU from registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.common import F32
from pallas_kernels.mla_decode import BLOCK_KV, FP8_E4M3, DecodeConfig, Geometry
from pallas_kernels.mla_decode_narrow import SMEM_LIMIT, padded_rows, run_rows_as_n
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, accumulate, convert_fp8,
                                             decode_kernel, masked_positions, online_softmax,
                                             page_flags, program, prologue, publish_weights,
                                             ring_loader, softmax_end, softmax_start,
                                             warpgroup_sync, zero_masked_rows)

MAX_ROWS = 16           # more rows: the narrow path's converted tile is faster (below)
MAX_STAGES = 4
PAIRS = 64              # 16-bit column pairs a load: 128 fp8 columns
# The fp8 nope ring in tiles of 8 rows x SWIZZLE bytes, swizzled as wide: its TMA copies
# then read SWIZZLE bytes of a row a request. The narrow and wide paths' 64-byte tiles
# (`Prologue.fp8_tile`, for their conversion) made 2.2 sectors an L2 request here against 4
# for bf16 rows (ncu, H100, `logs/2026-12-06e_ncu_registers_h100.log`).
SWIZZLE = 128
FP8_TILE = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))
# The same bytes seen as 16-bit column pairs.
U16_TILE = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
WGMMA = plgpu.Layout.WGMMA

# e4m3 x2 (a .b16) -> f16 x2: one instruction, exact; bf16: then each half through float32
# (exact: every e4m3 value is a bf16).
_CVT = {
    "float16": "cvt.rn.f16x2.e4m3x2 {d}, {s};\n",
    "bfloat16": ("{{ .reg .b32 h; .reg .b16 h0, h1; .reg .f32 f0, f1;\n"
                 "  cvt.rn.f16x2.e4m3x2 h, {s}; mov.b32 {{h0, h1}}, h;\n"
                 "  cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.rn.bf16x2.f32 {d}, f1, f0; }}\n"),
}


def _convert(x, dtype, n_out: int, asm: str, in_bits: int):
  """Registers of `x` (WGMMA layout) -> `n_out` `dtype` arrays of x's shape by the inline
  PTX `asm` (operands: the n_out 32-bit results, then the register as an `in_bits` int)."""
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils

  out = plgpu.ShapeDtypeStruct(x.shape, dtype, layout=WGMMA)

  @plgpu.inline_mgpu(arg_types=(WGMMA,), return_type=(out,) * n_out)
  def convert(_, regs):
    i32 = ir.IntegerType.get_signless(32)
    src = ir.IntegerType.get_signless(in_bits)
    elem = ir.F16Type.get() if jnp.dtype(dtype) == jnp.float16 else ir.BF16Type.get()
    vec = ir.VectorType.get((2,), elem)
    outs = [np.empty_like(regs.registers) for _ in range(n_out)]
    for idx, reg in np.ndenumerate(regs.registers):
      res = utils.inline_ptx(asm, utils.bitcast(reg, src), result_types=[i32] * n_out)
      for o, r in zip(outs, res):
        o[idx] = utils.bitcast(r, vec)
    return tuple(mgpu.FragmentedArray(_registers=o, _layout=regs.layout, _is_signed=None)
                 for o in outs)

  return convert(x)


def key_operands(quads, dtype):
  """A (64 tokens, 64 column pairs) uint16 array loaded in the WGMMA layout (a register:
  columns 4 j .. 4 j + 3 of a token, 4 fp8 bytes) -> two (64, 64) `dtype` arrays, exactly:
  the A operands of S^T over the first and the second halves of each register's columns,
  i.e. over the 128 columns taken in the order `score_columns` (q follows it)."""
  cvt = _CVT[jnp.dtype(dtype).name]
  asm = ("{ .reg .b16 e, o;\n  mov.b32 {e, o}, $2;\n" + cvt.format(d="$0", s="e")
         + cvt.format(d="$1", s="o") + "}")
  return _convert(quads, dtype, 2, asm, 32)


def score_columns(R: int) -> np.ndarray:
  """The nope column at each K position of the register score product (`key_operands`):
  in each 128 columns, the even column pairs, then the odd ones."""
  pairs = np.arange(R).reshape(R // 128, 32, 2, 2)       # (chunk, j, h, i): pair 2j + h
  return pairs.swapaxes(1, 2).reshape(R)


KEY_DTYPE = jnp.float16   # both products' fp8 operands (`scale_q_rows`, `block_power`)
FLOOR = 64                # S >= 2^-FLOOR x the largest S before it (`block_power`)
# S's biased exponent e (S = 2^(e - 127)) is kept in [17, 245], S in [2^-110, 2^118]: 1 / S
# stays a normal float32, and p x scale / S < 4 even for the largest bf16 row (scale
# ~ 2^119.5).
E_RANGE = (17, 245)


def block_power(scales, pos, length):
  """The value product's unit for a block: a power of two S = 2^(e - 127), as its biased
  exponent e (int32 scalar). scales (64,) float32 and their positions pos (64,) int32 (the
  row-vector layout of S^T) -> e with max(finite scales at positions < length) / S in
  [0.5, 1), clipped to `E_RANGE`; 0 when no such scale is positive (the caller keeps its
  previous S). One integer max across the warps (the largest bit pattern of non-negative
  floats is the largest value's)."""
  m = jnp.where(pos < length, scales, 0.0)
  m = jnp.where(m < jnp.inf, m, 0.0)              # (NaN and inf scales left out)
  bits = lax.bitcast_convert_type(m, jnp.int32).max()
  # m in [2^(E - 127), 2^(E - 126)) for its biased exponent E: S = 2^(E - 126).
  e = jnp.clip(lax.shift_right_logical(bits, 23) + 1, *E_RANGE)
  return jnp.where(bits > 0, e, 0)


def power(e, shape, layout):
  """2^(e - 127) (float32, broadcast to `shape` in `layout`) of an int32 scalar biased
  exponent e in [1, 254]; 0.0 for e = 0. (A vector: Mosaic GPU lowers no bitcast of a
  scalar.)"""
  e = plgpu.layout_cast(jnp.broadcast_to(e, shape), layout)
  return lax.bitcast_convert_type(lax.shift_left(e, 23), F32)


def order_source(i, k, half: int, part: int):
  """Whether K position ``i`` of half `half` of a 128-column chunk in `score_columns` order
  takes column ``64 part + k`` of that chunk (numpy or jax integer arrays, elementwise): K
  position 2j + t of half h holds column 4j + 2h + t."""
  col = 64 * part + k
  return (((col >> 1) & 1) == half) & (i == 2 * (col >> 2) + (col & 1))


def zero_one(shape, dtype, layout, preds) -> list:
  """0/1 matrices of `shape` and `dtype` in `layout`, one a predicate of `preds`: 1 where
  ``pred(row, col)`` (int32 index arrays, made once for all) holds."""
  i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
  k = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  one, zero = jnp.asarray(1.0, dtype), jnp.asarray(0.0, dtype)
  return [jnp.where(pred(i, k), one, zero) for pred in preds]


def order_matrices(dtype, layout) -> dict:
  """The 0/1 matrices of `_ordered_nope`, {(half, part): (64, 64) `dtype` in `layout`}, built
  once a program (4 x 32 registers a thread while q is put in order)."""
  keys = [(h, part) for h in range(2) for part in range(2)]
  preds = [lambda i, k, h=h, part=part: order_source(i, k, h, part) for h, part in keys]
  return dict(zip(keys, zero_one((64, 64), dtype, layout, preds)))


def _ordered_nope(q_smem, c: int, perms: dict, perm_smem=None):
  """The two 64-column halves (2 x (64, N) float32, the WGMMA layout) of q's 128 nope
  columns of chunk `c` in `score_columns` order, exactly: each half is the sum of two
  products of 0/1 matrices (`order_matrices`, registers) with the chunk's two 64-column
  tiles in shared memory, on the tensor cores (the order's 4-byte pieces are below what a
  TMA copy can move). The products read one chunk only, so the caller may overwrite it
  afterwards. A row holding inf or NaN in a chunk gets NaN in the chunk's other columns
  (0 x inf): its scores are NaN either way. `perm_smem` (64, 64) of q's dtype: the
  matrices go through it (interpret mode, which has no register A operands; tests)."""
  N = q_smem.shape[0]

  def half(h):
    def product(acc):
      for part in range(2):
        perm = perms[h, part]
        if perm_smem is not None:
          perm_smem[...] = perm
          plgpu.commit_smem()
          perm = perm_smem
        tile = q_smem.at[:, pl.ds(128 * c + 64 * part, 64)].transpose((1, 0))   # (64, N)
        plgpu.wgmma(acc, perm, tile)
        if perm_smem is not None:
          plgpu.wgmma_wait(0)       # (before the next matrix overwrites it)
      return acc[...]
    return pl.run_scoped(product, plgpu.ACC((64, N), F32))

  return half(0), half(1)


def scale_q_rows(q_smem, qh_smem, R: int, score_scale: float, col_vec, *,
                 order: bool = False, perm_smem=None):
  """Warpgroup 0, once a program: q's rows (N, R + Rr) in shared memory (`q_smem`, q's
  dtype) for the float16 score products (`KEY_DTYPE`), in place; returns the rows' factors
  (N,) float32 (`col_vec`) that turn a row's product with a dequantized-but-unscaled key
  into its exp2-domain score. With `order`, the nope columns are also put in
  `score_columns` order (`_ordered_nope`, through `perm_smem` where given).

  fp8 -> f16 is one instruction a pair, fp8 -> bf16 three more. For bf16 q each row is
  divided by a power of two that puts its largest finite magnitude in [2^14, 2^15): every
  bf16 value within 2^-28 of the row's largest is then an f16 value, exactly (bf16 has 8
  significant bits, f16 11), and the power of two goes into the row's factor (exact). The
  nope columns go to the float16 view `qh_smem` of the same bytes; the rope columns,
  divided by the same power of two (exact in bf16), stay in q's dtype for their own
  product. inf and NaN pass (but see `_ordered_nope`). (In XLA before the kernel this cost
  ~5 us a call on an H100, three small fusions.) float16 q keeps its values (factor 1)."""
  N = q_smem.shape[0]
  chunk = lambda ref, c: ref.at[:, pl.ds(64 * c, 64)].transpose((1, 0))   # (64 columns, N)
  n = q_smem.shape[1] // 64
  scaled = q_smem.dtype != qh_smem.dtype
  if scaled:
    amax = None
    for c in range(n):
      a = jnp.abs(plgpu.load(chunk(q_smem, c), layout=WGMMA).astype(F32))
      m = jnp.where(a < jnp.inf, a, 0.0).max(axis=0)
      amax = m if amax is None else jnp.maximum(amax, m)
    # amax in [2^(E - 127), 2^(E - 126)) for its biased exponent E: the power 2^(E - 141),
    # kept a normal float32 (the same as frexp's exponent - 15, clipped to [-126, 127]).
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    e_bits = lax.shift_left(jnp.clip(lax.shift_right_logical(bits, 23) - 14, 1, 254), 23)
    e = jnp.where(bits > 0, lax.bitcast_convert_type(e_bits, F32), 1.0)
  else:
    e = plgpu.layout_cast(jnp.full((N,), 1.0, F32), col_vec)
    if not order:
      return e * score_scale
  inv = lax.broadcast_in_dim(1.0 / e, (64, N), [1])
  perms = order_matrices(q_smem.dtype, WGMMA) if order else None
  for c in range(n):
    if 64 * c < R and order:
      if c % 2 == 0:
        pair = _ordered_nope(q_smem, c // 2, perms, perm_smem)
      x = pair[c % 2]
    elif scaled:
      x = plgpu.load(chunk(q_smem, c), layout=WGMMA).astype(F32)
    else:
      continue
    dst = qh_smem if 64 * c < R else q_smem
    chunk(dst, c)[...] = (x * inv).astype(dst.dtype)
  plgpu.commit_smem()
  return e * score_scale


def q_buffer(N: int, W: int, dtype, tile):
  """Shared memory for q's rows: for bf16 q the same bytes seen as bf16 and as float16
  (`scale_q_rows`); `q_views` gives the two refs in the kernel."""
  if jnp.dtype(dtype) == jnp.dtype(KEY_DTYPE):
    return plgpu.SMEM((N, W), dtype, transforms=tile)
  return plgpu.RefUnion(plgpu.SMEM((N, W), dtype, transforms=tile),
                        plgpu.SMEM((N, W), KEY_DTYPE, transforms=tile))


def q_views(ref, dtype):
  """(q's dtype, float16) views of a `q_buffer` of `dtype`."""
  if jnp.dtype(dtype) == jnp.dtype(KEY_DTYPE):
    return ref, ref
  q, qh = ref
  return q, qh


def scale_q_kernel(N: int, W: int, R: int, dtype, *, interpret: bool = False,
                   order: bool | None = None):
  """A one-warpgroup kernel around `scale_q_rows` (for the tests): q (N, W) `dtype` ->
  (its bytes after the call seen as `dtype` (the rope columns) and as float16 (the nope
  columns), both (N, W); the factors (N,) float32 for a score scale of 1). `order`: as
  the decode kernel (None: on the GPU only)."""
  order = not interpret if order is None else order
  pro = prologue(dtype, 64, 1.0)

  def body(q_ref, q_out, qh_out, f_ref, q_buf, f_smem, bar, *perm):
    q_smem, qh_smem = q_views(q_buf, dtype)
    plgpu.copy_gmem_to_smem(q_ref, q_smem, bar)
    plgpu.barrier_wait(bar)
    f_smem[...] = scale_q_rows(q_smem, qh_smem, R, 1.0, pro.col_vec, order=order,
                               perm_smem=perm[0] if perm else None)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, q_out)
    plgpu.copy_smem_to_gmem(qh_smem, qh_out)
    plgpu.copy_smem_to_gmem(f_smem, f_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((N, W), dtype),
                jax.ShapeDtypeStruct((N, W), KEY_DTYPE), jax.ShapeDtypeStruct((N,), F32)),
      scratch_types=[q_buffer(N, W, dtype, pro.tile), plgpu.SMEM((N,), F32),
                     plgpu.Barrier(num_arrivals=1)]
      + ([plgpu.SMEM((64, 64), dtype, transforms=pro.tile)] if order and interpret else []),
      num_threads=1, thread_name="wg", kernel_name="scale_q_rows",
      interpret=common.interpret_params() if interpret else None,
  )


def value_operands(pairs, dtype):
  """A (64 column pairs, 64 tokens) uint16 array loaded transposed in the WGMMA layout (a
  register: columns (2j, 2j+1) of tokens (t, t+1), 4 fp8 bytes b0..b3) -> the A operands
  of two 64-row tiles of V^T in `dtype`, exactly: the even columns' (b0, b2) token pairs
  and the odd columns' (b1, b3), split by one ``prmt``."""
  cvt = _CVT[jnp.dtype(dtype).name]
  asm = ("{ .reg .b32 p; .reg .b16 e, o;\n  prmt.b32 p, $2, 0, 0x3120;\n"
         "  mov.b32 {e, o}, p;\n" + cvt.format(d="$0", s="e") + cvt.format(d="$1", s="o")
         + "}")
  return _convert(pairs, dtype, 2, asm, 32)


def _stages(geo: Geometry, config: DecodeConfig) -> int:
  """The ring's depth: the config's, else the deepest that fits up to `MAX_STAGES` (0: none
  fits)."""
  N = padded_rows(geo.QR)
  for stages in ((config.stages,) if config.stages else range(MAX_STAGES, 1, -1)):
    if _smem_bytes(geo, N, stages) <= SMEM_LIMIT:
      return stages
  return 0


def _smem_bytes(geo: Geometry, N: int, stages: int) -> int:
  size = geo.dtype.itemsize
  kb = lambda n: -(-n // 1024) * 1024     # every allocation is aligned to 1 KB
  return (kb(N * (geo.R + geo.Rr) * size)                     # q
          + max(stages * kb(BLOCK_KV * geo.R), kb(192 * 128 * size))   # fp8 ring | out
          + stages * (kb(BLOCK_KV * geo.Rr * size) + kb(4 * BLOCK_KV))
          + kb(N * BLOCK_KV * 2) + kb(64 * 128 * size)        # W (float16), out's tiles
          + 2 * kb(4 * N) + 2048)                             # alpha / lse, sum, barriers


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None when this path runs the call, else why not."""
  if not geo.quantized:
    return "the plain cache (this path reads per_token_head fp8)"
  if geo.QR > MAX_ROWS:
    return f"{geo.QR} query rows (s_q x H) per sequence (this path takes <= {MAX_ROWS})"
  if geo.R % 128:
    return f"R={geo.R} (this path takes R % 128 == 0)"
  if not _stages(geo, config):
    return f"shared memory: {config.stages or 2} stages do not fit"
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, meta, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W), meta (B, P + 2) (`PageTable`); returns
  (out (B, QR, R), lse (B, QR))."""
  return run_rows_as_n(geo, config, operands, q2, meta, _kernel, num_splits=num_splits,
                       rows_last=False,   # (rows first, in order: `store_out_rows`)
                       sm_scale=sm_scale, stages=_stages(geo, config))


def out_order_halves(dtype, layout):
  """The 0/1 matrix (128, 128) that puts a 128-column chunk's value tiles back in column
  order, as its two (64, 128) row halves s: row 64 s + r holds its 1 at column 2 r + s
  (tile s, row r of a chunk is its column 2 r + s: `value_operands`)."""
  return zero_one((64, 128), dtype, layout, [lambda r, j, s=s: j == 2 * r + s for s in range(2)])


def store_out_rows(accs, inv, x_smem, order_smem, rows_smem, dst, dtype) -> None:
  """Warpgroup 1, once a program: the output rows (N, R), columns in order, to `dst` (a
  (N, R) global ref) from the value accumulators `accs` (R / 64 tiles (64, N) float32;
  tile 2 c + s, row r = column 128 c + 2 r + s) times `inv` (64, N).

  A tile's transpose is a 16-bit transposed store into shared memory, but its rows are
  every other column; one product with the 0/1 matrix of `out_order_halves` on the tensor
  cores interleaves them, exactly: the chunks' transposed tiles side by side (N rows a
  chunk, 64 // N chunks a product) times that matrix give the rows of those chunks in
  order. `x_smem` (64, 128) and `order_smem` (128, 128) of `dtype` (tiled as wgmma
  operands), `rows_smem` (64, 128) the staging of the TMA stores."""
  N = accs[0].shape[1]
  group = 64 // N
  n_chunks = len(accs) // 2
  for s, half in enumerate(out_order_halves(dtype, WGMMA)):
    order_smem.at[pl.ds(64 * s, 64)][...] = half
  for g0 in range(0, n_chunks, group):
    chunks = list(range(g0, min(g0 + group, n_chunks)))
    for j, c in enumerate(chunks):
      for s in range(2):
        tile = x_smem.at[pl.ds(N * j, N), pl.ds(64 * s, 64)].transpose((1, 0))   # (64, N)
        tile[...] = (accs[2 * c + s] * inv).astype(dtype)
    plgpu.commit_smem()

    def product(acc):
      plgpu.wgmma(acc, x_smem, order_smem)
      return acc[...]

    rows = pl.run_scoped(product, plgpu.ACC((64, 128), F32))   # row N j + n: chunk j's row n
    if g0:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # the last group's stores read it
    rows_smem[...] = rows.astype(dtype)
    plgpu.commit_smem()
    for j, c in enumerate(chunks):
      plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(N * j, N)], dst.at[:, pl.ds(128 * c, 128)])
  plgpu.wait_smem_to_gmem(0)


def _kernel(interpret, *, B, s_q, H, R, Rr, P, N, splits, page_size, dtype, sm_scale,
            stages):
  pro = prologue(dtype, page_size, sm_scale)
  tile, _, copies, score_scale, row_vec, col_vec = pro
  n_chunks = R // (2 * PAIRS)

  def body(nope_ref, scale_ref, rope_ref, q_ref, meta_ref, out_ref, lse_ref,
           q_buf, fp8_union, rope_smem, scale_smem, p_smem, o_smem, alpha_smem, l_smem,
           *rest):
    if interpret:
      key_tiles, *rest = rest
    q_bar, kv_bar, free_bar, sync_bar, p_ready, p_free = rest
    fp8_smem, u16_smem, (order_smem, rows_smem) = fp8_union
    q_smem, qh_smem = q_views(q_buf, dtype)   # (q's dtype; f16 nope: `scale_q_rows`)
    qn_smem = qh_smem.at[:, pl.ds(0, R)]
    prog = program(meta_ref, P, splits)
    (_, ok_ref, _, masked_ref), b, sp, wg, length, first, n_steps = prog
    ring_io = ring_loader(wg == 1, (nope_ref, rope_ref, scale_ref),
                          (fp8_smem, rope_smem, scale_smem), prog, kv_bar=kv_bar,
                          free_bar=free_bar, stages=stages, page_size=page_size, P=P)

    def scores(slot, meanwhile):
      """S^T (BLOCK_KV, N) of the block in `slot`, over q divided by its rows' powers of
      two and the keys not multiplied by their scales (`scale_q_rows`), and what
      `meanwhile()` returns (run while the products are in flight)."""

      def product(s_ref):
        if interpret:
          # Stand-in: the block converted into this stage's float16 tile, which the
          # values read as well.
          convert_fp8(fp8_smem, key_tiles, [pl.ds(c, CONVERT_COLS) for c in
                                            range(0, R, CONVERT_COLS)],
                      KEY_DTYPE, plgpu.Layout.WGMMA_UPCAST_2X, src_lead=(slot,),
                      dst_lead=(slot,))
          plgpu.commit_smem()
          plgpu.wgmma(s_ref, key_tiles.at[slot], qn_smem.transpose((1, 0)))
        else:
          for c in range(n_chunks):
            quads = plgpu.load(u16_smem.at[slot, :, pl.ds(PAIRS * c, PAIRS)], layout=WGMMA)
            for h, key in enumerate(key_operands(quads, KEY_DTYPE)):
              cols = pl.ds(2 * PAIRS * c + PAIRS * h, PAIRS)   # (q in `score_columns` order)
              plgpu.wgmma(s_ref, key, qn_smem.at[:, cols].transpose((1, 0)))
        plgpu.wgmma(s_ref, rope_smem.at[slot], q_smem.at[:, pl.ds(R, Rr)].transpose((1, 0)))
        other = meanwhile()
        return s_ref[...], other

      return pl.run_scoped(product, plgpu.ACC((BLOCK_KV, N), F32))

    def values(slot, accs):
      """accs += V^T . W over the block in `slot` (float16 operands; W = P x scale / S):
      tile 2c + s holds the columns 128 c + s + 2 r (r < 64), as `value_operands` makes
      them."""
      p_t = p_smem.transpose((1, 0))
      if interpret:
        return tuple(accumulate(
            acc, key_tiles.at[slot, :, pl.ds(2 * PAIRS * (m // 2) + m % 2, 64,
                                             stride=2)].transpose((1, 0)), p_t, interpret)
            for m, acc in enumerate(accs))

      def products(refs):
        for c in range(n_chunks):
          pairs = plgpu.load(u16_smem.at[slot, :, pl.ds(PAIRS * c, PAIRS)].transpose((1, 0)),
                             layout=WGMMA)
          for s, a in enumerate(value_operands(pairs, KEY_DTYPE)):
            plgpu.wgmma(refs[2 * c + s], a, p_t)

      return pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in accs))

    @pl.when(wg == 0)
    def _softmax():
      plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)
      plgpu.barrier_wait(q_bar)
      factor = scale_q_rows(q_smem, qh_smem, R, score_scale, col_vec, order=not interpret)
      q_factor = lax.broadcast_in_dim(factor, (BLOCK_KV, N), [1])
      tok = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 0, layout=WGMMA)
      qrow = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 1, layout=WGMMA)
      tok_row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV,), 0, layout=row_vec)
      # Query j (row r = j * H + h) sees positions <= length - s_q + j.
      limit = length - s_q + lax.div(qrow, H)

      @pl.loop(0, n_steps, init_carry=(softmax_start(N, col_vec),
                                       (jnp.int32(127), jnp.int32(0))))
      def carry(i, carry):
        (m_i, l_part), (e_cur, e_max) = carry
        slot = lax.rem(i, stages)
        block = first + i
        bad = page_flags(ok_ref, b, block, page_size=page_size, P=P)   # (loaded early)
        with jax.named_scope("wait_kv"):      # (regions of common.PROFILE's trace)
          plgpu.barrier_wait(kv_bar.at[slot])

        def unit():
          # The block's power of two (from the scales at positions some query row may
          # see), while the score products run.
          scales = plgpu.load(scale_smem.at[slot], layout=row_vec)
          e_blk = block_power(scales, masked_positions(tok_row, block, bad,
                                                       page_size=page_size), length)
          return scales, e_blk

        with jax.named_scope("scores"):
          s, (scales, e_blk) = scores(slot, unit)
        plgpu.barrier_arrive(free_bar.at[slot])   # (this warpgroup is done with the stage)
        with jax.named_scope("softmax"):
          row_scale = lax.broadcast_in_dim(scales, (BLOCK_KV, N), [0])
          pos = masked_positions(tok, block, bad, page_size=page_size)
          s = jnp.where(pos <= limit, s * row_scale * q_factor, -jnp.inf)
          m_i, alpha, p, l_part = online_softmax(s, m_i, l_part, 0)
          # The accumulators' units move from S_cur to S_new (exact powers of two from
          # the exponents; a ratio below 2^-126 is 0).
          e_blk = jnp.where(e_blk > 0, e_blk, e_cur)
          e_max = jnp.maximum(e_max, e_blk)
          e_new = jnp.maximum(e_blk, e_max - FLOOR)
          d = e_cur - e_new
          alpha = alpha * power(jnp.where(d >= -126, d + 127, 0), (N,), col_vec)   # (e = 0: 0)
          inv = power(254 - e_new, (BLOCK_KV,), row_vec)            # 1 / S_new
          # (a masked row's scale may be NaN or inf: its weight 0 must stay 0)
          p = jnp.where(pos <= limit,
                        p * lax.broadcast_in_dim(scales * inv, (BLOCK_KV, N), [0]), 0.0)
        with jax.named_scope("publish"):
          publish_weights(i, p, alpha, p_smem=p_smem, alpha_smem=alpha_smem, p_free=p_free,
                          p_ready=p_ready)
        return (m_i, l_part), (e_new, e_max)

      (m_i, l_part), (e_cur, _) = carry
      # (the value warpgroup divides its accumulators, in units of S, by sum / S)
      softmax_end(m_i, l_part, n_steps, l_smem=l_smem, staging=alpha_smem, p_free=p_free,
                  dst=lse_ref.at[b, sp], l_units=power(254 - e_cur, (N,), col_vec))
      warpgroup_sync(sync_bar)      # the sums are in l_smem
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _values():
      ring_io.start()
      n_masked = masked_ref[b]
      zero = plgpu.layout_cast(jnp.full((64, N), 0.0, F32), WGMMA)

      @pl.loop(0, n_steps, init_carry=(zero,) * (R // 64))
      def accs(i, accs):
        slot = lax.rem(i, stages)
        with jax.named_scope("wait_kv"):
          plgpu.barrier_wait(kv_bar.at[slot])
        with jax.named_scope("wait_p"):
          plgpu.barrier_wait(p_ready)
        with jax.named_scope("values"):
          # The block's scores are done: this warpgroup alone reads the stage now.
          zero_masked_rows(key_tiles.at[slot] if interpret else u16_smem.at[slot], first + i,
                           length, lambda: page_flags(ok_ref, b, first + i,
                                                      page_size=page_size, P=P),
                           page_size=page_size, n_masked=n_masked)
          alpha = lax.broadcast_in_dim(plgpu.load(alpha_smem, layout=col_vec), (64, N), [1])
          accs = values(slot, tuple(acc * alpha for acc in accs))
        plgpu.barrier_arrive(p_free)
        plgpu.barrier_arrive(free_bar.at[slot])
        ring_io.refill(i)
        return accs

      warpgroup_sync(sync_bar)
      l_all = plgpu.load(l_smem, layout=col_vec)
      has = l_all > 0
      inv = lax.broadcast_in_dim(jnp.where(has, 1.0 / jnp.where(has, l_all, 1.0), 0.0),
                                 (64, N), [1])
      # (Both warpgroups are past the ring: its bytes stage the output.)
      store_out_rows(accs, inv, o_smem, order_smem, rows_smem, out_ref.at[b, sp], dtype)

  smem = [
      q_buffer(N, R + Rr, dtype, tile),                                       # q
      plgpu.RefUnion(plgpu.SMEM((stages, BLOCK_KV, R), FP8_E4M3, transforms=FP8_TILE),
                     plgpu.SMEM((stages, BLOCK_KV, R // 2), jnp.uint16,
                                transforms=U16_TILE),                         # fp8 nope ring
                     (plgpu.SMEM((128, 128), dtype, transforms=tile),         # then: order,
                      plgpu.SMEM((64, 128), dtype, transforms=tile))),        # out's rows
      plgpu.SMEM((stages, BLOCK_KV, Rr), dtype, transforms=tile),             # rope ring
      plgpu.SMEM((stages, BLOCK_KV), F32),                                    # scale ring
      plgpu.SMEM((N, BLOCK_KV), KEY_DTYPE, transforms=tile),                  # W
      plgpu.SMEM((64, 128), dtype, transforms=tile),         # out's tiles transposed
      plgpu.SMEM((N,), F32),                                                  # alpha, then lse
      plgpu.SMEM((N,), F32),                                                  # the sums
  ]
  if interpret:
    smem += [plgpu.SMEM((stages, BLOCK_KV, R), KEY_DTYPE, transforms=tile)]  # stand-in
  barriers = [
      plgpu.Barrier(num_arrivals=1),                                   # q
      plgpu.Barrier(num_arrivals=3 * copies, num_barriers=stages),     # block landed
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),              # stage free (both)
      plgpu.Barrier(num_arrivals=2),                                   # both warpgroups
      plgpu.Barrier(num_arrivals=1),                                   # P ready (wg 0 -> 1)
      plgpu.Barrier(num_arrivals=1),                                   # P free (wg 1 -> 0)
  ]
  return decode_kernel(body, out_shape=(N, R), rows=N, dtype=dtype, scratch=smem + barriers,
                       splits=splits, B=B, num_threads=2, name="mla_decode_registers",
                       interpret=interpret)
