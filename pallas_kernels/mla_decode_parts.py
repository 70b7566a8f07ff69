"""Kernel-body pieces shared by the mla_decode paths (registers, narrow, wide).

Each runs inside a Mosaic GPU kernel body (traced once per program); none allocates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.common import F32
from pallas_kernels.mla_decode import BLOCK_KV, FP8_E4M3, LN2, LOG2E, MASKED

CONVERT_COLS = 64
"""per_token_head: fp8 columns dequantized at a time; the fp8 plane's shared-memory tiles
(8, 64) with a 64-byte swizzle match these chunks."""


class Prologue(NamedTuple):
  """Static pieces every decode kernel starts from (`prologue`)."""

  tile: tuple            # shared-memory transforms of bf16/f16 blocks (128-byte swizzle)
  fp8_tile: tuple        # the same for the fp8 nope plane (`CONVERT_COLS` wide tiles)
  copies: int            # TMA copies per KV block (`copy_geometry`)
  score_scale: float     # sm_scale * log2(e): scores in the exp2 domain
  row_vec: object        # register layout of one value per token (a row of S^T)
  col_vec: object        # register layout of one value per query row (a column of S^T)


def prologue(dtype, page_size: int, sm_scale: float) -> Prologue:
  """The `Prologue` of a kernel over `dtype` queries/cache and pages of `page_size`."""
  bits = jnp.dtype(dtype).itemsize * 8
  return Prologue(
      tile=(plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128)),
      fp8_tile=(plgpu.TilingTransform((8, CONVERT_COLS)), plgpu.SwizzleTransform(CONVERT_COLS)),
      copies=copy_geometry(page_size)[0],
      score_scale=sm_scale * LOG2E,
      row_vec=plgpu.Layout.WGMMA.reduce(1),
      col_vec=plgpu.Layout.WGMMA.reduce(0),
  )


def kv_ring(pro: Prologue, *, quantized: bool, stages: int, R: int, Rr: int, dtype) -> list:
  """Shared-memory types of the KV ring that `ring_loader` fills: ``stages`` blocks of
  BLOCK_KV whole rows, or for per_token_head the fp8 nope plane, the rope plane and the
  scales of ``stages`` blocks plus one bf16/f16 tile the fp8 block is converted into
  (transforms from the kernel's `Prologue`)."""
  if not quantized:
    return [plgpu.SMEM((stages, BLOCK_KV, R + Rr), dtype, transforms=pro.tile)]
  return [
      plgpu.SMEM((stages, BLOCK_KV, R), FP8_E4M3, transforms=pro.fp8_tile),
      plgpu.SMEM((stages, BLOCK_KV, Rr), dtype, transforms=pro.tile),
      plgpu.SMEM((stages, BLOCK_KV), F32),
      plgpu.SMEM((BLOCK_KV, R), dtype, transforms=pro.tile),
  ]


def kv_scratch(pro: Prologue, *, q_rows: int, quantized: bool, stages: int, R: int, Rr: int,
               dtype) -> tuple[list, list]:
  """(shared memory, barriers) that the narrow and wide paths start their scratch with: the
  query tile (q_rows x (R + Rr)) and the KV ring (`kv_ring`); barriers for the query, each
  stage's KV block landing, each stage being free again (both compute warpgroups arrive),
  and the two compute warpgroups' sync."""
  per_block = 3 * pro.copies if quantized else pro.copies
  smem = [plgpu.SMEM((q_rows, R + Rr), dtype, transforms=pro.tile)] + kv_ring(
      pro, quantized=quantized, stages=stages, R=R, Rr=Rr, dtype=dtype)
  barriers = [
      plgpu.Barrier(num_arrivals=1),                              # q
      plgpu.Barrier(num_arrivals=per_block, num_barriers=stages),  # KV block landed
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),          # KV stage free
      plgpu.Barrier(num_arrivals=2),                              # both compute warpgroups
  ]
  return smem, barriers


