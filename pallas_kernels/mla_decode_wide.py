"""mla_decode path "wide": the query rows (s_q x H) are the wgmma M dimension.

Takes any number of query rows (the compute-bound case: H=128 heads, s_q up to 4); the
entry point `pallas_kernels.mla_decode` tries `mla_decode_converter` and `mla_decode_narrow`
first.

Design (FlashAttention-3 style, as jax's ``attention_mgpu``; the absorbed form of FlashMLA):

* The s_q x H query rows of a sequence are the M dimension of the tensor-core products,
  in tiles of 64 rows (a wgmma's M). Fewer rows are padded by uninitialized shared-memory
  rows: every row of attention is independent of the others, and padding rows' results are
  never stored.
* Grid (M tiles, splits, B); one program = 3 warpgroups. Warpgroup 2 is the producer: it
  reads the page table and issues TMA copies of 64-token KV blocks into a ring of
  ``stages`` shared-memory stages. Warpgroups 0 and 1 both compute the scores
  S = Q K^T (64 x 64, K = R+Rr) and the online softmax, and each accumulates its half of
  the R output columns (an accumulator of 64 x R/2 float32: 128 registers a thread for
  R = 512), so the KV block in shared memory serves both halves of V with no copy.
* Splits: each writes its partial output (q.dtype) and lse; `mla_decode.combine` merges.
* per_token_head: the producer loads the fp8 nope plane, the rope plane and the scales;
  each compute warpgroup converts its half of the nope columns to q.dtype in a shared
  tile (exact: e4m3 fits bf16/f16), S = q_nope . nope^T + q_rope . rope^T in two wgmmas,
  scores multiplied by the column's scale, softmax weights multiplied by it for P V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.common import F32
from pallas_kernels.mla_decode import (BLOCK_KV, LN2, DecodeConfig, Geometry,
                                       combine, num_sms, split_count)
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, convert_fp8, kv_producer, kv_scratch,
                                             masked_positions, online_softmax, page_table,
                                             program_blocks, prologue)

BLOCK_M = 64        # query rows per tile (a wgmma's M)


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None: this path runs the call (any query row count)."""
  del geo, config
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, meta, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W), meta (B, P + 1) (`PageTable`); returns
  (out (B, QR, R), lse (B, QR))."""
  QR = geo.QR
  QRp = -(-QR // 8) * 8 if QR <= BLOCK_M else -(-QR // BLOCK_M) * BLOCK_M
  m_tiles = -(-QRp // BLOCK_M)
  splits = num_splits or split_count(geo.B, m_tiles, geo.max_blocks, num_sms(config))
  if QRp != QR:
    q2 = jnp.pad(q2, ((0, 0), (0, QRp - QR), (0, 0)))
  build = functools.partial(
      _decode_kernel, B=geo.B, s_q=geo.s_q, H=geo.H, R=geo.R, Rr=geo.Rr, P=geo.P, QRp=QRp,
      tile_rows=min(QRp, BLOCK_M), m_tiles=m_tiles, splits=splits, page_size=geo.page_size,
      dtype=geo.dtype, quantized=geo.quantized, sm_scale=sm_scale, stages=config.stages)
  out, lse = common.dispatch(build, *operands, q2, meta)
  out, lse = combine(out, lse, geo.dtype)
  return out[:, :QR], lse[:, :QR]


def _decode_kernel(interpret, *, B, s_q, H, R, Rr, P, QRp, tile_rows, m_tiles, splits,
                   page_size, dtype, quantized, sm_scale, stages):
  half = R // 2
  pro = prologue(dtype, page_size, sm_scale)
  tile, _, _, score_scale, _, _ = pro

  def body(*refs):
    if interpret:
      *refs, p_smem = refs
    if quantized:
      (nope_ref, scale_ref, rope_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, rope_smem, scale_smem, key_tile, lse_smem,
       q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (nope_ref, rope_ref, scale_ref), (kv_smem, rope_smem, scale_smem)
    else:
      (kv_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, lse_smem, q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (kv_ref,), (kv_smem,)
    mt = lax.axis_index("m")
    pt_ref, ok_ref, len_ref = page_table(meta_ref, P)
    sp = lax.axis_index("s")
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")
    length, first, n_steps = program_blocks(len_ref, b, sp, splits)

    def sync_compute():
      plgpu.barrier_arrive(sync_bar)
      plgpu.barrier_wait(sync_bar)

    @pl.when(wg < 2)
    def _compute():
      if not interpret:
        plgpu.set_max_registers(232, action="increase")

      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(mt * BLOCK_M, tile_rows)],
                                q_smem.at[pl.ds(0, tile_rows)], q_bar)
      plgpu.barrier_wait(q_bar)

      cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_KV), 1,
                                    layout=plgpu.Layout.WGMMA)
      rws = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_KV), 0,
                                   layout=plgpu.Layout.WGMMA)
      # Query j of row r sees positions <= length - s_q + j.
      limit = length - s_q + lax.div(rws + mt * BLOCK_M, H)
      col0 = pl.ds(wg * half, half)

      m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, F32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((BLOCK_M,), 0.0, F32), plgpu.Layout.WGMMA.reduce(1))

      acc = plgpu.layout_cast(jnp.full((BLOCK_M, half), 0.0, F32), plgpu.Layout.WGMMA)

      def step(i, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(i, stages)
        block = first + i
        plgpu.barrier_wait(kv_bar.at[slot])
        if quantized:
          # Convert the fp8 nope block exactly to q's dtype in the shared tile `key_tile`
          # (the scale stays out: it multiplies the scores and the softmax weights below).
          # Both warpgroups' score products read all of it: the previous block's must be
          # done before it is overwritten, and this block's conversion (each warpgroup its
          # half of the columns) complete before either reads it.
          sync_compute()
          convert_fp8(kv_smem, key_tile, (pl.ds(wg * half + c * CONVERT_COLS, CONVERT_COLS)
                                          for c in range(half // CONVERT_COLS)),
                      dtype, plgpu.Layout.WGMMA, src_lead=(slot,))
          plgpu.commit_smem()
          sync_compute()

        def scores(s_ref):
          if quantized:
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(0, R)], key_tile.transpose((1, 0)))
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(R, Rr)], rope_smem.at[slot].transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot].transpose((1, 0)))
          return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((BLOCK_M, BLOCK_KV), F32))
        pos = masked_positions(cols, block, ok_ref, b, page_size=page_size, P=P)
        visible = pos <= limit
        if quantized:
          col_scale = lax.broadcast_in_dim(
              plgpu.load(scale_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)),
              (BLOCK_M, BLOCK_KV), [1])
          s = s * col_scale
          # The block's raw planes are consumed (converted, rope read by the score product,
          # scales loaded): the producer may refill the stage now.
          plgpu.barrier_arrive(free_bar.at[slot])
        s = jnp.where(visible, s * score_scale, -jnp.inf)
        m_new, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        pv = (p * col_scale if quantized else p).astype(dtype)
        values = key_tile.at[:, col0] if quantized else kv_smem.at[slot, :, col0]
        if interpret:
          # The interpreter takes wgmma operands from shared memory only and cannot
          # pre-initialize an accumulator: P goes through shared memory and the product
          # is added to the carried accumulator.
          p_smem.at[wg][...] = pv

          def product(r):
            plgpu.wgmma(r, p_smem.at[wg], values)
            return r[...]

          acc = acc + pl.run_scoped(product, plgpu.ACC((BLOCK_M, half), F32))
        else:
          def product(acc_ref):
            plgpu.wgmma(acc_ref, pv, values)

          acc = pl.run_state(product)(plgpu.ACC.init(acc))
        if not quantized:  # (per_token_head released its raw block after converting it)
          plgpu.barrier_arrive(free_bar.at[slot])
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

      # Both warpgroups' score products read q_smem: wait for both before reusing it.
      sync_compute()
      has = l_i > 0
      inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      q_smem.at[:, col0][...] = out.astype(dtype)

      @pl.when(wg == 0)
      def _():
        lse_smem[...] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2,
                                  -jnp.inf)
      plgpu.commit_smem()
      # One copy per 8-row tile row: a column half of a tiled tile is contiguous only
      # within its tile row.
      for g in range(tile_rows // 8):
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(8 * g, 8), col0],
                                out_ref.at[b, sp, pl.ds(mt * BLOCK_M + 8 * g, 8), col0])

      @pl.when(wg == 0)
      def _():
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, tile_rows)],
                                lse_ref.at[b, sp, pl.ds(mt * BLOCK_M, tile_rows)])
      plgpu.wait_smem_to_gmem(0)

    kv_producer(wg == 2, planes, ring, kv_bar=kv_bar, free_bar=free_bar, stages=stages,
                pt_ref=pt_ref, b=b, first=first, n_steps=n_steps, page_size=page_size, P=P,
                interpret=interpret)

  smem, barriers = kv_scratch(pro, q_rows=BLOCK_M, quantized=quantized, stages=stages, R=R,
                              Rr=Rr, dtype=dtype)
  smem += [plgpu.SMEM((BLOCK_M,), F32)]                # lse staging
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, splits, QRp, R), dtype),
                jax.ShapeDtypeStruct((B, splits, QRp), F32)),
      scratch_types=smem + barriers + (
          [plgpu.SMEM((2, BLOCK_M, BLOCK_KV), dtype, transforms=tile)] if interpret else []),
      grid=(m_tiles, splits, B),
      grid_names=("m", "s", "b"),
      num_threads=3,
      thread_name="wg",
      kernel_name="mla_decode_pth" if quantized else "mla_decode",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=common.interpret_params() if interpret else None,
  )
