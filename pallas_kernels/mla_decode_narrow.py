"""mla_decode path "narrow": at most 32 query rows, the tokens are the wgmma M dimension.

With DeepSeek-V3's 128 heads split over 8 GPUs, a decode step has H=16 query heads per
sequence (s_q x H = 16..64 rows with speculative tokens). The "wide" path makes those rows
the M dimension of every tensor-core product, padded to 64 (4x the work at 16 rows), and
both compute warpgroups compute the same score block: with the per_token_head cache (half
the bytes of bf16) that work, not memory, bounds the kernel. Here the products are
transposed so that the few query rows are the N dimension (8..256 in a wgmma):

    S^T (64 tokens x N)   = K (64 x (R+Rr)) . Q^T          (N = query rows, padded to 16/32)
    out^T (R x N)        += V^T (R x 64) . P^T (64 x N)     (V = the block's first R columns)

Per KV block that is 2*64*N*(R+Rr) + 2*R*64*N flops: 2.2 MFLOP at N=16 instead of 13.6.

Program = (split, sequence), 2 warpgroups (no producer warpgroup: with three, a launch caps
ptxas at 168 registers a thread and this kernel spilled, 324 bytes per_token_head):

* warpgroup 1 follows the page table with TMA copies of 64-token blocks into a ring of
  ``stages`` shared-memory stages, refilling a stage once both have released it
  (`mla_decode_parts.ring_loader`);
* warpgroup 0 computes S^T, the online softmax along the tokens (the block max is a
  reduction across its 4 warps, through shared memory: only this warpgroup reduces, so the
  compiler's single reduction scratch area is not shared; the running sums stay unreduced
  in registers until the last block, `mla_decode_parts.online_softmax`), writes P^T's
  transpose P (N x 64) and the rescale factors alpha (N) to shared memory, and signals
  warpgroup 1;
* warpgroups 0 and 1 each accumulate half of out^T (R/2 x N float32: 32 registers a thread
  at N=16) from V^T (the cached block read transposed from shared memory) and P.

per_token_head: both compute warpgroups first convert their half of the fp8 nope columns
to q.dtype in a shared tile (exact), which serves as K for S^T and as V for out^T; the row
scale multiplies the scores (rows of S^T) and the softmax weights.

Outputs are written transposed, (B, splits, R, N), and transposed back by the XLA epilogue
(with the split merge when there are several).
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
from pallas_kernels.mla_decode import (BLOCK_KV, DecodeConfig, Geometry, combine,
                                       num_sms, split_count)
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, accumulate, convert_fp8,
                                             decode_kernel, kv_scratch, masked_positions,
                                             online_softmax, page_flags, program, prologue,
                                             publish_weights, ring_loader, softmax_end,
                                             softmax_start, warpgroup_sync, zero_masked_rows)

MAX_ROWS = 32       # query rows (s_q x H) this path takes
SMEM_LIMIT = 227 * 1024
# Register layout of the per_token_head fp8 -> q.dtype conversion (loaded and stored in the
# same layout): 4 fp8 values (32 bits) in, 4 bf16 (64 bits) out per shared-memory access,
# where the WGMMA layout moves 2 and 2.
CONVERT_LAYOUT = plgpu.Layout.WGMMA_UPCAST_2X


def padded_rows(QR: int) -> int:
  """N of the products: the query rows rounded up to 16 (a 32-byte bf16 row at least)."""
  return max(16, -(-QR // 16) * 16)


def _smem_bytes(geo: Geometry, stages: int) -> int:
  n = padded_rows(geo.QR)
  W = geo.R + geo.Rr
  size = geo.dtype.itemsize
  total = n * W * size + n * BLOCK_KV * size + geo.R * n * size + 4 * 2 * n + 2048
  if geo.quantized:
    total += stages * BLOCK_KV * (geo.R + geo.Rr * size + 4) + BLOCK_KV * geo.R * size
  else:
    total += stages * BLOCK_KV * W * size
  return total


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None when this path runs the call, else why not."""
  if geo.QR > MAX_ROWS:
    return f"{geo.QR} query rows (s_q x H) per sequence (this path takes <= {MAX_ROWS})"
  if geo.R // 2 > 256 or geo.R % 128:
    return f"R={geo.R} (this path takes R % 128 == 0 and R <= 512)"
  if _smem_bytes(geo, config.stages or 2) > SMEM_LIMIT:
    return f"shared memory: {config.stages or 2} stages do not fit"
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, meta, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W), meta (B, P + 2) (`PageTable`); returns
  (out (B, QR, R), lse (B, QR))."""
  return run_rows_as_n(geo, config, operands, q2, meta, _kernel, num_splits=num_splits,
                       quantized=geo.quantized, sm_scale=sm_scale, stages=config.stages or 2)


def run_rows_as_n(geo: Geometry, config: DecodeConfig, operands, q2, meta, kernel, *,
                  num_splits: int | None, rows_last: bool = True, **static):
  """`run` of a path whose query rows are the products' N dimension (this one and
  "registers"): ``kernel(interpret, B=..., N=..., splits=..., **static)`` on q2 padded to N
  rows, its output merged over the splits by `combine` (one XLA fusion): out^T (B, splits,
  R, N), transposed there, with `rows_last` (this path), else rows (B, splits, N, R) with
  their columns in order (the registers path's `store_out_rows`)."""
  N = padded_rows(geo.QR)
  splits = num_splits or split_count(geo.B, 1, geo.max_blocks, num_sms(config))
  if N != geo.QR:
    q2 = jnp.pad(q2, ((0, 0), (0, N - geo.QR), (0, 0)))
  build = functools.partial(
      kernel, B=geo.B, s_q=geo.s_q, H=geo.H, R=geo.R, Rr=geo.Rr, P=geo.P, N=N,
      splits=splits, page_size=geo.page_size, dtype=geo.dtype, **static)
  out, lse = common.dispatch(build, *operands, q2, meta)
  out, lse = combine(out, lse, geo.dtype, rows_last=rows_last)
  return out[:, :geo.QR], lse[:, :geo.QR]


def _kernel(interpret, *, B, s_q, H, R, Rr, P, N, splits, page_size, dtype, quantized,
            sm_scale, stages):
  half = R // 2
  pro = prologue(dtype, page_size, sm_scale)
  tile, _, _, score_scale, row_vec, col_vec = pro

  def body(*refs):
    if quantized:
      (nope_ref, scale_ref, rope_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, rope_smem, scale_smem, key_tile, p_smem, o_smem, alpha_smem,
       l_smem, q_bar, kv_bar, free_bar, sync_bar, p_ready, p_free) = refs
      planes, ring = (nope_ref, rope_ref, scale_ref), (kv_smem, rope_smem, scale_smem)
    else:
      (kv_ref, q_ref, meta_ref, out_ref, lse_ref,
       q_smem, kv_smem, p_smem, o_smem, alpha_smem, l_smem,
       q_bar, kv_bar, free_bar, sync_bar, p_ready, p_free) = refs
      planes, ring = (kv_ref,), (kv_smem,)
    prog = program(meta_ref, P, splits)
    (pt_ref, ok_ref, _, _), b, sp, wg, length, first, n_steps = prog
    col0 = pl.ds(wg * half, half)

    def values_tile(slot):
      """This warpgroup's half of the value columns of the block in `slot`."""
      return key_tile.at[:, col0] if quantized else kv_smem.at[slot, :, col0]

    def accumulate_values(acc, slot):
      """acc (half, N) += V^T . P over this warpgroup's half of the value columns."""
      return accumulate(acc, values_tile(slot).transpose((1, 0)), p_smem.transpose((1, 0)),
                        interpret)

    ring_io = ring_loader(wg == 1, planes, ring, prog, kv_bar=kv_bar, free_bar=free_bar,
                          stages=stages, page_size=page_size, P=P)

    def _compute():
      ring_io.start()

      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

      acc = plgpu.layout_cast(jnp.full((half, N), 0.0, F32), plgpu.Layout.WGMMA)
      tok = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 0, layout=plgpu.Layout.WGMMA)
      qrow = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 1, layout=plgpu.Layout.WGMMA)
      # Query j (row r = j * H + h) sees positions <= length - s_q + j.
      limit = length - s_q + lax.div(qrow, H)

      def softmax(i, slot, bad, m_i, l_part):
        """Warpgroup 0: S^T of block i and the online softmax (`bad`: the block's
        `page_flags`); P and alpha go to shared memory for both warpgroups. Returns the
        running max and the unreduced running sums (registers of warpgroup 0)."""
        def scores(s_ref):
          if quantized:
            plgpu.wgmma(s_ref, key_tile, q_smem.at[:, pl.ds(0, R)].transpose((1, 0)))
            plgpu.wgmma(s_ref, rope_smem.at[slot], q_smem.at[:, pl.ds(R, Rr)].transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, kv_smem.at[slot], q_smem.transpose((1, 0)))
          return s_ref[...]

        with jax.named_scope("scores"):
          s = pl.run_scoped(scores, plgpu.ACC((BLOCK_KV, N), F32))
        pos = masked_positions(tok, first + i, bad, page_size=page_size)
        if quantized:
          row_scale = lax.broadcast_in_dim(
              plgpu.load(scale_smem.at[slot], layout=row_vec), (BLOCK_KV, N), [0])
          s = s * row_scale
        s = jnp.where(pos <= limit, s * score_scale, -jnp.inf)
        m_i, alpha, p, l_part = online_softmax(s, m_i, l_part, 0)
        if quantized:
          # (a masked row's scale may be NaN or inf: its weight 0 must stay 0)
          p = jnp.where(pos <= limit, p * row_scale, 0.0)
          # The raw planes are consumed (nope converted by both warpgroups before this
          # step, rope read by the score product, scales loaded).
          plgpu.barrier_arrive(free_bar.at[slot])
        with jax.named_scope("publish"):
          publish_weights(i, p, alpha, p_smem=p_smem, alpha_smem=alpha_smem, p_free=p_free,
                          p_ready=p_ready)
        return m_i, l_part

      # Both warpgroups carry the running max and sums; only warpgroup 0's are used.
      @pl.loop(0, n_steps, init_carry=(acc, *softmax_start(N, col_vec)))
      def carry(i, carry):
        acc, m_i, l_part = carry
        slot = lax.rem(i, stages)
        bad = page_flags(ok_ref, b, first + i, page_size=page_size, P=P)   # (loaded early)
        with jax.named_scope("wait_kv"):      # (regions of common.PROFILE's trace)
          plgpu.barrier_wait(kv_bar.at[slot])
        if quantized:
          # Convert the fp8 nope block exactly to q's dtype in `key_tile` (the scale stays
          # out: it multiplies the scores and the softmax weights). The previous block's
          # products must be done before it is overwritten, and both halves converted
          # before the score product reads it.
          with jax.named_scope("sync_done"):
            warpgroup_sync(sync_bar)
          with jax.named_scope("convert"):
            convert_fp8(kv_smem, key_tile, (pl.ds(wg * half + c * CONVERT_COLS, CONVERT_COLS)
                                            for c in range(half // CONVERT_COLS)),
                        dtype, CONVERT_LAYOUT, src_lead=(slot,))
            plgpu.commit_smem()
          with jax.named_scope("sync_converted"):
            warpgroup_sync(sync_bar)

          @pl.when(wg == 1)
          def _():
            plgpu.barrier_arrive(free_bar.at[slot])
          ring_io.refill(i)     # (warpgroup 1, once warpgroup 0's scores released it too)

        with jax.named_scope("softmax"):      # (warpgroup 0: scores, softmax, publish)
          m_i, l_part = lax.cond(wg == 0, lambda c: softmax(i, slot, bad, *c), lambda c: c,
                                 (m_i, l_part))

        with jax.named_scope("wait_p"):
          @pl.when(wg == 1)
          def _():
            plgpu.barrier_wait(p_ready)
        with jax.named_scope("values"):
          # The block's scores are done (P is published): each warpgroup alone reads its
          # half of the value columns from here on.
          zero_masked_rows(values_tile(slot), first + i, length, lambda: bad,
                           page_size=page_size)
          alpha = plgpu.load(alpha_smem, layout=col_vec)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
          acc = accumulate_values(acc, slot)

        @pl.when(wg == 1)
        def _():
          plgpu.barrier_arrive(p_free)
        if not quantized:
          plgpu.barrier_arrive(free_bar.at[slot])
          ring_io.refill(i)
        return acc, m_i, l_part

      acc, m_i, l_part = carry

      @pl.when(wg == 0)
      def _():
        softmax_end(m_i, l_part, n_steps, l_smem=l_smem, staging=alpha_smem, p_free=p_free,
                    dst=lse_ref.at[b, sp])

      warpgroup_sync(sync_bar)
      l_all = plgpu.load(l_smem, layout=col_vec)
      has = l_all > 0
      inv = jnp.where(has, 1.0 / jnp.where(has, l_all, 1.0), 0.0)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
      o_smem.at[col0][...] = out.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[col0], out_ref.at[b, sp, col0])
      plgpu.wait_smem_to_gmem(0)

    _compute()

  smem, barriers = kv_scratch(pro, q_rows=N, quantized=quantized, stages=stages, R=R, Rr=Rr,
                              dtype=dtype)
  smem += [
      plgpu.SMEM((N, BLOCK_KV), dtype, transforms=tile),   # P (N x 64 tokens)
      plgpu.SMEM((R, N), dtype),                           # out^T staging
      plgpu.SMEM((N,), F32),                               # alpha, then lse
      plgpu.SMEM((N,), F32),                               # running sum (at the end)
  ]
  barriers += [
      plgpu.Barrier(num_arrivals=1),                              # P ready (wg 0 -> 1)
      plgpu.Barrier(num_arrivals=1),                              # P free (wg 1 -> 0)
  ]
  return decode_kernel(body, out_shape=(R, N), rows=N, dtype=dtype, scratch=smem + barriers,
                       splits=splits, B=B, num_threads=2, interpret=interpret,
                       name="mla_decode_narrow_pth" if quantized else "mla_decode_narrow")