def decode_kernel(body, *, out_shape: tuple, rows: int, dtype, scratch: list, splits: int,
                  B: int, num_threads: int, name: str, interpret: bool, m_tiles: int = 0,
                  **params):
  """`plgpu.kernel` of a decode path over a (splits, B) grid -- (m_tiles, splits, B) when
  ``m_tiles`` -- of warpgroups "wg": outputs the partial results (B, splits, *out_shape) in
  ``dtype`` and their lse (B, splits, rows) float32, for `mla_decode`'s merge of the
  splits. ``params``: extra `compiler_params` (approximate math is always on)."""
  grid, names = ((splits, B), ("s", "b")) if not m_tiles else \
      ((m_tiles, splits, B), ("m", "s", "b"))
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, splits, *out_shape), dtype),
                jax.ShapeDtypeStruct((B, splits, rows), F32)),
      scratch_types=scratch, grid=grid, grid_names=names, num_threads=num_threads,
      thread_name="wg", kernel_name=name,
      compiler_params=common.compiler_params(approx_math=True, **params),
      interpret=common.interpret_params() if interpret else None,
  )


def copy_geometry(page_size: int) -> tuple[int, int]:
  """(TMA copies per KV block, rows per copy): one per page a 64-token block spans."""
  return (1 if page_size >= BLOCK_KV else BLOCK_KV // page_size), min(page_size, BLOCK_KV)


class PageTable(NamedTuple):
  """Views of the kernels' one page-table operand ``meta`` (B, P + 2) int32: columns 0..P-1
  the page ids with every out-of-range id replaced by -1, column P the clamped length,
  column P + 1 how many of the pages under that length are masked (one XLA fusion before
  the kernel instead of several: `make_meta`). Indexed like the arrays they stand for:
  ``pages[b, i]`` (a safe id: -1 reads page 0, masked), ``ok[b, i]`` (1 or 0),
  ``lens[b]``, ``n_masked[b]``."""

  pages: "_Column"
  ok: "_Column"
  lens: "_Column"
  n_masked: "_Column"


class _Column(NamedTuple):
  meta: object
  fn: Callable

  def __getitem__(self, index):
    return self.fn(self.meta, index)


def page_table(meta_ref, P: int) -> PageTable:
  """The `PageTable` views of `meta_ref` (integer arithmetic only, no booleans)."""
  return PageTable(
      pages=_Column(meta_ref, lambda m, bi: jnp.maximum(m[bi], 0)),
      ok=_Column(meta_ref, lambda m, bi: 1 - lax.shift_right_logical(m[bi], 31)),
      lens=_Column(meta_ref, lambda m, b: m[b, P]),
      n_masked=_Column(meta_ref, lambda m, b: m[b, P + 1]),
  )


def program_blocks(len_ref, b, sp, splits: int):
  """(length, first block, number of blocks) of split `sp` of sequence b: the blocks of
  the sequence are dealt out in equal runs to the `splits` programs of the sequence."""
  length = len_ref[b]
  n_blocks = lax.div(length + (BLOCK_KV - 1), BLOCK_KV)
  per_split = lax.div(n_blocks + (splits - 1), splits)
  first = sp * per_split
  n_steps = jnp.maximum(jnp.minimum(first + per_split, n_blocks) - first, 0)
  return length, first, n_steps


class Program(NamedTuple):
  """Where one decode program is: sequence b, split sp, warpgroup wg, the page table's
  views, the sequence's clamped length and the split's blocks (first, n_steps)."""

  table: PageTable
  b: jax.Array
  sp: jax.Array
  wg: jax.Array
  length: jax.Array
  first: jax.Array
  n_steps: jax.Array


def program(meta_ref, P: int, splits: int) -> Program:
  """The `Program` of the running kernel instance (grid axes "s" and "b", warpgroup axis
  "wg"; blocks as `program_blocks` deals them)."""
  table = page_table(meta_ref, P)
  sp = lax.axis_index("s")
  b = lax.axis_index("b")
  wg = lax.axis_index("wg")
  return Program(table, b, sp, wg, *program_blocks(table.lens, b, sp, splits))


def warpgroup_sync(barrier) -> None:
  """Arrive at and wait on `barrier` (one arrival per compute warpgroup)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def copy_block(pt_ref, b, block, planes, barrier, *, page_size: int, P: int):
  """TMA copies of KV block `block` of sequence b, page by page through the page table.

  planes: (src, dst, lead) triples: src (rows, ...) in global memory, dst a shared-memory
  ref whose ``dst.at[(*lead, rows_of_the_copy)]`` receives BLOCK_KV rows. Every copy
  arrives on `barrier` (copies x len(planes) arrivals). Page ids were made safe before
  the kernel (out-of-range ones read page 0 and are masked by `masked_positions`).
  """
  copies, rows_per_copy = copy_geometry(page_size)
  start = block * BLOCK_KV
  for c in range(copies):
    position = start + c * rows_per_copy
    page = pt_ref[b, jnp.minimum(lax.div(position, page_size), P - 1)]
    row = page * page_size + lax.rem(position, page_size)
    dst_rows = pl.ds(c * rows_per_copy, rows_per_copy)
    for src, dst, lead in planes:
      plgpu.copy_gmem_to_smem(src.at[pl.ds(row, rows_per_copy)], dst.at[(*lead, dst_rows)],
                              barrier)


def produce(n_steps, stages: int, free_bar, load: Callable[[jax.Array], None]) -> None:
  """The producer warpgroup's loop over a ring of `stages` shared-memory stages: block i
  waits until stage i % stages is released (`free_bar`), then ``load(i)`` issues its
  copies. The last blocks' releases are observed too, so that every barrier phase is
  consumed when the program ends (the interpreter checks it; on the GPU it costs nothing).
  """
  @pl.loop(0, n_steps)
  def _(i):
    slot = lax.rem(i, stages)

    with jax.named_scope("wait_free"):   # (a region of common.PROFILE's trace)
      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(free_bar.at[slot])
    load(i)

  @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
  def _(i):
    plgpu.barrier_wait(free_bar.at[lax.rem(i, stages)])


def page_flags(ok_ref, b, block, *, page_size: int, P: int) -> list:
  """1 - ok of each page that KV block `block` of sequence b spans (scalars; load them
  early: a global-memory load's latency then hides behind the block's waits)."""
  copies, _ = copy_geometry(page_size)
  if copies == 1:
    return [1 - ok_ref[b, lax.div(block * BLOCK_KV, page_size)]]
  return [1 - ok_ref[b, jnp.minimum(block * copies + c, P - 1)] for c in range(copies)]


def masked_positions(idx, block, bad, *, page_size: int):
  """Positions ``block * BLOCK_KV + idx`` of a score block (idx: the token index iota),
  moved past every visibility limit where the token's page id was out of range (`bad`:
  `page_flags` of the block).

  Integer arithmetic only: vectors of booleans have no register layout here.
  """
  pos = block * BLOCK_KV + idx
  if len(bad) == 1:
    return pos + bad[0] * MASKED
  page_in_block = lax.div(idx, page_size)
  penalty = jnp.zeros_like(idx)
  for c, flag in enumerate(bad):
    penalty = jnp.where(page_in_block == c, flag * MASKED, penalty)
  return pos + penalty


def zero_masked_rows(tile, block, length, load_flags, *, page_size: int,
                     n_masked=None) -> None:
  """Rows of KV block `block`'s value columns `tile` (a (BLOCK_KV, C) shared-memory view)
  that no query may see -- positions at or past `length`, or on a masked page -- set to 0,
  then committed for the tensor cores (`commit_smem`).

  `load_flags`: a function returning the block's page flags (`page_flags`); a warpgroup
  that loaded them already for its scores passes ``lambda: flags``. Without `n_masked` it
  is called for every block. With `n_masked` (the sequence's `PageTable.n_masked`) it is
  called only in a block that may need the flags (past the length, or in a sequence with
  a masked page; the rows are then zeroed only if the block has such rows): a warpgroup
  that does not need the flags for its scores skips their loads and the test in the
  other blocks (the registers path's value warpgroup).

  Such rows enter the value product with weight 0, and 0 x NaN is NaN: past the length
  they hold whatever the page held before (stale rows, garbage written by padding tokens),
  and a masked page is read as page 0, the padding page. Only a block that has such rows
  pays (the last block of a sequence, or one with a masked page). The calling warpgroup
  must be the only reader of these columns until the call returns. H200
  (`logs/2026-12-05_ab_masked.log`, with and without): +0.5-2% on the narrow and wide
  paths, +2-3.6% on the converter before it passed `n_masked` (0.3-1.5% less,
  `logs/2026-12-05b_ab_converter_flags.log`).
  """
  past = (block + 1) * BLOCK_KV > length

  def zero_if_masked(flags):
    has = past
    for flag in flags:
      has = jnp.logical_or(has, flag > 0)

    @pl.when(has)
    def _():
      for c in range(0, tile.shape[-1], CONVERT_COLS):
        chunk = tile.at[:, pl.ds(c, CONVERT_COLS)]
        rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, CONVERT_COLS), 0,
                                      layout=plgpu.Layout.WGMMA)
        pos = masked_positions(rows, block, flags, page_size=page_size)
        x = plgpu.load(chunk, layout=plgpu.Layout.WGMMA)
        chunk[...] = jnp.where(pos < length, x, jnp.zeros_like(x))
      plgpu.commit_smem()

  if n_masked is None:
    zero_if_masked(load_flags())
    return

  @pl.when(jnp.logical_or(past, n_masked > 0))
  def _():
    zero_if_masked(load_flags())


def online_softmax(s, m_i, l_part, axis: int):
  """One block of the online softmax along `axis` of the (masked, log2-scaled) scores s.

  l_part: the running sums kept unreduced, in s's shape: the block's weights are added
  element by element, and the sum over `axis` (a cross-warp reduction when `axis` splits
  over warps: two warpgroup barriers) waits until the end (``l_part.sum(axis)``). Keeping
  it out of the loop took 3-11% off the narrow and converter paths on the H200
  (`logs/2026-12-04f_decode_lean_softmax.log`).

  Returns (m_new, alpha, p, l_part): the running max, the factor that rescales what was
  accumulated before, the block's weights exp2(s - max) and the running sums. A row with
  nothing visible yet keeps max -inf and gets weights 0.
  """
  keep = [1 - axis]
  m_new = jnp.maximum(m_i, s.max(axis=axis))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, keep))
  l_part = l_part * lax.broadcast_in_dim(alpha, s.shape, keep) + p
  return m_new, alpha, p, l_part


def accumulate(acc, a, b, interpret: bool):
  """acc + a . b on the tensor cores (wgmma; a and b shared-memory refs)."""
  if interpret:
    # The interpreter cannot pre-initialize an accumulator: add a fresh product.
    def product(r):
      plgpu.wgmma(r, a, b)
      return r[...]

    return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, F32))

  def product(acc_ref):
    plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(product)(plgpu.ACC.init(acc))


def convert_fp8(src, dst, chunks, dtype, layout, src_lead=(), dst_lead=()) -> None:
  """Exact fp8 -> `dtype` conversion of column chunks of a KV block in shared memory.

  chunks: the column slices (``pl.ds``), converted one at a time (a 64-column chunk keeps
  the temporaries at 32 registers a thread); ``src.at[(*src_lead, :, chunk)]`` ->
  ``dst.at[(*dst_lead, :, chunk)]``, loaded and stored in `layout`. e4m3 -> bf16 has no
  conversion instruction on sm_90 (ptxas 12/13): through float32, exact like e4m3 -> f16
  (e4m3 -> f16 -> f32 -> bf16). Integer bit moves instead (prmt, shift, mask, NaN flags and
  an exact bf16x2 multiply by 2^120) were exact but slower on the H200: 1.11 vs 0.84 us a
  64 x 512 block for one warpgroup (`benchmarks/diag_convert.py`), 92.8 vs 84.3 us for the
  converter path's B=64 H=16 context 4096 (`logs/2026-12-04b_*bit_moves*`).
  """
  direct = jnp.dtype(dtype) == jnp.dtype(jnp.float16)   # one cvt.rn.f16x2.e4m3x2 a pair
  for chunk in chunks:
    x = plgpu.load(src.at[(*src_lead, slice(None), chunk)], layout=layout)
    dst.at[(*dst_lead, slice(None), chunk)][...] = (
        x.astype(dtype) if direct else x.astype(F32).astype(dtype))


def convert_tile_kernel(cols: int, *, layout=plgpu.Layout.WGMMA_UPCAST_2X, repeats: int = 1,
                        interpret: bool = False, dtype=jnp.bfloat16):
  """A one-warpgroup kernel: a (BLOCK_KV, cols) float8_e4m3fn array -> `dtype` through
  shared memory by `convert_fp8` (as the decode kernels convert a block), `repeats` times
  (the GPU tests check every code exactly; `benchmarks/diag_convert.py` times it)."""
  pro = prologue(dtype, 64, 1.0)

  def body(x_ref, o_ref, x_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bar)
    plgpu.barrier_wait(bar)

    @pl.loop(0, repeats)
    def _(i):
      convert_fp8(x_smem, o_smem, [pl.ds(c, CONVERT_COLS) for c in range(0, cols, CONVERT_COLS)],
                  dtype, layout)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((BLOCK_KV, cols), dtype),
      scratch_types=[plgpu.SMEM((BLOCK_KV, cols), FP8_E4M3, transforms=pro.fp8_tile),
                     plgpu.SMEM((BLOCK_KV, cols), dtype, transforms=pro.tile),
                     plgpu.Barrier(num_arrivals=1)],
      num_threads=1, thread_name="wg", kernel_name="convert_tile",
      interpret=common.interpret_params() if interpret else None)


class RingLoader(NamedTuple):
  """The KV ring filled by a compute warpgroup (no producer warpgroup: a launch of three
  warpgroups caps ptxas at 168 registers a thread, and the decode kernels' accumulators
  spill there; two warpgroups get 255). `start` issues the first ``stages`` blocks; after
  step i released its stage, `refill(i)` waits for the release and loads block
  i + stages into it (or, past the last block, only observes the release, so that every
  barrier phase is consumed when the program ends)."""

  start: Callable[[], None]
  refill: Callable[[jax.Array], None]


def ring_loader(loader, gmem, smem, prog: Program, *, kv_bar, free_bar, stages: int,
                page_size: int, P: int) -> RingLoader:
  """The `RingLoader` of the warpgroup where `loader` (e.g. ``wg == 0``) is true: the
  blocks of program `prog` (`block_loader`), stage i % stages released on
  ``free_bar.at[slot]``."""
  n_steps = prog.n_steps
  load = block_loader(gmem, smem, kv_bar=kv_bar, stages=stages, pt_ref=prog.table.pages,
                      b=prog.b, first=prog.first, page_size=page_size, P=P)

  def start():
    @pl.when(loader)
    def _():
      for j in range(stages):
        pl.when(j < n_steps)(functools.partial(load, j))

  def refill(i):
    @pl.when(loader)
    def _():
      with jax.named_scope("wait_free"):    # (regions of common.PROFILE's trace)
        plgpu.barrier_wait(free_bar.at[lax.rem(i, stages)])

      with jax.named_scope("load"):
        @pl.when(i + stages < n_steps)
        def _():
          load(i + stages)

  return RingLoader(start, refill)


def block_loader(gmem, smem, *, kv_bar, stages: int, pt_ref, b, first, page_size: int,
                 P: int) -> Callable[[jax.Array], None]:
  """``load(i)``: the TMA copies of the program's block i (block first + i of sequence b),
  each plane of `gmem` (the layer's buffers: (kv,) or (nope, rope, scale)) into stage
  i % stages of the ring `smem` (one (stages, BLOCK_KV, ...) ref per plane), signalled on
  ``kv_bar.at[slot]``."""
  def load(i):
    slot = lax.rem(i, stages)
    planes = tuple((src, dst, (slot,)) for src, dst in zip(gmem, smem))
    copy_block(pt_ref, b, first + i, planes, kv_bar.at[slot], page_size=page_size, P=P)

  return load


def softmax_start(N: int, col_vec) -> tuple:
  """The running max (-inf) and the unreduced running sums (0) that `online_softmax` starts
  from, for (BLOCK_KV, N) blocks of S^T (tokens x query rows) in registers."""
  return (plgpu.layout_cast(jnp.full((N,), -jnp.inf, F32), col_vec),
          plgpu.layout_cast(jnp.full((BLOCK_KV, N), 0.0, F32), plgpu.Layout.WGMMA))


def softmax_end(m_i, l_part, n_steps, *, l_smem, staging, p_free, dst,
                l_units=None) -> None:
  """Warpgroup 0 after its last block of S^T: the running sums reduced over the tokens into
  `l_smem` (the warpgroups that accumulate values divide their outputs by them; times
  `l_units` (N,) where given), the other warpgroup's last release of P observed
  (`p_free`), then lse = ln(sum) + max (natural log; -inf where nothing was visible)
  through the shared-memory ref `staging` to the global-memory ref `dst`."""
  l_i = l_part.sum(axis=0)
  l_smem[...] = l_i if l_units is None else l_i * l_units

  @pl.when(n_steps > 0)
  def _():
    plgpu.barrier_wait(p_free)
  has = l_i > 0
  staging[...] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(staging, dst)


def publish_weights(i, p, alpha, *, p_smem, alpha_smem, p_free, p_ready) -> None:
  """Warpgroup 0 hands step i's softmax to the other compute warpgroup: it waits until
  that one has consumed step i - 1's (p_free), stores P (transposed into p_smem) and
  alpha, and signals p_ready."""
  @pl.when(i > 0)
  def _():
    plgpu.barrier_wait(p_free)
  p_smem.transpose((1, 0))[...] = p.astype(p_smem.dtype)
  alpha_smem[...] = alpha
  plgpu.commit_smem()
  plgpu.barrier_arrive(p_ready)
