"""mla_decode path "shared": the "wide" design with the score block split, not duplicated.

In "wide" both compute warpgroups compute the whole 64 x 64 score block (each then owns half
of the output columns): at H=128 the tensor cores do 1.5x the useful work and the kernel is
bound by them. Here warpgroup w computes the scores of tokens [32 w, 32 w + 32) only
(S_w = Q K_w^T, 64 x 32), the two exchange their row maxima through shared memory, each
writes its half of P to a shared (64 x 64) tile, and each accumulates its half of the output
columns from the whole P (from shared memory) -- two syncs a block instead of a second score
product. The running sums stay per warpgroup (partial sums over its tokens; both see the
same running max) and are added at the end.

Shared memory beyond "wide": P (64 x 64, 8 KB), which also carries the row maxima between
the warpgroups (each writes its maxima into the other's half of P, its owner reads them and
then overwrites them with its weights: three syncs a block) and, after the loop, the sums and
the lse staging: at H=128 "wide"'s shared memory is full to the last KB.
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
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, accumulate, convert_fp8, kv_producer,
                                             kv_scratch, masked_positions, online_softmax,
                                             program_blocks, prologue)

BLOCK_M = 64        # query rows per tile (a wgmma's M)


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None when this path runs the call (the plain cache, any query row count)."""
  del config
  if geo.quantized:
    return ("per_token_head (its converted tile and P do not fit shared memory next to "
            "the ring)")
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, safe_table, page_ok, lens, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W); returns (out (B, QR, R), lse (B, QR))."""
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
  out, lse = common.dispatch(build, *operands, q2, safe_table, page_ok, lens)
  out, lse = combine(out, lse, geo.dtype)
  return out[:, :QR], lse[:, :QR]


def _decode_kernel(interpret, *, B, s_q, H, R, Rr, P, QRp, tile_rows, m_tiles, splits,
                   page_size, dtype, quantized, sm_scale, stages):
  half = R // 2
  half_kv = BLOCK_KV // 2
  pro = prologue(dtype, page_size, sm_scale)
  tile, _, _, score_scale, _, _ = pro
  # P's column halves are written separately: tiles as wide as a half (32 x 2 bytes).
  p_tile = (plgpu.TilingTransform((8, half_kv)), plgpu.SwizzleTransform(half_kv * 2))

  def body(*refs):
    if quantized:
      (nope_ref, scale_ref, rope_ref, q_ref, pt_ref, ok_ref, len_ref, out_ref, lse_ref,
       q_smem, kv_smem, rope_smem, scale_smem, key_tile, (p_smem, stat_smem),
       q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (nope_ref, rope_ref, scale_ref), (kv_smem, rope_smem, scale_smem)
    else:
      (kv_ref, q_ref, pt_ref, ok_ref, len_ref, out_ref, lse_ref,
       q_smem, kv_smem, (p_smem, stat_smem), q_bar, kv_bar, free_bar, sync_bar) = refs
      planes, ring = (kv_ref,), (kv_smem,)
    mt = lax.axis_index("m")
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

      tok0 = wg * half_kv                  # this warpgroup's tokens of each block
      toks = pl.ds(tok0, half_kv)
      other = pl.ds(half_kv - tok0, half_kv)
      cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, half_kv), 1,
                                    layout=plgpu.Layout.WGMMA) + tok0
      rws = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, half_kv), 0,
                                   layout=plgpu.Layout.WGMMA)
      row_vec = plgpu.Layout.WGMMA.reduce(1)
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
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(0, R)], key_tile.at[toks].transpose((1, 0)))
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(R, Rr)],
                        rope_smem.at[slot, toks].transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot, toks].transpose((1, 0)))
          return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((BLOCK_M, half_kv), F32))
        pos = masked_positions(cols, block, ok_ref, b, page_size=page_size, P=P)
        visible = pos <= limit
        if quantized:
          col_scale = lax.broadcast_in_dim(
              plgpu.load(scale_smem.at[slot, toks], layout=plgpu.Layout.WGMMA.reduce(0)),
              (BLOCK_M, half_kv), [1])
          s = s * col_scale
          # The block's raw planes are consumed (converted, rope read by the score product,
          # scales loaded): the producer may refill the stage now.
          plgpu.barrier_arrive(free_bar.at[slot])
        s = jnp.where(visible, s * score_scale, -jnp.inf)
        # The block's row maxima: each warpgroup writes its half's (rounded to q's dtype,
        # which both sides then use alike: the softmax only needs the same stabilizer in
        # both, near the max) into the *other* half of P -- which its owner reads, then
        # overwrites with its weights. P is free once both have finished the previous
        # block's values.
        sync_compute()
        own = s.max(axis=1).astype(dtype)
        p_smem.at[:, other][...] = lax.broadcast_in_dim(own, (BLOCK_M, half_kv), [0])
        sync_compute()
        theirs = plgpu.load(p_smem.at[:, toks], layout=plgpu.Layout.WGMMA).astype(F32).max(axis=1)
        s_max = jnp.maximum(own.astype(F32), theirs)
        m_new, alpha, p, l_i = online_softmax(s, m_i, l_i, 1, block_max=s_max)
        # This half of P into the shared tile; the whole tile (both halves) times this
        # warpgroup's half of the value columns.
        p_smem.at[:, toks][...] = (p * col_scale if quantized else p).astype(dtype)
        plgpu.commit_smem()
        sync_compute()
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        values = key_tile.at[:, col0] if quantized else kv_smem.at[slot, :, col0]
        if interpret:   # (the interpreter takes wgmma operands from shared memory only)
          acc = accumulate(acc, p_smem, values, interpret)
        else:
          # P from registers: an A operand in shared memory would need the 128-byte swizzle
          # of the values, whose 64-column tiles the halves' writes cannot address.
          p_all = plgpu.load(p_smem, layout=plgpu.Layout.WGMMA)

          def product(acc_ref):
            plgpu.wgmma(acc_ref, p_all, values)

          acc = pl.run_state(product)(plgpu.ACC.init(acc))
        if not quantized:  # (per_token_head released its raw block after converting it)
          plgpu.barrier_arrive(free_bar.at[slot])
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

      # The running sums are over each warpgroup's tokens: add the other's, through shared
      # memory that P used (both are done with it after this sync, which also waits for
      # both warpgroups' score products, which read q_smem, before q_smem is reused).
      sync_compute()
      stat_smem.at[wg][...] = l_i
      sync_compute()
      l_i = plgpu.load(stat_smem.at[0], layout=row_vec) + plgpu.load(stat_smem.at[1],
                                                                     layout=row_vec)
      has = l_i > 0
      inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      q_smem.at[:, col0][...] = out.astype(dtype)

      @pl.when(wg == 0)
      def _():
        stat_smem.at[2][...] = jnp.where(
            has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2, -jnp.inf)
      plgpu.commit_smem()
      # One copy per 8-row tile row: a column half of a tiled tile is contiguous only
      # within its tile row.
      for g in range(tile_rows // 8):
        plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(8 * g, 8), col0],
                                out_ref.at[b, sp, pl.ds(mt * BLOCK_M + 8 * g, 8), col0])

      @pl.when(wg == 0)
      def _():
        plgpu.copy_smem_to_gmem(stat_smem.at[2, pl.ds(0, tile_rows)],
                                lse_ref.at[b, sp, pl.ds(mt * BLOCK_M, tile_rows)])
      plgpu.wait_smem_to_gmem(0)

    kv_producer(wg == 2, planes, ring, kv_bar=kv_bar, free_bar=free_bar, stages=stages,
                pt_ref=pt_ref, b=b, first=first, n_steps=n_steps, page_size=page_size, P=P,
                interpret=interpret)

  smem, barriers = kv_scratch(pro, q_rows=BLOCK_M, quantized=quantized, stages=stages, R=R,
                              Rr=Rr, dtype=dtype)
  smem += [plgpu.RefUnion(                            # P in the loop; after it the halves'
      plgpu.SMEM((BLOCK_M, BLOCK_KV), dtype, transforms=p_tile),  # sums and the lse staging
      plgpu.SMEM((3, BLOCK_M), F32))]
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, splits, QRp, R), dtype),
                jax.ShapeDtypeStruct((B, splits, QRp), F32)),
      scratch_types=smem + barriers,
      grid=(m_tiles, splits, B),
      grid_names=("m", "s", "b"),
      num_threads=3,
      thread_name="wg",
      kernel_name="mla_decode_shared_pth" if quantized else "mla_decode_shared",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=common.interpret_params() if interpret else None,
  )
