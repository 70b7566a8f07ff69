"""mla_decode path "wide": the query rows (s_q x H) are the wgmma M dimension.

Takes any number of query rows (the compute-bound case: H=128 heads, s_q up to 4); the
entry point `pallas_kernels.mla_decode` tries `mla_decode_registers` and `mla_decode_narrow`
first.

Design (FlashAttention-3 style, as jax's ``attention_mgpu``; the absorbed form of FlashMLA):

* The s_q x H query rows of a sequence are the M dimension of the tensor-core products,
  in tiles of 64 rows (a wgmma's M). Fewer rows are padded by uninitialized shared-memory
  rows: every row of attention is independent of the others, and padding rows' results are
  never stored.
* Grid (M tiles, splits, B); one program = 2 warpgroups, which each accumulate half of the
  R output columns (an accumulator of 64 x R/2 float32: 128 registers a thread for
  R = 512), so the KV block in shared memory serves both halves of V with no copy.
  Warpgroup 0 also follows the page table and issues the TMA copies of 64-token KV blocks
  into a ring of ``stages`` shared-memory stages: it refills a stage as soon as both have
  released it. No producer warpgroup (as FlashMLA): with three warpgroups a launch allows
  ptxas at most 168 registers a thread, whatever ``setmaxnreg`` raises them to later, and
  the compute warpgroups spilled (84 bytes bf16, 628 bytes per_token_head).
* Scores: warpgroup w computes those of the block's tokens [32 w, 32 w + 32) (64 x 32,
  K = R + Rr), so the score product is computed once, not by both warpgroups. The halves
  meet in shared memory twice a block: (1) each half's row maxima (the block's max is the
  larger), so that both warpgroups rescale by the same running max; (2) each half's softmax
  weights, written into one P^T tile (64 tokens x 64 rows) that both warpgroups then read as
  the A operand of P V. Each warpgroup keeps the running sum of its own tokens' weights (the
  rescaling factors are the same in both); the two are added once at the end.
* Splits: each writes its partial output (q.dtype) and lse; `mla_decode.combine` merges.
* per_token_head: the ring holds the fp8 nope plane, the rope plane and the scales;
  each compute warpgroup converts its half of the nope columns (the columns it later reads
  as values) to q.dtype in a shared tile (exact: e4m3 fits bf16/f16), then both score their
  tokens from it (q_nope . nope^T + q_rope . rope^T in two wgmmas), scores multiplied by the
  token's scale, softmax weights multiplied by it for P V.
* Every shared-memory allocation of a Mosaic GPU kernel is aligned to 1 KB and the query
  tile and two stages take 216 KB of the 227: the row maxima and sums share one buffer that
  later stages the lse, and the kernel reserves no cross-warp reduction scratch (its row
  reductions stay inside a warp).

H200 (benchmarks/README, "Decode attention"): 6-9% faster than both warpgroups computing
the whole score block (H=128 B=128 context 4096, bf16: 339 vs 361 us at s_q=1, 664 vs 728
at s_q=2).
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
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, accumulate, convert_fp8,
                                             decode_kernel, kv_scratch, masked_positions,
                                             page_flags, program, prologue, ring_loader,
                                             warpgroup_sync, zero_masked_rows)

BLOCK_M = 64        # query rows per tile (a wgmma's M)
HALF_KV = BLOCK_KV // 2


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None: this path runs the call (any query row count)."""
  del geo, config
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, meta, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W), meta (B, P + 2) (`PageTable`); returns
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
      dtype=geo.dtype, quantized=geo.quantized, sm_scale=sm_scale, stages=config.stages or 2)
  out, lse = common.dispatch(build, *operands, q2, meta)
  out, lse = combine(out, lse, geo.dtype)
  return out[:, :QR], lse[:, :QR]


