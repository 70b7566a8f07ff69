"""Two-pass move path (two launches per batch of buffers): the fallback that takes every move.

An "endangered" item is a source that some other pair overwrites. Pass 1 saves only the
endangered sources to a temporary; pass 2 moves every pair, reading endangered sources from
the temporary and the others from the cache (which pass 2 never writes, since they are not
targets). With disjoint source and target sets pass 1 moves nothing, so the traffic is one
read and one write per moved byte; in the worst case (every source is a target) two of each.
Programs run over (buffer, chunk of items); an item is a block of ``item_rows`` rows of a
unit (16-byte sized where possible).

Buffers whose item is not a multiple of 16 bytes (one-element rows such as the
per_token_head float32 scale, moved one row at a time) cannot use a bulk copy of one item:
their programs read the aligned 16-byte window holding the row (the buffer's rows must be a
multiple of 4 for float32) and write the single element with a scalar store.

As in the streamed path, buffers of one layout share one body: only the copies that touch
a buffer pick it (``move_stream.switch``), and their temporaries are one stacked array.
Mosaic's lowering time still grows faster than linearly with the buffers of a kernel, so
the passes run on batches of at most ``MoveTiling.two_pass_max_buffers`` buffers; the
batches are near-equal, so they share one traced and lowered kernel per pass (61 plain
layers: 2 batches, 1.8 s of CUDA lowering on a CPU host; 61 per_token_head layers: 6
batches; 76 s for one kernel per pass unrolled per buffer before). Buffers are independent,
so batching keeps the snapshot semantics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import move_common as mc
from pallas_kernels.move_stream import switch


@dataclasses.dataclass(frozen=True)
class TwoPassPlan:
  item_rows: int  # rows per item (a divisor of the unit)
  per_program: int  # items per program (a multiple of 4)


def plan(buffers, num_units: int, unit_rows: int, tiling: mc.MoveTiling) -> TwoPassPlan:
  """Item size and items per program (the two-pass path takes every move)."""
  del num_units
  row_bytes = [mc.row_bytes(b) for b in buffers]
  limit = max(1, tiling.two_pass_smem_bytes // (4 * max(row_bytes)))
  item_rows = next((r for r in range(min(unit_rows, limit), 0, -1)
                    if unit_rows % r == 0 and all(r * x % mc.BULK_ALIGN == 0 for x in row_bytes)),
                   1)  # 1: one-element buffers then take the narrow (window) copies
  item_bytes = max(row_bytes) * item_rows
  per_program = max(4, min(tiling.max_items_per_program,
                           tiling.two_pass_smem_bytes // item_bytes) // 4 * 4)
  return TwoPassPlan(item_rows, per_program)


def move(buffers, tgt, src, tplan: TwoPassPlan, *, unit_rows: int, pdl: bool,
         tiling: mc.MoveTiling, interpret=None):
  """Moves units ``tgt[i] <- src[i]`` (int32, any values) of every buffer: pass 1 saves the
  endangered sources to temporaries, pass 2 moves every pair."""
  rows = buffers[0].shape[0]
  units = rows // unit_rows
  tgt, src = mc.sanitize(tgt, src, units)
  item_rows, per_program = tplan.item_rows, tplan.per_program
  blocks = unit_rows // item_rows
  # Per item (unit j, block s): first source row, first target row (-1: skip), saved?
  save = mc.endangered(tgt, src, units, tiling.small_t_compare,
                         tiling.writer_period)
  item_tgt, item_src = mc.expand_units(tgt, src, blocks)
  item_tgt = jnp.where(item_tgt >= 0, item_tgt * item_rows, -1)
  item_src = item_src * item_rows
  item_save = jnp.repeat(save, blocks)
  extra = -item_src.shape[0] % per_program
  item_src = jnp.pad(item_src, (0, extra))
  item_tgt = jnp.pad(item_tgt, (0, extra), constant_values=-1)
  item_save = jnp.pad(item_save, (0, extra))
  views = [mc.rows_view(b) for b in buffers]
  narrow = tuple(mc.is_narrow(b, item_rows) for b in buffers)
  out = list(buffers)
  for batch in _batches(views, narrow, tiling.two_pass_max_buffers):
    # Equal batches are the same kernels: traced and lowered once (`_passes` is cached).
    groups = _groups([views[k] for k in batch], [narrow[k] for k in batch])
    save_pass, move_pass = _passes(groups, item_src.shape[0], per_program, item_rows, pdl)
    batch_views = [views[k] for k in batch]
    temps = mc.on_platform(save_pass, batch_views, item_src, item_save,
                           interpret=interpret, cuda=save_pass.cuda)
    moved = mc.on_platform(move_pass, [buffers[k] for k in batch], item_src, item_tgt,
                           item_save, temps, interpret=interpret, cuda=move_pass.cuda)
    for k, m in zip(batch, moved):
      out[k] = m
  return tuple(out)


def _batches(views, narrow, max_buffers: int) -> list[list[int]]:
  """Buffer positions per launch: at most ``max_buffers`` buffers (all row layouts
  together), every layout split into the same number of near-equal parts (equal batches
  share their kernels)."""
  groups = _groups(views, narrow)
  count = -(-sum(len(g.members) for g in groups) // max_buffers)
  out = [[] for _ in range(count)]
  for g in groups:
    size, extra = divmod(len(g.members), count)
    start = 0
    for b in range(count):
      end = start + size + (b < extra)
      out[b] += g.members[start:end]
      start = end
  return [batch for batch in out if batch]


@functools.lru_cache(maxsize=64)
def _passes(groups, num_items: int, per_program: int, item_rows: int, pdl: bool):
  """Both passes' functions ``(interpret, ...)`` with their jitted CUDA branches."""
  shape = dict(groups=groups, num_items=num_items, per_program=per_program,
               item_rows=item_rows, pdl=pdl)
  save_pass = functools.partial(_save_endangered, **shape)
  move_pass = functools.partial(mc.in_place, functools.partial(_move_items, **shape))
  save_pass.cuda = jax.jit(functools.partial(save_pass, None))
  move_pass.cuda = jax.jit(functools.partial(move_pass, None))
  return save_pass, move_pass


