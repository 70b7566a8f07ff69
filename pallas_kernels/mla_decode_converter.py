"""mla_decode path "converter": per_token_head, at most 16 query rows, a converting warpgroup.

The "narrow" path's per_token_head kernel converts each block's fp8 nope plane to q's dtype
with both compute warpgroups, then computes the scores, then the values, one block after
the other: measured on the H200 (benchmarks/README, "Decode attention"), the conversion is
~30% of its time and nothing overlaps it. This path gives the conversion its own place in a
pipeline, with two converted tiles in shared memory:

    warpgroup 1:  convert block i+1  | values of block i (its half)   | convert block i+2 ...
    warpgroup 0:  scores + softmax of block i | values of block i (other half) | ...

Warpgroup 0 computes S^T = K Q^T of block i from its converted tile and the rope plane, the
online softmax (scale folded into the scores and the weights, as in "narrow"), writes P
and alpha to shared memory and accumulates its half of out^T = V^T P^T; meanwhile
warpgroup 1 converts the next block into the other tile, then accumulates its half of
block i's values. Two producer warpgroups follow the page table: one streams the fp8 nope
plane and the scales (a ring of two blocks), the other the rope plane into one buffer
(loaded as soon as the previous block's scores are done), so neither stream waits for the
other.

Shared memory at 16 query rows: q 18 KB, fp8 ring 2 x 32.25 KB, two converted tiles
2 x 64 KB, rope 8 KB, P 2 KB: 221 KB of the 227 KB. More rows do not fit (the "narrow"
path takes them). The output is staged in q's buffer (free after the last scores) and
written as (B, splits, N, R + Rr) (the last Rr columns unused).
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
from pallas_kernels.mla_decode import (BLOCK_KV, FP8_E4M3, DecodeConfig, Geometry, combine,
                                       num_sms, split_count)
from pallas_kernels.mla_decode_parts import (CONVERT_COLS, accumulate, convert_fp8,
                                             copy_block, decode_kernel, masked_positions,
                                             online_softmax, page_flags, produce, program,
                                             prologue, publish_weights, softmax_end,
                                             softmax_start, warpgroup_sync, zero_masked_rows)
from pallas_kernels.mla_decode_narrow import CONVERT_LAYOUT, SMEM_LIMIT

MAX_ROWS = 16


def _smem_bytes(geo: Geometry) -> int:
  n, size = MAX_ROWS, geo.dtype.itemsize
  return (n * (geo.R + geo.Rr) * size                 # q (then the output)
          + 2 * BLOCK_KV * (geo.R + 4)                # fp8 nope + scale ring
          + 2 * BLOCK_KV * geo.R * size               # converted tiles
          + BLOCK_KV * geo.Rr * size                  # rope
          + n * BLOCK_KV * size + 2 * 4 * n + 2048)   # P, alpha/sum, barriers and slack


def takes(geo: Geometry, config: DecodeConfig) -> str | None:
  """None when this path runs the call, else why not."""
  del config
  if not geo.quantized:
    return "the plain cache (this path converts per_token_head fp8)"
  if geo.QR > MAX_ROWS:
    return f"{geo.QR} query rows (s_q x H) per sequence (this path takes <= {MAX_ROWS})"
  if geo.R // 2 > 256 or geo.R % 128:
    return f"R={geo.R} (this path takes R % 128 == 0 and R <= 512)"
  if _smem_bytes(geo) > SMEM_LIMIT:
    return "shared memory: two converted tiles do not fit"
  return None


def run(geo: Geometry, config: DecodeConfig, operands, q2, meta, *,
        sm_scale: float, num_splits: int | None):
  """The kernel on prepared operands: q2 (B, QR, W), meta (B, P + 2) (`PageTable`); returns
  (out (B, QR, R), lse (B, QR))."""
  QR, N = geo.QR, MAX_ROWS
  splits = num_splits or split_count(geo.B, 1, geo.max_blocks, num_sms(config))
  if N != QR:
    q2 = jnp.pad(q2, ((0, 0), (0, N - QR), (0, 0)))
  build = functools.partial(
      _kernel, B=geo.B, s_q=geo.s_q, H=geo.H, R=geo.R, Rr=geo.Rr, P=geo.P, N=N,
      splits=splits, page_size=geo.page_size, dtype=geo.dtype, sm_scale=sm_scale)
  out, lse = common.dispatch(build, *operands, q2, meta)
  out, lse = combine(out[..., :geo.R], lse, geo.dtype)
  return out[:, :QR], lse[:, :QR]


def _kernel(interpret, *, B, s_q, H, R, Rr, P, N, splits, page_size, dtype, sm_scale):
  W = R + Rr
  half = R // 2
  tile, fp8_tile, copies, score_scale, row_vec, col_vec = prologue(dtype, page_size, sm_scale)

  def body(nope_ref, scale_ref, rope_ref, q_ref, meta_ref, out_ref, lse_ref,
           q_smem, raw_smem, scale_smem, rope_smem, tiles, p_smem, stats_smem,
           q_bar, raw_full, raw_free, rope_full, rope_free, tile_ready, tile_free, p_ready,
           p_free, sync_bar):
    # alpha (then the lse) and the sum: one buffer (each allocation takes a whole KB),
    # which leaves room for the in-kernel profiler's records (common.PROFILE).
    alpha_smem, l_smem = stats_smem.at[0], stats_smem.at[1]
    (pt_ref, ok_ref, _, masked_ref), b, sp, wg, length, first, n_steps = program(
        meta_ref, P, splits)

    def load(i, src, dst, barrier):
      """TMA copies of the program's block i of `src` into `dst`, through the page table."""
      copy_block(pt_ref, b, first + i, ((src, dst, ()),), barrier, page_size=page_size, P=P)

    def accumulate_values(acc, i, cols, load_flags, n_masked=None):
      """acc (half, N) += V^T . P over the value columns `cols` (a half) of block i's tile
      (`load_flags`, `n_masked`: as `zero_masked_rows` takes them), after rescaling acc by the
      block's alpha. Block i's scores are done (P is published): the calling warpgroup
      alone reads these columns now."""
      j = lax.rem(i, 2)
      zero_masked_rows(tiles.at[j, :, cols], first + i, length, load_flags, page_size=page_size,
                       n_masked=n_masked)
      values_t = tiles.at[j, :, cols].transpose((1, 0))
      p_t = p_smem.transpose((1, 0))
      alpha = plgpu.load(alpha_smem, layout=col_vec)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      return accumulate(acc, values_t, p_t, interpret)

    def convert(i):
      """Warpgroup 1: block i's fp8 nope plane -> tile i % 2, exactly, in q's dtype (the
      scale stays out: it multiplies the scores and the softmax weights)."""
      j = lax.rem(i, 2)

      with jax.named_scope("wait_tile_free"):   # (regions of common.PROFILE's trace)
        @pl.when(i >= 2)
        def _():
          plgpu.barrier_wait(tile_free.at[j])   # both halves of block i - 2's values done
      with jax.named_scope("wait_raw"):
        plgpu.barrier_wait(raw_full.at[j])
      with jax.named_scope("convert"):
        convert_fp8(raw_smem, tiles, (pl.ds(c * CONVERT_COLS, CONVERT_COLS)
                                      for c in range(R // CONVERT_COLS)),
                    dtype, CONVERT_LAYOUT, src_lead=(j,), dst_lead=(j,))
        plgpu.commit_smem()
      plgpu.barrier_arrive(raw_free.at[j])
      plgpu.barrier_arrive(tile_ready.at[j])

    def values_of(i, acc, n_masked):
      """Warpgroup 1: its half of block i's values, once warpgroup 0 has written P. The
      page flags are loaded only in a sequence with a masked page (`n_masked` > 0): this
      warpgroup needs them only for `zero_masked_rows`."""
      j = lax.rem(i, 2)
      with jax.named_scope("wait_p"):
        plgpu.barrier_wait(p_ready)
      with jax.named_scope("values"):
        acc = accumulate_values(
            acc, i, pl.ds(half, half),
            lambda: page_flags(ok_ref, b, first + i, page_size=page_size, P=P), n_masked)
      plgpu.barrier_arrive(tile_free.at[j])
      plgpu.barrier_arrive(p_free)
      return acc

    @pl.when(wg < 2)
    def _compute():
      if not interpret:
        plgpu.set_max_registers(224, action="increase")
      acc = plgpu.layout_cast(jnp.full((half, N), 0.0, F32), plgpu.Layout.WGMMA)

      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

      def wg0_loop(acc):
        tok = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 0, layout=plgpu.Layout.WGMMA)
        qrow = plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, N), 1, layout=plgpu.Layout.WGMMA)
        # Query j (row r = j * H + h) sees positions <= length - s_q + j.
        limit = length - s_q + lax.div(qrow, H)

        # The running max and the unreduced running sums (`online_softmax`) in registers.
        @pl.loop(0, n_steps, init_carry=(acc, *softmax_start(N, col_vec)))
        def carry(i, carry):
          acc, m_i, l_part = carry
          j = lax.rem(i, 2)
          bad = page_flags(ok_ref, b, first + i, page_size=page_size, P=P)   # (loaded early)
          with jax.named_scope("wait_raw"):
            plgpu.barrier_wait(raw_full.at[j])
          row_scale = lax.broadcast_in_dim(
              plgpu.load(scale_smem.at[j], layout=row_vec), (BLOCK_KV, N), [0])
          plgpu.barrier_arrive(raw_free.at[j])
          with jax.named_scope("wait_tile"):
            plgpu.barrier_wait(tile_ready.at[j])
          with jax.named_scope("wait_rope"):
            plgpu.barrier_wait(rope_full)

          def scores(s_ref):
            plgpu.wgmma(s_ref, tiles.at[j], q_smem.at[:, pl.ds(0, R)].transpose((1, 0)))
            plgpu.wgmma(s_ref, rope_smem, q_smem.at[:, pl.ds(R, Rr)].transpose((1, 0)))
            return s_ref[...]

          with jax.named_scope("scores"):
            s = pl.run_scoped(scores, plgpu.ACC((BLOCK_KV, N), F32))
          plgpu.barrier_arrive(rope_free)
          with jax.named_scope("softmax"):
            pos = masked_positions(tok, first + i, bad, page_size=page_size)
            s = jnp.where(pos <= limit, s * row_scale * score_scale, -jnp.inf)
            m_i, alpha, p, l_part = online_softmax(s, m_i, l_part, 0)
            # (a masked row's scale may be NaN or inf: its weight 0 must stay 0)
            p = jnp.where(pos <= limit, p * row_scale, 0.0)
          with jax.named_scope("publish"):
            publish_weights(i, p, alpha, p_smem=p_smem, alpha_smem=alpha_smem, p_free=p_free,
                            p_ready=p_ready)
          with jax.named_scope("values"):
            acc = accumulate_values(acc, i, pl.ds(0, half), lambda: bad)
          plgpu.barrier_arrive(tile_free.at[j])
          return acc, m_i, l_part

        acc, m_i, l_part = carry
        softmax_end(m_i, l_part, n_steps, l_smem=l_smem, staging=alpha_smem, p_free=p_free,
                    dst=lse_ref.at[b, sp])
        return acc

      def wg1_loop(acc):
        n_masked = masked_ref[b]

        @pl.when(n_steps > 0)
        def _():
          convert(0)

        @pl.loop(1, n_steps, init_carry=acc)
        def acc(i, acc):
          convert(i)
          return values_of(i - 1, acc, n_masked)

        @pl.loop(jnp.maximum(n_steps - 1, 0), n_steps, init_carry=acc)
        def acc(i, acc):
          return values_of(i, acc, n_masked)

        # Observe the last two blocks' releases, so that every barrier phase is consumed
        # when the program ends (the interpreter checks it; on the GPU it costs nothing).
        @pl.loop(jnp.maximum(n_steps - 2, 0), n_steps)
        def _(i):
          plgpu.barrier_wait(tile_free.at[lax.rem(i, 2)])
        return acc

      def epilogue(acc, cols):
        """Both compute warpgroups: out^T / sum, staged in q's buffer (a TMA source must be
        contiguous: the whole buffer goes out, (N, R + Rr), its last Rr columns unused)."""
        warpgroup_sync(sync_bar)
        l_all = plgpu.load(l_smem, layout=col_vec)
        has = l_all > 0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_all, 1.0), 0.0)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
        q_smem.at[:, cols].transpose((1, 0))[...] = out.astype(dtype)
        plgpu.commit_smem()
        warpgroup_sync(sync_bar)

        @pl.when(wg == 0)
        def _():
          plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, sp])
          plgpu.wait_smem_to_gmem(0)

      @pl.when(wg == 0)
      def _():
        epilogue(wg0_loop(acc), pl.ds(0, half))

      @pl.when(wg == 1)
      def _():
        epilogue(wg1_loop(acc), pl.ds(half, half))

    @pl.when(wg == 2)
    def _nope_producer():
      if not interpret:
        plgpu.set_max_registers(32, action="decrease")

      def load_raw(i):
        j = lax.rem(i, 2)
        with jax.named_scope("load"):
          load(i, nope_ref, raw_smem.at[j], raw_full.at[j])
          load(i, scale_ref, scale_smem.at[j], raw_full.at[j])

      produce(n_steps, 2, raw_free, load_raw)

    @pl.when(wg == 3)
    def _rope_producer():
      if not interpret:
        plgpu.set_max_registers(32, action="decrease")

      @pl.loop(0, n_steps)
      def _(i):
        with jax.named_scope("wait_rope_free"):
          @pl.when(i >= 1)
          def _():
            plgpu.barrier_wait(rope_free)   # block i - 1's scores are done
        with jax.named_scope("load"):
          load(i, rope_ref, rope_smem, rope_full)

      @pl.when(n_steps > 0)
      def _():
        plgpu.barrier_wait(rope_free)

  smem = [
      plgpu.SMEM((N, W), dtype, transforms=tile),                    # q, then the output
      plgpu.SMEM((2, BLOCK_KV, R), FP8_E4M3, transforms=fp8_tile),   # fp8 nope ring
      plgpu.SMEM((2, BLOCK_KV), F32),                                # scale ring
      plgpu.SMEM((BLOCK_KV, Rr), dtype, transforms=tile),            # rope
      plgpu.SMEM((2, BLOCK_KV, R), dtype, transforms=tile),          # converted tiles
      plgpu.SMEM((N, BLOCK_KV), dtype, transforms=tile),             # P (N x 64 tokens)
      plgpu.SMEM((2, N), F32),                   # alpha (then the lse), the running sum
  ]
  barriers = [
      plgpu.Barrier(num_arrivals=1),                                 # q
      plgpu.Barrier(num_arrivals=2 * copies, num_barriers=2),        # nope + scale landed
      plgpu.Barrier(num_arrivals=2, num_barriers=2),                 # ... converted, scale read
      plgpu.Barrier(num_arrivals=copies),                            # rope landed
      plgpu.Barrier(num_arrivals=1),                                 # rope read (scores done)
      plgpu.Barrier(num_arrivals=1, num_barriers=2),                 # tile converted
      plgpu.Barrier(num_arrivals=2, num_barriers=2),                 # tile's values done
      plgpu.Barrier(num_arrivals=1),                                 # P ready (wg 0 -> 1)
      plgpu.Barrier(num_arrivals=1),                                 # P free (wg 1 -> 0)
      plgpu.Barrier(num_arrivals=2),                                 # both compute warpgroups
  ]
  return decode_kernel(body, out_shape=(N, W), rows=N, dtype=dtype, scratch=smem + barriers,
                       splits=splits, B=B, num_threads=4, name="mla_decode_converter",
                       interpret=interpret)