def _decode_kernel(interpret, *, B, s_q, H, R, Rr, P, QRp, tile_rows, m_tiles, splits,
                   page_size, dtype, quantized, sm_scale, stages):
  half = R // 2
  pro = prologue(dtype, page_size, sm_scale)
  tile, score_scale = pro.tile, pro.score_scale
  row_vec = plgpu.Layout.WGMMA.reduce(1)     # one value per query row

  def body(*refs):
    if quantized:
      (nope_ref, scale_ref, rope_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, rope_smem, scale_smem, key_tile, p_smem, row_smem,
       q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (nope_ref, rope_ref, scale_ref), (kv_smem, rope_smem, scale_smem)
    else:
      (kv_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, p_smem, row_smem, q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (kv_ref,), (kv_smem,)
    mt = lax.axis_index("m")
    prog = program(meta_ref, P, splits)
    (pt_ref, ok_ref, _, _), b, sp, wg, length, first, n_steps = prog
    other = 1 - wg
    ring_io = ring_loader(wg == 0, planes, ring, prog, kv_bar=kv_bar, free_bar=free_bar,
                          stages=stages, page_size=page_size, P=P)

    def _compute():
      ring_io.start()

      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(mt * BLOCK_M, tile_rows)],
                                q_smem.at[pl.ds(0, tile_rows)], q_bar)
      plgpu.barrier_wait(q_bar)

      own = pl.ds(wg * HALF_KV, HALF_KV)       # this one's tokens
      cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, HALF_KV), 1,
                                    layout=plgpu.Layout.WGMMA) + wg * HALF_KV
      rws = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, HALF_KV), 0,
                                   layout=plgpu.Layout.WGMMA)
      # Query j of row r sees positions <= length - s_q + j.
      limit = length - s_q + lax.div(rws + mt * BLOCK_M, H)
      col0 = pl.ds(wg * half, half)

      m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, F32), row_vec)
      l_i = plgpu.layout_cast(jnp.full((BLOCK_M,), 0.0, F32), row_vec)
      acc = plgpu.layout_cast(jnp.full((BLOCK_M, half), 0.0, F32), plgpu.Layout.WGMMA)

      def step(i, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(i, stages)
        block = first + i
        bad = page_flags(ok_ref, b, block, page_size=page_size, P=P)   # (loaded early)
        with jax.named_scope("wait_kv"):     # (regions of common.PROFILE's trace)
          plgpu.barrier_wait(kv_bar.at[slot])
        if quantized:
          # This warpgroup's half of the nope columns -> key_tile, exactly, in q's dtype
          # (the scale stays out: it multiplies the scores and the softmax weights). The
          # previous block's readers of these columns are done: its score products before
          # the first exchange, this warpgroup's values before this step.
          with jax.named_scope("convert"):
            convert_fp8(kv_smem, key_tile, (pl.ds(wg * half + c * CONVERT_COLS, CONVERT_COLS)
                                            for c in range(half // CONVERT_COLS)),
                        dtype, plgpu.Layout.WGMMA, src_lead=(slot,))
            plgpu.commit_smem()
          with jax.named_scope("sync_converted"):
            warpgroup_sync(sync_bar)  # both halves converted

        def scores(s_ref):
          if quantized:
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(0, R)], key_tile.at[own].transpose((1, 0)))
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(R, Rr)],
                        rope_smem.at[slot, own].transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot, own].transpose((1, 0)))
          return s_ref[...]

        with jax.named_scope("scores"):
          s = pl.run_scoped(scores, plgpu.ACC((BLOCK_M, HALF_KV), F32))
        pos = masked_positions(cols, block, bad, page_size=page_size)
        if quantized:
          col_scale = lax.broadcast_in_dim(
              plgpu.load(scale_smem.at[slot, own], layout=plgpu.Layout.WGMMA.reduce(0)),
              (BLOCK_M, HALF_KV), [1])
          s = s * col_scale
          # The raw planes are consumed (converted, this half's rope scored, scales loaded).
          plgpu.barrier_arrive(free_bar.at[slot])
          ring_io.refill(i)
        s = jnp.where(pos <= limit, s * score_scale, -jnp.inf)
        # Exchange 1: the block's row max is the larger of the two halves'.
        mine = s.max(axis=1)
        row_smem.at[wg][...] = mine
        with jax.named_scope("sync_max"):
          warpgroup_sync(sync_bar)
        m_new = jnp.maximum(m_i, jnp.maximum(mine, plgpu.load(row_smem.at[other],
                                                               layout=row_vec)))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        # (a masked column's scale may be NaN or inf: its weight 0 must stay 0)
        pv = (jnp.where(pos <= limit, p * col_scale, 0.0) if quantized else p).astype(dtype)
        # Exchange 2: the weights.
        p_smem.at[own].transpose((1, 0))[...] = pv
        plgpu.commit_smem()
        with jax.named_scope("sync_p"):
          warpgroup_sync(sync_bar)
        with jax.named_scope("values"):
          values = key_tile if quantized else kv_smem.at[slot]
          # Both score products are done: this warpgroup alone reads its value columns.
          zero_masked_rows(values.at[:, col0], block, length, lambda: bad,
                           page_size=page_size)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          acc = accumulate(acc, p_smem.transpose((1, 0)), values.at[:, col0], interpret)
        if not quantized:
          plgpu.barrier_arrive(free_bar.at[slot])
          ring_io.refill(i)
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

      # The row sums of the two token halves; the sync also means both warpgroups' score
      # products (readers of q_smem) are done before the output is staged there.
      row_smem.at[wg][...] = l_i
      warpgroup_sync(sync_bar)
      l_i = l_i + plgpu.load(row_smem.at[other], layout=row_vec)
      warpgroup_sync(sync_bar)  # both read: row_smem.at[0] stages the lse below
      has = l_i > 0
      inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      q_smem.at[:, col0][...] = out.astype(dtype)

      @pl.when(wg == 0)
      def _():
        row_smem.at[0][...] = jnp.where(
            has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2, -jnp.inf)
      plgpu.commit_smem()
      # One copy per 8-row tile row: a column half of a tiled tile is contiguous only
      # within its tile row.
      for g in range(tile_rows // 8):
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(8 * g, 8), col0],
                                out_ref.at[b, sp, pl.ds(mt * BLOCK_M + 8 * g, 8), col0])

      @pl.when(wg == 0)
      def _():
        plgpu.copy_smem_to_gmem(row_smem.at[0, pl.ds(0, tile_rows)],
                                lse_ref.at[b, sp, pl.ds(mt * BLOCK_M, tile_rows)])
      plgpu.wait_smem_to_gmem(0)

    _compute()

  smem, barriers = kv_scratch(pro, q_rows=BLOCK_M, quantized=quantized, stages=stages, R=R,
                              Rr=Rr, dtype=dtype)
  smem += [plgpu.SMEM((BLOCK_KV, BLOCK_M), dtype, transforms=tile),        # P^T (both halves)
           plgpu.SMEM((2, BLOCK_M), F32)]          # row max / sum halves, then the lse
  # The row reductions stay inside a warp (WGMMA layout): no cross-warp scratch, whose 2 KB
  # would not fit at H = 128.
  return decode_kernel(body, out_shape=(QRp, R), rows=QRp, dtype=dtype,
                       scratch=smem + barriers, splits=splits, B=B, m_tiles=m_tiles,
                       num_threads=2, name="mla_decode_pth" if quantized else "mla_decode",
                       interpret=interpret, reduction_scratch_bytes=0)