@dataclasses.dataclass(frozen=True)
class _Group:
  members: tuple[int, ...]  # buffer positions of one layout
  first: int  # first program on the buffer axis
  narrow: bool


def _groups(views, narrow) -> tuple[_Group, ...]:
  by_layout: dict[tuple, list[int]] = {}
  for k, (v, n) in enumerate(zip(views, narrow)):
    by_layout.setdefault((v.shape[1:], jnp.dtype(v.dtype), n), []).append(k)
  out, first = [], 0
  for (_, _, n), members in by_layout.items():
    out.append(_Group(tuple(members), first, n))
    first += len(members)
  return tuple(out)


def _temp_type(view, group: _Group, num_items: int, item_rows: int):
  if group.narrow:
    return jax.ShapeDtypeStruct((len(group.members), num_items, mc.window(view.dtype)),
                                view.dtype)
  return jax.ShapeDtypeStruct((len(group.members), num_items * item_rows, *view.shape[1:]),
                              view.dtype)


def _stage_type(view, narrow: bool, per_program: int, item_rows: int):
  if narrow:
    return plgpu.SMEM((per_program, mc.window(view.dtype)), view.dtype)
  return plgpu.SMEM((per_program, item_rows, *view.shape[1:]), view.dtype)


def _source(view, narrow: bool, row, item_rows: int):
  """The GMEM slice holding source ``row`` (its window, for a narrow buffer)."""
  if narrow:
    size = mc.window(view.dtype)
    return view.at[pl.ds(mc.window_start(row, size), size)]
  return view.at[pl.ds(row, item_rows)]


def _saved_slot(temp, member, item, narrow: bool, item_rows: int):
  return temp.at[member, item] if narrow else temp.at[member, pl.ds(item * item_rows, item_rows)]


def _for_groups(groups, refs, fn):
  """``fn(group, member, group_refs)`` in the program of each group (buffer axis)."""
  buffer_index = jax.lax.axis_index("buffer")
  for g in groups:
    mine = (buffer_index >= g.first) & (buffer_index < g.first + len(g.members))
    member = jnp.clip(buffer_index - g.first, 0, len(g.members) - 1)
    pl.when(mine)(functools.partial(fn, g, member, [refs[k] for k in g.members]))


def _chunk_start(pdl: bool, per_program: int, indices, barrier):
  """The start of a program of either pass: wait for the previous launch (PDL), load the
  program's chunk of each index array into shared memory. Returns the chunk's first item.

  indices: (gmem, smem) pairs, one per index array of the pass.
  """
  if pdl:
    plgpu.griddepcontrol_wait()
  chunk = jax.lax.axis_index("chunk")
  first = chunk * per_program
  mc.load_indices([(gmem.at[pl.ds(first, per_program)], smem) for gmem, smem in indices],
                  barrier)
  return first


