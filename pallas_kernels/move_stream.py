"""Streamed move path: one launch, programs over (buffer, chunk of items), whole-row copies.

An item is a block of ``item_rows`` consecutive rows (one row for token moves; for page
moves a page is ``page_size // item_rows`` blocks, buffers viewed as blocks by a free
reshape). XLA marks the "endangered" sources (targets of another pair; an all-pairs compare
fused in one kernel for up to ``small_t_compare`` pairs) and a flag "any endangered".
Programs copy whole items (one bulk copy each way) through a ring of shared-memory slots,
loads running ahead of stores.

* None endangered (disjoint sets, the common case): no program can write a byte another
  reads, so every (buffer, chunk) program streams its chunk, all in parallel.
* Some endangered: only the first program of each buffer works, on all items of its
  buffer: it saves the endangered sources to a temporary, waits for those writes, then
  moves every pair (endangered ones from the temporary). It owns the buffer, so this is
  the snapshot for any overlap (swaps, chains, cycles).

Buffers of one row layout share one body: the ring is written once and only the two bulk
copies that touch a buffer pick it (a ``lax.switch`` on the program's buffer number), and
their temporaries are one stacked array. Items must be multiples of 16 bytes (no
one-element rows: the plan hands those to the next path) and all indices must fit shared
memory (``stream_index_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import move_common as mc


@dataclasses.dataclass(frozen=True)
class StreamPlan:
  item_rows: int  # rows per item (a divisor of the unit)
  blocks: int  # items per unit
  chunk: int  # items per program (a multiple of 4)
  chunks: int
  tokens: int  # padded items, chunk * chunks
  slots: int
  lookahead: int


def plan(buffers, num_units: int, unit_rows: int, tiling: mc.MoveTiling) -> StreamPlan | None:
  """Chunking of the streamed path, or None to hand the move to the next path: a token
  move (unless forced with ``path="stream"``), a one-element-row buffer, no block size of whole rows that fits, or more indices than
  ``stream_index_bytes``."""
  if unit_rows == 1 and tiling.path == "auto":
    # Token moves past the direct path's limits go to two-pass: on the H200 (61 layers,
    # plain bf16 rows) 126.6 vs 129.6 us at T=2048 and 229.8 vs 329.8 us at T=4096
    # (benchmarks/results/logs/2026-12-03_sweep_moves_two_pass.log). path="stream" forces it.
    return None
  rows = buffers[0].shape[0]
  row_bytes = [mc.row_bytes(b) for b in buffers]
  slots, lookahead = tiling.stream_slots, tiling.stream_lookahead
  if unit_rows == 1:
    item_rows = 1 if all(r % mc.BULK_ALIGN == 0 for r in row_bytes) else None
  else:
    item_rows = next((r for r in range(unit_rows, 0, -1)
                      if unit_rows % r == 0 and rows % r == 0
                      and max(row_bytes) * r <= tiling.stream_item_bytes
                      and all(r * x % mc.BULK_ALIGN == 0 for x in row_bytes)), None)
    if item_rows is not None:
      slots = max(2, min(slots, tiling.stream_ring_bytes // (max(row_bytes) * item_rows)))
      lookahead = min(lookahead, slots // 2)
  if item_rows is None:
    return None
  blocks = unit_rows // item_rows
  num_items = num_units * blocks
  want = -(-num_items * len(buffers) // tiling.stream_programs)
  chunk = max(tiling.stream_min_chunk, 4, 1 << max(0, want - 1).bit_length())
  chunk = min(chunk, max(4, tiling.stream_max_chunk), -(-num_items // 4) * 4)
  chunk = -(-chunk // 4) * 4
  chunks = -(-num_items // chunk)
  tokens = chunk * chunks
  if 3 * 4 * tokens > tiling.stream_index_bytes:
    return None
  return StreamPlan(item_rows, blocks, chunk, chunks, tokens, slots,
                    min(lookahead, slots - 1))


def move(buffers, tgt, src, splan: StreamPlan, *, pdl: bool, tiling: mc.MoveTiling,
         interpret=None):
  """Moves units ``tgt[i] <- src[i]`` (int32, any values) of every buffer."""
  rows = buffers[0].shape[0]
  units = rows // (splan.item_rows * splan.blocks)
  tgt, src = mc.sanitize(tgt, src, units)
  save = mc.endangered(tgt, src, units, tiling.small_t_compare,
                         tiling.writer_period)
  if splan.blocks > 1:
    tgt, src = mc.expand_units(tgt, src, splan.blocks)
    save = jnp.repeat(save, splan.blocks)
  extra = splan.tokens - tgt.shape[0]
  if extra:
    tgt = jnp.pad(tgt, (0, extra), constant_values=-1)
    src = jnp.pad(src, (0, extra))
    save = jnp.pad(save, (0, extra))
  # "Any source endangered" as 4 partial maxima (one 16-byte load; the kernel ORs them).
  flag = jnp.max(save.reshape(mc.BULK_ALIGN // 4, -1), axis=1)
  views = [b.reshape(rows // splan.item_rows, splan.item_rows * math.prod(b.shape[1:]))
           for b in buffers]
  run = functools.partial(_kernel, splan=splan, pdl=pdl)
  moved = mc.on_platform(functools.partial(mc.in_place, run), views, tgt, src, save, flag,
                         interpret=interpret)
  return tuple(m.reshape(b.shape) for m, b in zip(moved, buffers))


def layout_groups(refs) -> list[list[int]]:
  """Buffer positions grouped by row layout (item shape and dtype), first-seen order."""
  groups: dict[tuple, list[int]] = {}
  for k, r in enumerate(refs):
    groups.setdefault((r.shape[1:], jnp.dtype(r.dtype)), []).append(k)
  return list(groups.values())


def switch(member, refs, fn):
  """``fn(refs[member])`` for a program-uniform traced ``member`` (one branch per ref)."""
  if len(refs) == 1:
    fn(refs[0])
  else:
    jax.lax.switch(member, [functools.partial(fn, r) for r in refs])


def _kernel(refs, tgt, src, save, flag, *, splan: StreamPlan, pdl: bool, interpret):
  chunk, chunks, tokens = splan.chunk, splan.chunks, splan.tokens
  groups = layout_groups(refs)
  firsts = [sum(len(m) for m in groups[:g]) * chunks for g in range(len(groups))]
  # Temporaries (one stacked array per layout) are outputs: the kernel only needs their
  # memory (never read unless written first), so they are dropped right after.
  temp_types = tuple(jax.ShapeDtypeStruct((len(m), tokens, *refs[m[0]].shape[1:]),
                                          refs[m[0]].dtype) for m in groups)

  def body(tgt_gmem, src_gmem, save_gmem, flag_gmem, *rest):
    buffers = rest[:len(refs)]
    temps = rest[len(refs):len(refs) + len(temp_types)]
    tgt_smem, src_smem, save_smem, flag_smem, first_barrier, all_barrier = (
        rest[len(refs) + len(temp_types):])
    if pdl:
      plgpu.griddepcontrol_wait()
    job = jax.lax.axis_index("job")
    part = job % chunks
    first = part * chunk
    # The flag and this program's chunk of indices in one round trip; all indices only when
    # some source is endangered.
    mc.load_indices([(flag_gmem, flag_smem),
                     (tgt_gmem.at[pl.ds(first, chunk)], tgt_smem.at[pl.ds(first, chunk)]),
                     (src_gmem.at[pl.ds(first, chunk)], src_smem.at[pl.ds(first, chunk)]),
                     (save_gmem.at[pl.ds(first, chunk)], save_smem.at[pl.ds(first, chunk)])],
                    first_barrier)
    safe = (flag_smem[0] | flag_smem[1] | flag_smem[2] | flag_smem[3]) != 0

    @pl.when(safe)
    def _():
      mc.load_indices([(tgt_gmem, tgt_smem), (src_gmem, src_smem), (save_gmem, save_smem)],
                      all_barrier)

    for members, temp, start in zip(groups, temps, firsts):
      mine = (job >= start) & (job < start + len(members) * chunks)
      member = jnp.clip((job - start) // chunks, 0, len(members) - 1)
      pl.when(mine)(functools.partial(
          _stream_group, [buffers[k] for k in members], temp, member, tgt_smem, src_smem,
          save_smem, safe, part, splan=splan))

  plgpu.kernel(
      body,
      out_type=temp_types,
      grid=(len(refs) * chunks,),
      grid_names=("job",),
      scratch_types=[plgpu.SMEM((tokens,), jnp.int32), plgpu.SMEM((tokens,), jnp.int32),
                     plgpu.SMEM((tokens,), jnp.int32), plgpu.SMEM((mc.BULK_ALIGN // 4,), jnp.int32),
                     plgpu.Barrier(num_arrivals=4), plgpu.Barrier(num_arrivals=3)],
      compiler_params=mc.compiler_params(),
      interpret=interpret,
  )(tgt, src, save, flag, *refs)


def _stream_group(buffers, temp, member, tgt_smem, src_smem, save_smem, safe, part, *,
                  splan: StreamPlan):
  """Buffer ``buffers[member]`` (one row layout): chunk ``part`` (no source endangered), or
  all chunks in two phases.

  Phase 0 (only when ``safe``): ``temp[member, i] = buffer[src[i]]`` for endangered items,
  then a full wait for those writes. Phase 1: ``buffer[tgt[i]] = temp[member, i] if save[i]
  else buffer[src[i]]``. Rows stream through ``slots`` shared-memory slots; loads run
  ``lookahead`` items ahead of the stores; each iteration commits one store group, so
  waiting until ``slots - lookahead - 1`` groups remain frees the slot being reloaded.
  """
  chunk, chunks, slots, lookahead = splan.chunk, splan.chunks, splan.slots, splan.lookahead
  outstanding = slots - lookahead - 1
  run = jnp.logical_not(safe) | (part == 0)
  saved_rows = temp.at[member]

  def ring(stage, barriers, start, phase):
    moving = phase == 1

    @pl.loop(0, chunk + lookahead)
    def _(step):
      @pl.when(step < chunk)
      def _():
        i = start + step
        slot = step % slots
        saved = save_smem[i] != 0
        plgpu.wait_smem_to_gmem(outstanding, wait_read_only=True)

        @pl.when(saved & moving)
        def _():
          mc.load(saved_rows.at[i], stage.at[slot], barriers.at[slot])

        @pl.when(saved != moving)  # phase 0 and saved, or phase 1 and not saved
        def _():
          row = src_smem[i]
          switch(member, buffers,
                 lambda b: mc.load(b.at[row], stage.at[slot], barriers.at[slot]))

      @pl.when(step >= lookahead)
      def _():
        j = step - lookahead
        i = start + j
        slot = j % slots
        saved = save_smem[i] != 0
        row = tgt_smem[i]

        @pl.when(saved | moving)
        def _():
          plgpu.barrier_wait(barriers.at[slot])

        @pl.when(saved & jnp.logical_not(moving))
        def _():
          plgpu.copy_smem_to_gmem(stage.at[slot], saved_rows.at[i], commit_group=False)

        @pl.when(moving & (row >= 0))
        def _():
          switch(member, buffers, lambda b: plgpu.copy_smem_to_gmem(
              stage.at[slot], b.at[row], commit_group=False))

      plgpu.commit_smem_to_gmem_group()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def scoped(stage, barriers):
    @pl.loop(0, 2)
    def _(phase):
      @pl.when(run & (safe | (phase == 1)))
      def _():
        @pl.loop(0, chunks)
        def _(c):
          @pl.when(jnp.where(safe, True, c == part))
          def _():
            ring(stage, barriers, c * chunk, phase)

        # The saved rows must have landed before phase 1 reads them back. (Phase 1 only
        # waits for its reads of shared memory, at the end of each ring.)
        @pl.when(phase == 0)
        def _():
          plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(scoped, plgpu.SMEM((slots, *buffers[0].shape[1:]), buffers[0].dtype),
                plgpu.Barrier(num_arrivals=1, num_barriers=slots))