def _through_stage(per_program: int, stage_type, load, store) -> None:
  """A program's items through shared memory, one slot and barrier each: ``load(i, slot,
  barrier)`` for every item (it issues item i's copy, or nothing), then ``store(i, stage,
  barrier)`` for every item (it waits for the copy and stores it, or nothing); returns once
  the stores have read shared memory. Both passes run their items this way."""

  def scoped(stage, barriers):
    @pl.loop(0, per_program)
    def _(i):
      load(i, stage.at[i], barriers.at[i])

    @pl.loop(0, per_program)
    def _(i):
      store(i, stage, barriers.at[i])

    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scoped, stage_type, plgpu.Barrier(num_arrivals=1, num_barriers=per_program))


def _save_endangered(interpret, views, item_src, item_save, *, groups, num_items,
                     per_program, item_rows, pdl):
  """Pass 1: ``temp[item] = view[item_src[item]]`` for the items marked in ``item_save``."""
  chunks = num_items // per_program

  def body(src_gmem, save_gmem, *rest):
    sources, temps = rest[:len(views)], rest[len(views):len(views) + len(groups)]
    src_smem, save_smem, index_barrier = rest[len(views) + len(groups):]
    first = _chunk_start(pdl, per_program, [(src_gmem, src_smem), (save_gmem, save_smem)],
                         index_barrier)
    temp_of = dict(zip(groups, temps))

    def group_body(g, member, group_sources):
      temp, n = temp_of[g], g.narrow

      def load(i, slot, barrier):
        @pl.when(save_smem[i] != 0)
        def _():
          row = src_smem[i]
          switch(member, group_sources, lambda v: mc.load(
              _source(v, n, row, item_rows), slot, barrier))

      def store(i, stage, barrier):
        @pl.when(save_smem[i] != 0)
        def _():
          plgpu.barrier_wait(barrier)
          plgpu.copy_smem_to_gmem(
              stage.at[i], _saved_slot(temp, member, first + i, n, item_rows),
              commit_group=False)

      _through_stage(per_program, _stage_type(group_sources[0], n, per_program, item_rows),
                     load, store)

    _for_groups(groups, sources, group_body)

  return plgpu.kernel(
      body,
      out_type=tuple(_temp_type(views[g.members[0]], g, num_items, item_rows)
                     for g in groups),
      grid=(len(views), chunks),
      grid_names=("buffer", "chunk"),
      scratch_types=[plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=mc.compiler_params(),
      interpret=interpret,
  )(item_src, item_save, *views)


def _move_items(refs, item_src, item_tgt, item_save, temps, *, groups, num_items,
                per_program, item_rows, pdl, interpret):
  """Pass 2: ``ref[item_tgt] = temp[item] if item_save else ref[item_src]`` for every item."""
  chunks = num_items // per_program

  def body(src_gmem, tgt_gmem, save_gmem, *rest):
    saved = rest[:len(groups)]
    buffers = rest[len(groups):len(groups) + len(refs)]
    src_smem, tgt_smem, save_smem, index_barrier = rest[len(groups) + len(refs):]
    first = _chunk_start(pdl, per_program, [(src_gmem, src_smem), (tgt_gmem, tgt_smem),
                                            (save_gmem, save_smem)], index_barrier)
    temp_of = dict(zip(groups, saved))

    def group_body(g, member, group_buffers):
      temp, n = temp_of[g], g.narrow

      def load(i, slot, barrier):
        moved = tgt_smem[i] >= 0
        from_temp = save_smem[i] != 0

        @pl.when(moved & from_temp)
        def _():
          mc.load(_saved_slot(temp, member, first + i, n, item_rows), slot, barrier)

        @pl.when(moved & jnp.logical_not(from_temp))
        def _():
          row = src_smem[i]
          switch(member, group_buffers, lambda b: mc.load(
              _source(b, n, row, item_rows), slot, barrier))

      def store(i, stage, barrier):
        row = tgt_smem[i]

        @pl.when(row >= 0)
        def _():
          plgpu.barrier_wait(barrier)
          if n:
            source = src_smem[i]
            value = stage[i, source - mc.window_start(source, mc.window(stage.dtype))]

            def put(b):
              b[row] = value
          else:
            def put(b):
              plgpu.copy_smem_to_gmem(stage.at[i], b.at[pl.ds(row, item_rows)],
                                      commit_group=False)
          switch(member, group_buffers, put)

      _through_stage(per_program, _stage_type(group_buffers[0], n, per_program, item_rows),
                     load, store)

    _for_groups(groups, buffers, group_body)

  plgpu.kernel(
      body,
      out_type=(),
      grid=(len(refs), chunks),
      grid_names=("buffer", "chunk"),
      scratch_types=[plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.Barrier(num_arrivals=3)],
      compiler_params=mc.compiler_params(),
      interpret=interpret,
  )(item_src, item_tgt, item_save, *temps, *refs)
