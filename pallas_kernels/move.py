"""Mosaic GPU kernels that move token rows and pages of every cache buffer, in place.

Plain-JAX equivalent of both operations (snapshot semantics: every read happens before any
write; pairs with an index outside ``[0, rows)`` are skipped)::

    def move_rows_reference(buffers, tgt_loc, src_loc):
      keep = (0 <= tgt_loc) & (tgt_loc < rows) & (0 <= src_loc) & (src_loc < rows)
      return tuple(b.at[jnp.where(keep, tgt_loc, rows)].set(b[jnp.where(keep, src_loc, 0)],
                                                            mode="drop") for b in buffers)

``move_pages`` is the same with whole pages (``page_size`` consecutive rows) as the unit.

Design (one Mosaic GPU program never races another because each owns distinct bytes):

* Token moves, direct path (the default up to ``MoveTiling.direct_max_tokens`` = 1024 on the
  GPU; one launch, no XLA work before it): programs run over (buffer, column band); a band
  is the same few 16-byte items of every row (the whole element for one-element rows).
  The program's 128 threads load their items of all T source rows into registers, meet at
  a barrier (``bar.sync``: every load of the program is performed), then store them to the
  T target rows, skipping pairs with an index out of range. No other program touches those
  bytes, so this is the snapshot for any overlap. The code is written at the thread level
  (``inline_mgpu``) and picks each program's buffer address with selects or uniform
  branches, so it exists once per row layout: 61 layers lower in a fraction of a second.
  Interpret mode has no thread-level code and runs the streamed path below instead (same
  results). When T items do not fit the registers the direct path can run in rounds
  (``MoveTiling.direct_rounds``; the default up to T=16384 for buffer sets with one-element
  rows): XLA computes "any source is another pair's target"; if none is, each round loads
  then stores; otherwise each program first copies its band of all sources to a
  temporary, meets at a barrier, then copies the temporary to the targets.
* Token moves, streamed path (the default above that for plain rows, up to T ~ 4096; one
  launch): XLA marks the "endangered" sources (targets of another pair; an O(T^2) compare
  fused in one kernel for T <= 1024) and a flag "any endangered". Programs run over
  (buffer, chunk of tokens) and copy whole rows (one bulk copy per row each way) through a
  ring of shared-memory slots, loads running ahead of stores. With no endangered source
  (disjoint sets) no program can write a byte another reads, so all chunks run in parallel.
  Otherwise only the first program of each buffer works, on all T tokens of its buffer: it
  saves the endangered sources to a temporary, waits for those writes, then moves every
  pair; it owns the buffer, so this is the snapshot for any overlap. One-element rows (the
  per_token_head scale) get one program per buffer: on the GPU its threads hold all T elements in
  registers, as the direct path; in interpret mode it reads every 16-byte window before any
  scalar store.
  Page moves use the same path on buffers viewed as blocks of whole rows (a free reshape).
  The staged and two-pass paths below remain (``MoveTiling.token_path``) and are the
  fallback when the indices do not fit shared memory.
* Token moves, staged path (one launch): the grid runs over (buffer, column band). A band is
  a contiguous byte range of a row, a multiple of 16 bytes. Its program copies the band of all
  T source rows into shared memory (one ``cp.async.bulk`` per row, all arriving on one
  barrier), waits, then writes the T target rows. No other program touches those bytes, so
  this is the snapshot. Bands are as wide as shared memory allows for T rows (and narrow
  enough to give the GPU enough programs); when T rows of the narrowest band
  (``MoveTiling.min_band_bytes``) do not fit, the two-pass path below runs instead.
* Two-pass path (two launches; every page move, large-T token moves): an "endangered" item
  is a source that some other pair overwrites. Pass 1 saves only endangered sources to a
  temporary; pass 2 moves every pair, reading endangered sources from the temporary and the
  others from the cache (which pass 2 never writes, since they are not targets). With
  disjoint source and target sets pass 1 moves nothing, so the traffic is one read and one
  write per moved byte; in the worst case (every source is a target) it is two of each.
* Buffers whose row is not a multiple of 16 bytes (the per_token_head float32 scale, 4 bytes
  a row) cannot use bulk copies of one row: their program reads the aligned 16-byte window
  holding the row (a bulk copy; the buffer's rows must be a multiple of 4) and writes the
  single element with a scalar store from shared memory. In page moves a block of rows of
  such a buffer is a multiple of 16 bytes and uses bulk copies like the others.

Buffers enter the kernels as refs (``jax.new_ref`` / ``jax.freeze``), so the kernels alias
them: under a donating ``jit`` no buffer is copied. On CPU the same kernels run in Mosaic GPU
interpret mode; the choice is made per lowering platform (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, exact

_BULK_ALIGN = 16  # cp.async.bulk and TMA need 16-byte sizes, addresses and strides.


@dataclasses.dataclass(frozen=True)
class MoveTiling:
  """Tile sizes of the move kernels (static; change them only to tune).

  Attributes:
    staged_smem_bytes: shared memory a staged program may use for its T rows of one band.
    min_band_bytes: the narrowest band the staged path uses; below it, two-pass runs.
    min_programs: the staged path narrows bands until the grid has this many programs.
    two_pass_smem_bytes: shared memory of one two-pass program (its items of one buffer).
    max_items_per_program: cap on the items one two-pass program moves.
    token_path: "auto" (direct up to ``direct_max_tokens``, then streamed when the indices
      fit, else two-pass), "direct", "stream", "staged" (falls back to two-pass when bands
      do not fit) or "two_pass".
    stream_programs: streamed path: target number of (wide buffer, token chunk) programs.
    stream_max_chunk, stream_min_chunk: bounds of a streamed program's token chunk.
    stream_slots, stream_lookahead: the streamed ring: shared-memory row slots, and how
      many row loads run ahead of the stores (``< stream_slots``).
    stream_index_bytes: shared memory for all T indices (tgt, src, save); above it, two-pass.
    stream_item_bytes: page moves on the streamed path copy blocks of whole rows of at most
      this many bytes (one bulk copy each).
    stream_ring_bytes: page moves: cap on a program's ring (slots x block bytes).
    small_t_compare: up to this T, endangered sources come from an O(T^2) compare
      (one fused XLA kernel) instead of writer counts.
    stream_narrow_first: streamed path: give the one-element-row programs (per_token_head
      scales) the first program ids, so they start in the first wave rather than after
      the wide programs (untimed variant, off by default until the H200 measures it).
    direct_max_tokens: "auto": up to this T, token moves take the direct path (GPU only;
      interpret mode runs the streamed path instead).
    direct_items_per_thread: direct path: the most 16-byte items one thread holds in
      registers (sets how many tokens a program covers per column band).
    direct_programs: direct path: bands widen (fewer, larger programs) while the grid
      has more programs than this.
    direct_rounds: direct path: when T items do not fit the registers, move them in rounds
      (XLA computes "any source endangered"; if so, each program first copies its band of
      the sources to a temporary, which costs a second read and write). None ("auto"):
      only for buffer sets with one-element rows (per_token_head), where "auto" then takes
      the direct path up to ``direct_rounds_max_tokens`` (H200, 61 layers, T=4096: 179 us
      disjoint / 327 us swaps vs the streamed path's 463 us; for plain rows the streamed
      path is faster: 215 vs 271 us). True: for every buffer set; False: never.
    direct_rounds_max_tokens: with rounds on, "auto" takes the direct path up to this T
      (the temporary holds T rows of every buffer), beyond it two-pass. H200, 61
      per_token_head layers: rounds 355 / 732 us at T=8192 / 16384 (643 / 1278 us when
      every source is a target) where two-pass took 2268 us at T=8192; plain rows stay on
      two-pass there (483 us at T=8192 vs 547 in rounds).
    direct_select: direct path: how a program picks its buffer's base address among the
      buffers of its row layout: "chain" (a select per buffer: every thread reads every
      address), "tree" (branches on the program-uniform buffer number, one address read),
      or "auto": tree when the buffers have several row layouts (H200, 61 per_token_head
      layers, T=8/64: 1.99/2.56 us vs 4.17/4.34 with the chain), else chain.
  """

  staged_smem_bytes: int = 160 * 1024
  min_band_bytes: int = 128
  min_programs: int = 2 * 132
  two_pass_smem_bytes: int = 64 * 1024
  max_items_per_program: int = 32
  token_path: str = "auto"
  stream_programs: int = 1024
  stream_max_chunk: int = 256
  stream_min_chunk: int = 8
  stream_slots: int = 16
  stream_lookahead: int = 8
  stream_index_bytes: int = 48 * 1024
  stream_item_bytes: int = 8 * 1024
  stream_ring_bytes: int = 72 * 1024
  small_t_compare: int = 1024
  stream_narrow_first: bool = False
  direct_max_tokens: int = 1024
  direct_items_per_thread: int = 32
  direct_programs: int = 1024
  direct_rounds: bool | None = None
  direct_rounds_max_tokens: int = 16384
  direct_select: str = "auto"


DEFAULT_TILING = MoveTiling()


# ----------------------------------------------------------------------------------------
# Public functions


def move_rows(
    buffers: Sequence[jax.Array],
    tgt_loc: jax.Array,
    src_loc: jax.Array,
    *,
    pdl: bool = False,
    tiling: MoveTiling = DEFAULT_TILING,
) -> tuple[jax.Array, ...]:
  """For every buffer ``b``: ``b[tgt_loc[i]] = old_b[src_loc[i]]``, all reads before any write.

  Args:
    buffers: arrays sharing the leading ``rows`` dimension, e.g. 61 x ``(rows, 1, 576)``
      bfloat16, or per layer ``(rows, 1, 512)`` float8_e4m3fn, ``(rows, 1, 1)`` float32 and
      ``(rows, 1, 64)`` bfloat16. A row must be a multiple of 16 bytes or a single element.
    tgt_loc, src_loc: ``(T,)`` integer row indices. Pairs with either index outside
      ``[0, rows)`` are skipped. ``T == 0`` returns the buffers unchanged.
    pdl: launch with programmatic dependent launch (waits on the previous kernel in-kernel).
    tiling: tile sizes.

  Returns:
    The updated buffers, same shapes and dtypes; they alias the inputs (donate them).
  """
  buffers = _check_buffers(buffers)
  tgt, src = _check_indices(tgt_loc, src_loc, "tgt_loc", "src_loc")
  path = tiling.token_path
  if path not in ("auto", "direct", "stream", "staged", "two_pass"):
    raise ValueError(
        f"tiling.token_path: expected auto/direct/stream/staged/two_pass, got {path!r}")
  if tiling.direct_select not in ("auto", "chain", "tree"):
    raise ValueError(
        f"tiling.direct_select: expected auto/chain/tree, got {tiling.direct_select!r}")
  if tgt.shape[0] == 0 or not buffers:
    return buffers
  rows = buffers[0].shape[0]
  rounds = tiling.direct_rounds
  if rounds is None:  # auto: rounds pay off where the streamed path is slow
    rounds = any(_row_bytes(b) % _BULK_ALIGN for b in buffers)
  direct = tgt.shape[0] <= tiling.direct_max_tokens or (
      rounds and tgt.shape[0] <= tiling.direct_rounds_max_tokens)
  if path == "direct" or path == "auto" and direct:
    dplan = _direct_plan(buffers, tgt.shape[0],
                         dataclasses.replace(tiling, direct_rounds=rounds))
    if dplan is not None:
      return _direct(buffers, tgt, src, dplan=dplan, pdl=pdl, tiling=tiling)
  tgt, src = _sanitize(tgt, src, rows)
  if path in ("auto", "direct", "stream"):
    splan = _stream_plan(buffers, tgt.shape[0], tiling)
    if splan is not None:
      return _stream(buffers, tgt, src, splan=splan, pdl=pdl, tiling=tiling)
  plan = _staged_plan(buffers, tgt.shape[0], tiling) if path == "staged" else None
  if plan is not None:
    count = plan[-1].first_job + plan[-1].num_bands
    tgt, src = _pad(tgt, src, _BULK_ALIGN // 4)
    run = functools.partial(_staged_move, plan=plan, num_jobs=count, pdl=pdl)
    return _on_platform(
        functools.partial(_in_place, run),
        buffers, tgt, src)
  return _two_pass(buffers, tgt, src, unit_rows=1, pdl=pdl, tiling=tiling)


def move_pages(
    buffers: Sequence[jax.Array],
    tgt_pages: jax.Array,
    src_pages: jax.Array,
    *,
    page_size: int,
    pdl: bool = False,
    tiling: MoveTiling = DEFAULT_TILING,
) -> tuple[jax.Array, ...]:
  """Moves whole pages: rows ``[p*page_size, (p+1)*page_size)`` of every buffer.

  For every buffer ``b`` and pair ``i``: page ``tgt_pages[i]`` gets the old contents of page
  ``src_pages[i]``; all reads happen before any write. Pairs with a page outside
  ``[0, rows // page_size)`` are skipped. Arguments as :func:`move_rows`.
  """
  buffers = _check_buffers(buffers)
  tgt, src = _check_indices(tgt_pages, src_pages, "tgt_pages", "src_pages")
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
  if tgt.shape[0] == 0 or not buffers:
    return buffers
  num_pages = buffers[0].shape[0] // page_size
  tgt, src = _sanitize(tgt, src, num_pages)
  if tiling.token_path in ("auto", "stream"):
    moved = _stream_pages(buffers, tgt, src, page_size=page_size, pdl=pdl, tiling=tiling)
    if moved is not None:
      return moved
  return _two_pass(buffers, tgt, src, unit_rows=page_size, pdl=pdl, tiling=tiling)


# ----------------------------------------------------------------------------------------
# Checks and index preparation (plain XLA on T indices)


def _check_buffers(buffers: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  buffers = tuple(buffers)
  if not buffers:
    return buffers
  rows = buffers[0].shape[0] if buffers[0].ndim else None
  for i, b in enumerate(buffers):
    if b.ndim < 1 or b.shape[0] != rows:
      raise ValueError(
          f"buffers[{i}]: expected shape (rows={rows}, ...), got {b.shape}")
    width = math.prod(b.shape[1:])
    row_bytes = width * b.dtype.itemsize
    if row_bytes % _BULK_ALIGN and width != 1:
      raise common.Unsupported(
          f"buffers[{i}]: expected a row of a multiple of {_BULK_ALIGN} bytes or of one "
          f"element, got shape {b.shape} of {b.dtype} ({row_bytes} bytes a row)")
    if width == 1 and rows % _window(b.dtype):
      raise common.Unsupported(
          f"buffers[{i}]: a one-element-row buffer needs a multiple of "
          f"{_window(b.dtype)} rows (16-byte windows), got {rows}")
  return buffers


def _check_indices(tgt, src, tgt_name: str, src_name: str):
  """Both index arrays as int32 (`exact.index_to_int32`: a 64-bit index outside int32's
  range becomes -1, never a wrapped row)."""
  checked = []
  for name, x in ((tgt_name, tgt), (src_name, src)):
    if not hasattr(x, "dtype"):
      x = jnp.asarray(x)
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(
          f"{name}: expected a 1-D integer array, got shape {x.shape} of {x.dtype}")
    checked.append(jnp.asarray(exact.index_to_int32(x)))
  tgt, src = checked
  if tgt.shape != src.shape:
    raise ValueError(
        f"{tgt_name} and {src_name}: expected the same length, got {tgt.shape[0]} and "
        f"{src.shape[0]}")
  return tgt, src


def _sanitize(tgt, src, limit: int):
  """int32 indices: skipped pairs get ``tgt = -1`` and ``src = 0`` (a harmless row)."""
  keep = (tgt >= 0) & (tgt < limit) & (src >= 0) & (src < limit)
  return jnp.where(keep, tgt, -1), jnp.where(keep, src, 0)


def _pad(tgt, src, multiple: int):
  extra = -tgt.shape[0] % multiple
  if not extra:
    return tgt, src
  return (jnp.pad(tgt, (0, extra), constant_values=-1),
          jnp.pad(src, (0, extra), constant_values=0))


def _endangered(tgt, src, units: int, small_t_compare: int = 0):
  """``save[j]``: some other kept pair writes unit ``src[j]``, so it must be read first.

  ``tgt``/``src`` are sanitized (skipped pairs: ``tgt = -1``, ``src = 0``); ``units`` is the
  number of rows (or pages). Up to ``small_t_compare`` pairs an all-pairs compare (one
  fused XLA reduction); beyond, a count of writers per unit (a scatter-add into ``units``
  int32 counters, then a gather), O(T) work where a sort and binary searches cost ~100 us
  at T=4096 on the H200.
  """
  n = tgt.shape[0]
  if n <= small_t_compare:
    other = jnp.arange(n)[:, None] != jnp.arange(n)[None, :]
    hit = jnp.any((src[:, None] == tgt[None, :]) & other, axis=1)
    return (hit & (tgt >= 0)).astype(jnp.int32)
  writers = jnp.zeros((units + 1,), jnp.int32).at[jnp.where(tgt >= 0, tgt, units)].add(
      1, mode="promise_in_bounds")
  others = writers[src] - (tgt == src).astype(jnp.int32)
  return ((others > 0) & (tgt >= 0)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# Platform dispatch and refs


def _on_platform(fn: Callable, *args):
  """Calls ``fn(interpret, *args)`` (arrays in, arrays out) through ``common.dispatch``.

  ``interpret`` is None for the real CUDA kernel, else interpret-mode parameters.
  """
  return common.dispatch(
      lambda interpret: functools.partial(
          fn, common.interpret_params() if interpret else None), *args)


def _in_place(run: Callable, interpret, buffers, *args):
  """Runs ``run(refs, *args, interpret=...)`` on refs to kernel views of ``buffers``.

  Returns the buffers, frozen and in their own shapes (the kernel aliases them).
  """
  refs = [jax.new_ref(_rows_view(b)) for b in buffers]
  run(refs, *args, interpret=interpret)
  return tuple(jax.freeze(r).reshape(b.shape) for r, b in zip(refs, buffers))


def _row_bytes(buffer) -> int:
  return math.prod(buffer.shape[1:]) * buffer.dtype.itemsize


def _rows_view(buffer):
  """Kernel view of a buffer: 2-D ``(rows, width)``, or 1-D for one-element rows.

  TMA needs every stride but the last to be a multiple of 16 bytes, which ``(rows, 1)``
  float32 is not.
  """
  rows = buffer.shape[0]
  return buffer.reshape(rows) if math.prod(buffer.shape[1:]) == 1 else buffer.reshape(rows, -1)


def _is_narrow(buffer, rows_per_item: int) -> bool:
  """Whether an item of ``rows_per_item`` rows is too small for a bulk copy."""
  row_bytes = _row_bytes(buffer)
  return (rows_per_item * row_bytes) % _BULK_ALIGN != 0


def _window(dtype) -> int:
  """Elements in the 16-byte TMA window read around a narrow row."""
  return _BULK_ALIGN // jnp.dtype(dtype).itemsize


def _window_start(row, window: int):
  """First element of the 16-byte-aligned window holding ``row`` (the buffer's rows are a
  multiple of ``window``, checked in :func:`_check_buffers`).

  An aligned window is a plain 16-byte bulk copy. (A TMA tensor-map box at an unaligned
  start would need a 128-byte-aligned shared destination per row: compute-sanitizer
  flagged the 16-byte-strided slots the first version used.)
  """
  return pl.multiple_of(row - row % window, window)


def _compiler_params():
  return plgpu.CompilerParams()


# ----------------------------------------------------------------------------------------
# Staged token moves: one launch, programs over (buffer, band)


@dataclasses.dataclass(frozen=True)
class _BufferBands:
  first_job: int
  num_bands: int
  band: int  # elements per band; for a narrow buffer, the window
  narrow: bool


def _staged_plan(buffers, num_tokens: int, tiling: MoveTiling):
  """Band widths per buffer, or None when T rows of a band cannot stay in shared memory."""
  tokens = num_tokens + (-num_tokens % (_BULK_ALIGN // 4))
  index_bytes = 2 * 4 * tokens
  budget = tiling.staged_smem_bytes - index_bytes
  widths = []
  for b in buffers:
    width = math.prod(b.shape[1:])
    itemsize = b.dtype.itemsize
    if width == 1 and itemsize < _BULK_ALIGN:
      if tokens * _BULK_ALIGN > budget:
        return None
      widths.append(None)
      continue
    # Band candidates: 16-byte multiples dividing the row, widest first.
    candidates = [d for d in range(width, 0, -1)
                  if width % d == 0 and (d * itemsize) % _BULK_ALIGN == 0
                  and tokens * d * itemsize <= budget
                  and d * itemsize >= min(tiling.min_band_bytes, width * itemsize)]
    if not candidates:
      return None
    widths.append(candidates)
  # Narrow the bands (widest buffers first) until the grid is large enough.
  choice = [0 if c is not None else None for c in widths]

  def count():
    return sum(1 if c is None else math.prod(b.shape[1:]) // c[i]
               for b, c, i in zip(buffers, widths, choice))

  while count() < tiling.min_programs:
    best = None
    for k, c in enumerate(widths):
      if c is not None and choice[k] + 1 < len(c):
        if best is None or c[choice[k]] * buffers[k].dtype.itemsize > (
            widths[best][choice[best]] * buffers[best].dtype.itemsize):
          best = k
    if best is None:
      break
    choice[best] += 1
  plan, first = [], 0
  for b, c, i in zip(buffers, widths, choice):
    if c is None:
      plan.append(_BufferBands(first, 1, _window(b.dtype), narrow=True))
      first += 1
    else:
      num = math.prod(b.shape[1:]) // c[i]
      plan.append(_BufferBands(first, num, c[i], narrow=False))
      first += num
  return tuple(plan)


def _staged_move(refs, tgt, src, *, plan, num_jobs, pdl, interpret):
  tokens = tgt.shape[0]

  def body(tgt_gmem, src_gmem, *rest):
    buffers = rest[:len(refs)]
    tgt_smem, src_smem, index_barrier = rest[len(refs):]
    if pdl:
      plgpu.griddepcontrol_wait()
    _load_indices([(tgt_gmem, tgt_smem), (src_gmem, src_smem)], index_barrier)
    job = jax.lax.axis_index("job")
    for buffer, bands in zip(buffers, plan):
      mine = (job >= bands.first_job) & (job < bands.first_job + bands.num_bands)
      if bands.narrow:
        pl.when(mine)(functools.partial(
            _move_narrow_rows, buffer, tgt_smem, src_smem, tokens, bands.band,
            interpret=interpret))
      else:
        pl.when(mine)(functools.partial(
            _move_band_rows, buffer, tgt_smem, src_smem, tokens,
            (job - bands.first_job) * bands.band, bands.band))

  plgpu.kernel(
      body,
      out_type=(),
      grid=(num_jobs,),
      grid_names=("job",),
      scratch_types=[plgpu.SMEM((tokens,), jnp.int32), plgpu.SMEM((tokens,), jnp.int32),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=_compiler_params(),
      interpret=interpret,
  )(tgt, src, *refs)


def _move_band_rows(buffer, tgt_smem, src_smem, tokens, column, band):
  """Moves ``buffer[:, column:column+band]`` of all token pairs, through shared memory."""

  def scoped(stage, barrier):
    @pl.loop(0, tokens)
    def _load_row(i):
      _load(buffer.at[src_smem[i], pl.ds(column, band)], stage.at[i], barrier)

    plgpu.barrier_wait(barrier)

    @pl.loop(0, tokens)
    def _store_row(i):
      row = tgt_smem[i]

      @pl.when(row >= 0)
      def _():
        plgpu.copy_smem_to_gmem(stage.at[i], buffer.at[row, pl.ds(column, band)],
                                commit_group=False)

    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scoped, plgpu.SMEM((tokens, band), buffer.dtype),
                plgpu.Barrier(num_arrivals=tokens))


def _move_narrow_rows(buffer, tgt_smem, src_smem, tokens, window, *, interpret):
  """Moves one-element rows: aligned 16-byte windows in, then the single elements out.

  Every source window is loaded (one bulk copy each, all in flight together) before any
  store, so this program's reads are a snapshot. On the GPU the 128 threads of the program
  then store one element each per step (:func:`_scatter_elements`); interpret mode has no
  thread-level code and stores the elements one after another.
  """

  def scoped(stage, barrier):
    @pl.loop(0, tokens)
    def _load_row(i):
      start = _window_start(src_smem[i], window)
      _load(buffer.at[pl.ds(start, window)], stage.at[i], barrier)

    plgpu.barrier_wait(barrier)
    if interpret is None:
      _scatter_elements(buffer, stage, tgt_smem, src_smem, tokens, window)
      return

    @pl.loop(0, tokens)
    def _store_row(i):
      row = tgt_smem[i]
      source = src_smem[i]

      @pl.when(row >= 0)
      def _():
        buffer[row] = stage[i, source - _window_start(source, window)]

  pl.run_scoped(scoped, plgpu.SMEM((tokens, window), buffer.dtype),
                plgpu.Barrier(num_arrivals=tokens))


_WARPGROUP = 128


def _scatter_elements(buffer, stage, tgt_smem, src_smem, tokens: int, window: int):
  """``buffer[tgt[i]] = stage[i, src[i] % window]`` for every ``tgt[i] >= 0``.

  Thread-level Mosaic GPU code: thread ``l`` of the warpgroup handles items ``l, l + 128,
  ...``, so 128 scalar stores are in flight per step (a Pallas scalar store is one at a
  time for the whole program: ~0.35 us each, measured at T=4096 on the H200).
  """
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)
  def scatter(_, buf, stage_ref, tgt_ref, src_ref):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    c32 = lambda v: mgpu_utils.c(v, i32)
    lane = arith.remui(mgpu_utils.thread_idx(), c32(_WARPGROUP))
    steps = -(-tokens // _WARPGROUP)
    loop = scf.ForOp(mgpu_utils.c(0, index), mgpu_utils.c(steps, index),
                     mgpu_utils.c(1, index))
    with ir.InsertionPoint(loop.body):
      step = arith.index_cast(i32, loop.induction_variable)
      item = arith.addi(arith.muli(step, c32(_WARPGROUP)), lane)
      in_range = arith.cmpi(arith.CmpIPredicate.slt, item, c32(tokens))
      if_item = scf.IfOp(in_range)
      with ir.InsertionPoint(if_item.then_block):
        at = arith.index_cast(index, item)
        row = memref.load(tgt_ref, [at])
        if_row = scf.IfOp(arith.cmpi(arith.CmpIPredicate.sge, row, c32(0)))
        with ir.InsertionPoint(if_row.then_block):
          offset = arith.andi(memref.load(src_ref, [at]), c32(window - 1))
          value = memref.load(stage_ref, [at, arith.index_cast(index, offset)])
          memref.store(value, buf, [arith.index_cast(index, row)])
          scf.yield_([])
        scf.yield_([])
      scf.yield_([])

  scatter(buffer, stage, tgt_smem, src_smem)


# ----------------------------------------------------------------------------------------
# Direct token moves (GPU): one launch, programs over (buffer, column band), no preparation


@dataclasses.dataclass(frozen=True)
class _DirectGroup:
  """Buffers of one row layout, moved by the same code (only the base address differs)."""
  members: tuple[int, ...]  # buffer positions
  first: int  # first program
  bands: int  # programs per member
  row_bytes: int
  item_bytes: int  # 16, or the element size of a one-element row
  band: int  # items of a row per program (a power of two)
  steps: int  # items per thread (per round)
  rounds: int = 1  # > 1: T is moved in rounds (needs the "any endangered" flag)


@dataclasses.dataclass(frozen=True)
class _DirectPlan:
  tokens: int
  rows: int
  groups: tuple[_DirectGroup, ...]
  programs: int
  select: str = "chain"  # how a program finds its buffer's address: "chain" or "tree"

  @property
  def in_rounds(self) -> bool:
    return any(g.rounds > 1 for g in self.groups)


def _direct_plan(buffers, num_tokens: int, tiling: MoveTiling):
  """Column bands per row layout, or None when T rows do not fit the threads' registers
  (and ``tiling.direct_rounds`` is off)."""
  layouts: dict[tuple[int, int], list[int]] = {}
  for k, b in enumerate(buffers):
    row_bytes = _row_bytes(b)
    item = b.dtype.itemsize if row_bytes % _BULK_ALIGN else _BULK_ALIGN
    layouts.setdefault((row_bytes, item), []).append(k)
  total = sum(_row_bytes(b) for b in buffers)
  limit = tiling.direct_items_per_thread
  groups, first = [], 0
  for (row_bytes, item), members in layouts.items():
    cols = row_bytes // item
    steps = lambda band: -(-num_tokens * band // _WARPGROUP)
    widest = 1
    while widest * 2 <= min(cols, 32) and steps(widest * 2) <= limit:
      widest *= 2
    if steps(widest) > limit and not tiling.direct_rounds:
      return None
    if tiling.direct_rounds and steps(min(2, cols)) > limit:
      # Rounds of ``limit`` items per thread, 32-byte sectors per row and warp (one
      # 16-byte item per lane and row writes half sectors: 704 us at T=4096 on the H200).
      band = min(2, cols)
      bands = -(-cols // band)
      groups.append(_DirectGroup(tuple(members), first, bands, row_bytes, item, band,
                                 limit, -(-steps(band) // limit)))
      first += len(members) * bands
      continue
    # Start at 32-byte sectors (two 16-byte items of a row per warp), widen while the
    # group has more programs than its share of ``direct_programs``.
    share = tiling.direct_programs * len(members) * row_bytes / total
    band = min(widest, 2)
    while band < widest and len(members) * -(-cols // band) > share:
      band *= 2
    bands = -(-cols // band)
    groups.append(_DirectGroup(tuple(members), first, bands, row_bytes, item, band,
                               steps(band)))
    first += len(members) * bands
  select = tiling.direct_select
  if select == "auto":
    select = "tree" if len(groups) > 1 else "chain"
  return _DirectPlan(num_tokens, buffers[0].shape[0], tuple(groups), first, select)


def _direct(buffers, tgt, src, *, dplan: _DirectPlan, pdl: bool, tiling: MoveTiling):
  """Token moves with no index preparation (GPU); the streamed path in interpret mode.

  Each program owns a column band of one buffer (the same 16-byte items of every row) and
  its threads hold all T pairs' items of that band in registers: every thread loads its
  items, the program meets at a barrier, then every thread stores. No other program
  touches those bytes, so this is the snapshot for any overlap, and no XLA work is needed
  before the launch (int32 indices go in as they are; the kernel skips out-of-range pairs).
  A duplicated target row may mix its writers by 16-byte items (as the row kernels).
  """
  rows = buffers[0].shape[0]
  if dplan.in_rounds:
    tgt, src = _sanitize(tgt, src, rows)
  args = (tgt, src)
  if dplan.in_rounds:  # rounds need to know whether any source is some other pair's target
    save = _endangered(tgt, src, rows, tiling.small_t_compare)
    args += (jnp.max(save, keepdims=True),)

  def build(interpret: bool):
    if interpret:
      return functools.partial(_direct_stand_in, pdl=pdl, tiling=tiling)
    run = functools.partial(_direct_move, plan=dplan, pdl=pdl)
    return functools.partial(_in_place, run, None)

  return common.dispatch(build, buffers, *args)


def _direct_stand_in(buffers, tgt, src, flag=None, *, pdl: bool, tiling: MoveTiling):
  """Interpret mode has no thread-level code: the streamed path (two-pass when T indices
  do not fit it), same semantics."""
  del flag
  tgt, src = _sanitize(tgt, src, buffers[0].shape[0])
  splan = _stream_plan(buffers, tgt.shape[0], tiling)
  if splan is None:
    return _two_pass(buffers, tgt, src, unit_rows=1, pdl=pdl, tiling=tiling,
                     interpret=common.interpret_params())
  args = _stream_inputs(buffers, tgt, src, splan=splan, tiling=tiling)
  return _in_place(_stream_runner(splan, pdl, tiling), common.interpret_params(),
                   buffers, *args)


def _direct_move(refs, tgt, src, *flag, plan: _DirectPlan, pdl: bool, interpret):
  del interpret  # GPU only
  # Rounds: a temporary per buffer for the endangered case (an output: only its memory is
  # needed; dropped right after).
  temp_types = tuple(jax.ShapeDtypeStruct((plan.tokens, *r.shape[1:]), r.dtype)
                     for r in refs) if plan.in_rounds else ()

  def body(*args):
    tgt_gmem, src_gmem, *rest = args
    flag_gmem = rest.pop(0) if plan.in_rounds else None
    buffers, temps = rest[:len(refs)], rest[len(refs):]
    if pdl:
      plgpu.griddepcontrol_wait()
    _direct_copy(plan, tgt_gmem, src_gmem, buffers, flag_gmem, temps)

  plgpu.kernel(
      body,
      out_type=temp_types,
      grid=(plan.programs,),
      grid_names=("job",),
      compiler_params=_compiler_params(),
  )(tgt, src, *flag, *refs)


def _direct_copy(plan: _DirectPlan, tgt_gmem, src_gmem, buffers, flag_gmem=None, temps=()):
  """Thread-level body of a direct program (Mosaic GPU IR through ``inline_mgpu``).

  Program ``p`` of group ``g`` moves items ``[band * B, band * B + B)`` (B = ``g.band``) of
  every row of buffer ``g.members[p // g.bands]``. Thread ``l`` takes item ``l % B`` of
  tokens ``l // B + s * (128 // B)`` for ``s < g.steps`` (plus ``g.steps * 128 // B`` per
  round). The buffer's base address is chosen by selects, so the code exists once per row
  layout, not once per buffer.

  One round: load every item, barrier, store. Several rounds: if no source is endangered
  (``flag_gmem[0] == 0``) each round loads then stores its items (no store can reach a row
  that is read); otherwise the program first copies all its source items to ``temps`` (row
  = token), meets at a barrier, then copies the temporary to the targets.
  """
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  extra = (flag_gmem, *temps) if flag_gmem is not None else ()

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (2 + len(buffers) + len(extra)))
  def copy(_, tgt_ref, src_ref, *refs):
    bufs = refs[:len(buffers)]
    flag_ref, *temp_refs = refs[len(buffers):] or (None,)
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    c32 = lambda v: mgpu_utils.c(v, i32)
    c64 = lambda v: mgpu_utils.c(v, i64)
    ult = lambda a, b: arith.cmpi(arith.CmpIPredicate.ult, a, b)
    global_ptr = llvm.PointerType.get(1)
    program = arith.index_cast(i32, gpu.block_id(gpu.Dimension.x))
    lane = arith.remui(mgpu_utils.thread_idx(), c32(_WARPGROUP))

    def rounds_loop(count: int, fn):
      loop = scf.ForOp(mgpu_utils.c(0, index), mgpu_utils.c(count, index),
                       mgpu_utils.c(1, index))
      with ir.InsertionPoint(loop.body):
        fn(arith.index_cast(i32, loop.induction_variable))
        scf.yield_([])

    for g in plan.groups:
      local = arith.subi(program, c32(g.first))
      mine = ult(local, c32(len(g.members) * g.bands))  # local < 0 wraps to large
      if_mine = scf.IfOp(mine)
      with ir.InsertionPoint(if_mine.then_block):
        member = arith.divui(local, c32(g.bands))

        def select_base(refs_):
          address_of = lambda k: llvm.ptrtoint(i64, mgpu_utils.memref_ptr(refs_[k]))
          if plan.select == "chain":  # every thread reads every member's address
            base = address_of(g.members[0])
            for m, k in enumerate(g.members[1:], 1):
              base = arith.select(arith.cmpi(arith.CmpIPredicate.eq, member, c32(m)),
                                  address_of(k), base)
            return base

          def tree(lo: int, hi: int):
            """``member`` is uniform per program: log2 branches, one address read."""
            if hi - lo == 1:
              return address_of(g.members[lo])
            mid = (lo + hi) // 2
            branch = scf.IfOp(ult(member, c32(mid)), [i64], has_else=True)
            with ir.InsertionPoint(branch.then_block):
              scf.yield_([tree(lo, mid)])
            with ir.InsertionPoint(branch.else_block):
              scf.yield_([tree(mid, hi)])
            return branch.result

          return tree(0, len(g.members))

        base = select_base(bufs)
        temp_base = select_base(temp_refs) if g.rounds > 1 else None
        per_step = _WARPGROUP // g.band
        per_round = g.steps * per_step
        col = arith.addi(arith.muli(arith.remui(local, c32(g.bands)), c32(g.band)),
                         arith.remui(lane, c32(g.band)))
        col_ok = ult(col, c32(g.row_bytes // g.item_bytes))
        col_off = arith.muli(arith.extui(i64, arith.select(col_ok, col, c32(0))),
                             c64(g.item_bytes))
        token0 = arith.divui(lane, c32(g.band))
        if g.item_bytes == _BULK_ALIGN:
          item_ty = ir.VectorType.get([4], i32)
        else:
          item_ty = ir.IntegerType.get_signless(8 * g.item_bytes)

        def address(start, row):
          offset = arith.muli(arith.extui(i64, row), c64(g.row_bytes))
          return llvm.inttoptr(global_ptr, arith.addi(arith.addi(start, offset), col_off))

        def load(first_token, from_temp: bool):
          """This thread's items of tokens from ``first_token`` (i32): (ok, tgt, token, value)."""
          items = []
          for step in range(g.steps):
            token = arith.addi(first_token, arith.addi(token0, c32(step * per_step)))
            ok = col_ok
            if g.rounds > 1 or (step + 1) * per_step > plan.tokens:
              token_ok = ult(token, c32(plan.tokens))
              ok = arith.andi(ok, token_ok)
              token = arith.select(token_ok, token, c32(0))
            at = [arith.index_cast(index, token)]
            tgt, src = memref.load(tgt_ref, at), memref.load(src_ref, at)
            ok = arith.andi(ok, arith.andi(ult(tgt, c32(plan.rows)), ult(src, c32(plan.rows))))
            where = (address(temp_base, token) if from_temp
                     else address(base, arith.select(ok, src, c32(0))))
            items.append((ok, tgt, token, llvm.load(item_ty, where, alignment=g.item_bytes)))
          return items

        def store(items, to_temp: bool):
          for ok, tgt, token, value in items:
            if_ok = scf.IfOp(ok)
            with ir.InsertionPoint(if_ok.then_block):
              where = address(temp_base, token) if to_temp else address(base, tgt)
              llvm.store(value, where, alignment=g.item_bytes)
              scf.yield_([])

        if g.rounds == 1:
          items = load(c32(0), False)
          # Every load of the program is performed before any of its stores (bar.sync).
          mgpu_utils.warpgroup_barrier()
          store(items, False)
        else:
          first_of = lambda r: arith.muli(r, c32(per_round))
          endangered = arith.cmpi(arith.CmpIPredicate.ne,
                                  memref.load(flag_ref, [mgpu_utils.c(0, index)]), c32(0))
          if_endangered = scf.IfOp(endangered, has_else=True)
          with ir.InsertionPoint(if_endangered.then_block):
            rounds_loop(g.rounds, lambda r: store(load(first_of(r), False), True))
            mgpu_utils.warpgroup_barrier()  # the temporary is written (CTA-scope order)
            rounds_loop(g.rounds, lambda r: store(load(first_of(r), True), False))
            scf.yield_([])
          with ir.InsertionPoint(if_endangered.else_block):
            rounds_loop(g.rounds, lambda r: store(load(first_of(r), False), False))
            scf.yield_([])
        scf.yield_([])

  copy(tgt_gmem, src_gmem, *buffers, *extra)


# ----------------------------------------------------------------------------------------
# Streamed token moves: one launch, programs over (wide buffer, token chunk)


@dataclasses.dataclass(frozen=True)
class _StreamPlan:
  chunk: int  # tokens per wide program (a multiple of 4)
  chunks: int
  tokens: int  # padded T, chunk * chunks
  wide: tuple[int, ...]  # buffer positions with rows of 16-byte multiples
  narrow: tuple[int, ...]  # one-element rows (one program each, all tokens)


def _stream_plan(buffers, num_tokens: int, tiling: MoveTiling):
  """Chunking of the streamed path, or None when T's indices do not fit shared memory."""
  narrow = tuple(k for k, b in enumerate(buffers) if _is_narrow(b, 1))
  wide = tuple(k for k in range(len(buffers)) if k not in narrow)
  want = -(-num_tokens * max(1, len(wide)) // tiling.stream_programs)
  chunk = max(tiling.stream_min_chunk, 4, 1 << max(0, want - 1).bit_length())
  chunk = min(chunk, max(4, tiling.stream_max_chunk), -(-num_tokens // 4) * 4)
  chunk = -(-chunk // 4) * 4
  chunks = -(-num_tokens // chunk)
  tokens = chunk * chunks
  if 3 * 4 * tokens > tiling.stream_index_bytes:
    return None
  if narrow and tokens * _BULK_ALIGN > tiling.staged_smem_bytes:
    return None
  return _StreamPlan(chunk, chunks, tokens, wide, narrow)


def _stream_pages(buffers, tgt, src, *, page_size, pdl, tiling: MoveTiling):
  """Page moves on the streamed path: each buffer viewed as blocks of ``item_rows`` rows
  (a free reshape), a page being ``page_size // item_rows`` consecutive blocks. None when
  no block size fits or the block indices do not fit shared memory."""
  rows = buffers[0].shape[0]
  row_bytes = [_row_bytes(b) for b in buffers]
  item_rows = None
  for r in range(page_size, 0, -1):
    if (page_size % r == 0 and rows % r == 0 and max(row_bytes) * r <= tiling.stream_item_bytes
        and all(r * x % _BULK_ALIGN == 0 for x in row_bytes)):
      item_rows = r
      break
  if item_rows is None:
    return None
  blocks = page_size // item_rows
  views = [b.reshape(rows // item_rows, item_rows * math.prod(b.shape[1:])) for b in buffers]
  splan = _stream_plan(views, tgt.shape[0] * blocks, tiling)
  if splan is None or splan.narrow:
    return None
  save = _endangered(tgt, src, rows // page_size, tiling.small_t_compare)
  offset = jnp.arange(blocks, dtype=jnp.int32)
  item_tgt = jnp.where(tgt[:, None] >= 0, tgt[:, None] * blocks + offset, -1).reshape(-1)
  item_src = (src[:, None] * blocks + offset).reshape(-1)
  item_save = jnp.broadcast_to(save[:, None], (save.shape[0], blocks)).reshape(-1)
  slots = max(2, min(tiling.stream_slots, tiling.stream_ring_bytes // (max(row_bytes) * item_rows)))
  tiling = dataclasses.replace(tiling, stream_slots=slots,
                               stream_lookahead=min(tiling.stream_lookahead, slots // 2))
  moved = _stream(views, item_tgt, item_src, splan=splan, pdl=pdl, tiling=tiling, save=item_save)
  return tuple(m.reshape(b.shape) for m, b in zip(moved, buffers))


def _stream(buffers, tgt, src, *, splan: _StreamPlan, pdl: bool, tiling: MoveTiling,
            save=None):
  """One launch. XLA computes which sources are endangered (targets of another pair).

  * None endangered (disjoint sets: the common case): no write of any program can reach a
    byte another program reads, so every (wide buffer, chunk) program streams its rows
    through a ring of shared-memory slots (one bulk copy per row each way).
  * Some endangered: only the first program of each wide buffer works, on all T tokens of
    its buffer: it saves the endangered sources to a temporary, waits for those writes,
    then moves every pair (endangered ones from the temporary). It owns the buffer, so
    this is the snapshot for any overlap (swaps, chains, cycles).
  * One-element rows (the per_token_head scale): one program per buffer loads every
    source's 16-byte window into shared memory before any scalar store (its own snapshot).
  """
  args = _stream_inputs(buffers, tgt, src, splan=splan, tiling=tiling, save=save)
  run = _stream_runner(splan, pdl, tiling)
  return _on_platform(functools.partial(_in_place, run), buffers, *args)


def _stream_inputs(buffers, tgt, src, *, splan: _StreamPlan, tiling: MoveTiling, save=None):
  """The streamed kernel's index inputs: padded tgt, src, save, and the 4-word flag."""
  if save is None:
    save = _endangered(tgt, src, buffers[0].shape[0], tiling.small_t_compare)
  extra = splan.tokens - tgt.shape[0]
  if extra:
    tgt = jnp.pad(tgt, (0, extra), constant_values=-1)
    src = jnp.pad(src, (0, extra))
    save = jnp.pad(save, (0, extra))
  # "Any source endangered" as 4 partial maxima (one 16-byte load; the kernel ORs them).
  flag = jnp.max(save.reshape(_BULK_ALIGN // 4, -1), axis=1)
  return tgt, src, save, flag


def _stream_runner(splan: _StreamPlan, pdl: bool, tiling: MoveTiling):
  return functools.partial(_stream_move, splan=splan, pdl=pdl,
                           narrow_first=tiling.stream_narrow_first,
                           slots=tiling.stream_slots,
                           lookahead=min(tiling.stream_lookahead, tiling.stream_slots - 1))


def _stream_move(refs, tgt, src, save, flag, *, splan, pdl, slots, lookahead, interpret,
                 narrow_first=False):
  chunk, chunks, tokens = splan.chunk, splan.chunks, splan.tokens
  num_wide_jobs = len(splan.wide) * chunks
  num_jobs = num_wide_jobs + len(splan.narrow)
  temp_types = tuple(
      jax.ShapeDtypeStruct((tokens, *refs[k].shape[1:]), refs[k].dtype) for k in splan.wide)
  narrow_plan = None
  itemsizes = {refs[k].dtype.itemsize for k in splan.narrow}
  if interpret is None and len(itemsizes) == 1:
    # One program per one-element-row buffer: its 128 threads hold all T elements in
    # registers (T <= 4096 here: at most 32 each). A program reading 16-byte windows with
    # bulk copies issues them one at a time: 1.3 ms at T=4096 for 61 layers on the H200.
    (itemsize,) = itemsizes
    narrow_plan = _DirectPlan(tokens, refs[0].shape[0], (_DirectGroup(
        members=tuple(range(len(splan.narrow))), first=0 if narrow_first else num_wide_jobs,
        bands=1, row_bytes=itemsize, item_bytes=itemsize, band=1,
        steps=-(-tokens // _WARPGROUP)),), num_jobs)

  def body(tgt_gmem, src_gmem, save_gmem, flag_gmem, *rest):
    buffers = rest[:len(refs)]
    temps = rest[len(refs):len(refs) + len(temp_types)]
    tgt_smem, src_smem, save_smem, flag_smem, first_barrier, all_barrier = (
        rest[len(refs) + len(temp_types):])
    if pdl:
      plgpu.griddepcontrol_wait()
    job = jax.lax.axis_index("job")
    num_narrow = len(splan.narrow)
    if narrow_first:  # narrow programs 0..num_narrow-1, then the wide ones
      is_wide = job >= num_narrow
      wide_job = jnp.maximum(job - num_narrow, 0)
      narrow_job = job
    else:
      is_wide = job < num_wide_jobs
      wide_job = job
      narrow_job = job - num_wide_jobs
    part = wide_job % chunks
    first = part * chunk
    # The flag and this program's chunk of indices in one round trip; all indices only when
    # needed (some source endangered, or a one-element-row program).
    _load_indices([(flag_gmem, flag_smem),
                   (tgt_gmem.at[pl.ds(first, chunk)], tgt_smem.at[pl.ds(first, chunk)]),
                   (src_gmem.at[pl.ds(first, chunk)], src_smem.at[pl.ds(first, chunk)]),
                   (save_gmem.at[pl.ds(first, chunk)], save_smem.at[pl.ds(first, chunk)])],
                  first_barrier)
    safe = (flag_smem[0] | flag_smem[1] | flag_smem[2] | flag_smem[3]) != 0

    # On the GPU the one-element-row programs read their indices from global memory.
    narrow_in_smem = jnp.logical_not(is_wide) if narrow_plan is None else False

    @pl.when(safe | narrow_in_smem)
    def _():
      _load_indices([(tgt_gmem, tgt_smem), (src_gmem, src_smem), (save_gmem, save_smem)],
                    all_barrier)

    which = wide_job // chunks
    for w, (k, temp) in enumerate(zip(splan.wide, temps)):
      pl.when(is_wide & (which == w))(functools.partial(
          _stream_wide, buffers[k], temp, tgt_smem, src_smem, save_smem, safe, part,
          chunk=chunk, chunks=chunks, slots=slots, lookahead=lookahead))
    if narrow_plan is not None:  # thread-level, as the direct path (its own snapshot)
      _direct_copy(narrow_plan, tgt_gmem, src_gmem, [buffers[k] for k in splan.narrow])
      return
    for n, k in enumerate(splan.narrow):
      pl.when(jnp.logical_not(is_wide) & (narrow_job == n))(functools.partial(
          _move_narrow_rows, buffers[k], tgt_smem, src_smem, tokens,
          _window(buffers[k].dtype), interpret=interpret))

  # Temporaries are outputs (never read unless written first); the kernel only needs their
  # memory, so they are dropped right after.
  plgpu.kernel(
      body,
      out_type=temp_types,
      grid=(num_jobs,),
      grid_names=("job",),
      scratch_types=[plgpu.SMEM((tokens,), jnp.int32), plgpu.SMEM((tokens,), jnp.int32),
                     plgpu.SMEM((tokens,), jnp.int32), plgpu.SMEM((_BULK_ALIGN // 4,), jnp.int32),
                     plgpu.Barrier(num_arrivals=4), plgpu.Barrier(num_arrivals=3)],
      compiler_params=_compiler_params(),
      interpret=interpret,
  )(tgt, src, save, flag, *refs)


def _stream_wide(buffer, temp, tgt_smem, src_smem, save_smem, safe, part, *, chunk, chunks,
                 slots, lookahead):
  """One wide buffer: chunk ``part`` (no source endangered), or all chunks in two phases.

  Phase 0 (only when ``safe``): ``temp[i] = buffer[src[i]]`` for endangered items, then a
  full wait for those writes. Phase 1: ``buffer[tgt[i]] = temp[i] if save[i] else
  buffer[src[i]]``. Rows stream through ``slots`` shared-memory slots; loads run
  ``lookahead`` items ahead of the stores; each iteration commits one store group, so
  waiting until ``slots - lookahead - 1`` groups remain frees the slot being reloaded.
  """
  outstanding = slots - lookahead - 1
  run = jnp.logical_not(safe) | (part == 0)

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
          _load(temp.at[i], stage.at[slot], barriers.at[slot])

        @pl.when(saved != moving)  # phase 0 and saved, or phase 1 and not saved
        def _():
          _load(buffer.at[src_smem[i]], stage.at[slot], barriers.at[slot])

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
          plgpu.copy_smem_to_gmem(stage.at[slot], temp.at[i], commit_group=False)

        @pl.when(moving & (row >= 0))
        def _():
          plgpu.copy_smem_to_gmem(stage.at[slot], buffer.at[row], commit_group=False)

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

  pl.run_scoped(scoped, plgpu.SMEM((slots, *buffer.shape[1:]), buffer.dtype),
                plgpu.Barrier(num_arrivals=1, num_barriers=slots))


# ----------------------------------------------------------------------------------------
# Two-pass moves: save endangered sources, then move every pair


def _item_rows(buffers, unit_rows: int, tiling: MoveTiling) -> int:
  """Rows per item: a divisor of ``unit_rows`` that keeps every buffer's item 16-byte sized."""
  row_bytes = [_row_bytes(b) for b in buffers]
  limit = max(1, tiling.two_pass_smem_bytes // (4 * max(row_bytes)))
  for rows in range(min(unit_rows, limit), 0, -1):
    if unit_rows % rows == 0 and all(rows * r % _BULK_ALIGN == 0 for r in row_bytes):
      return rows
  return 1  # one-element buffers then take the narrow path


def _two_pass(buffers, tgt, src, *, unit_rows: int, pdl: bool, tiling: MoveTiling,
              interpret=None):
  """Pass 1 saves endangered sources to temporaries; pass 2 moves every pair.

  ``interpret``: interpret-mode parameters to run both passes in interpret mode directly
  (inside another kernel's interpret branch); None dispatches per lowering platform.
  """
  on_platform = _on_platform if interpret is None else (lambda fn, *a: fn(interpret, *a))
  rows = buffers[0].shape[0]
  item_rows = _item_rows(buffers, unit_rows, tiling)
  narrow = [_is_narrow(b, item_rows) for b in buffers]
  blocks = unit_rows // item_rows
  item_bytes = max(_row_bytes(b) * item_rows for b in buffers)
  per_program = max(4, min(tiling.max_items_per_program,
                           tiling.two_pass_smem_bytes // item_bytes) // 4 * 4)
  # Per item (unit j, block s): first source row, first target row (-1: skip), saved?
  save = _endangered(tgt, src, rows // unit_rows, tiling.small_t_compare)
  offset = jnp.arange(blocks, dtype=jnp.int32) * item_rows
  item_src = (src[:, None] * unit_rows + offset).reshape(-1)
  item_tgt = jnp.where(tgt[:, None] >= 0, tgt[:, None] * unit_rows + offset, -1).reshape(-1)
  item_save = jnp.broadcast_to(save[:, None], (save.shape[0], blocks)).reshape(-1)
  extra = -item_src.shape[0] % per_program
  item_src = jnp.pad(item_src, (0, extra))
  item_tgt = jnp.pad(item_tgt, (0, extra), constant_values=-1)
  item_save = jnp.pad(item_save, (0, extra))
  num_items = item_src.shape[0]
  shape = dict(num_items=num_items, per_program=per_program, item_rows=item_rows, pdl=pdl)
  views = [_rows_view(b) for b in buffers]
  temps = on_platform(
      functools.partial(_save_endangered, narrow=narrow, **shape),
      views, item_src, item_save)
  run = functools.partial(_move_items, narrow=narrow, **shape)
  return on_platform(functools.partial(_in_place, run),
                     buffers, item_src, item_tgt, item_save, temps)


def _temp_type(view, narrow: bool, num_items: int, item_rows: int):
  if narrow:
    return jax.ShapeDtypeStruct((num_items, _window(view.dtype)), view.dtype)
  return jax.ShapeDtypeStruct((num_items * item_rows, *view.shape[1:]), view.dtype)


def _stage_type(view, narrow: bool, per_program: int, item_rows: int):
  if narrow:
    return plgpu.SMEM((per_program, _window(view.dtype)), view.dtype)
  return plgpu.SMEM((per_program, item_rows, *view.shape[1:]), view.dtype)


def _load(gmem, smem, barrier):
  """Async bulk copy into shared memory (contiguous, 16-byte aligned, in bounds)."""
  plgpu.copy_gmem_to_smem(gmem, smem, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)


def _load_indices(pairs, barrier):
  """Copies ``(gmem, smem)`` index chunks into shared memory and waits for them."""
  for gmem, smem in pairs:
    _load(gmem, smem, barrier)
  plgpu.barrier_wait(barrier)


def _source(view, narrow: bool, row, item_rows: int):
  """The GMEM slice holding source ``row`` (its window, for a narrow buffer)."""
  if narrow:
    return view.at[pl.ds(_window_start(row, _window(view.dtype)), _window(view.dtype))]
  return view.at[pl.ds(row, item_rows)]


def _save_endangered(interpret, views, item_src, item_save, *, narrow, num_items,
                     per_program, item_rows, pdl):
  """Pass 1: ``temp[item] = view[item_src[item]]`` for the items marked in ``item_save``."""
  chunks = num_items // per_program

  def body(src_gmem, save_gmem, *rest):
    sources, temps = rest[:len(views)], rest[len(views):2 * len(views)]
    src_smem, save_smem, index_barrier = rest[2 * len(views):]
    if pdl:
      plgpu.griddepcontrol_wait()
    chunk = jax.lax.axis_index("chunk")
    first = chunk * per_program
    _load_indices([(src_gmem.at[pl.ds(first, per_program)], src_smem),
                   (save_gmem.at[pl.ds(first, per_program)], save_smem)], index_barrier)
    buffer_index = jax.lax.axis_index("buffer")
    for k, (source, temp, n) in enumerate(zip(sources, temps, narrow)):

      def scoped(stage, barriers, source=source, temp=temp, n=n):
        @pl.loop(0, per_program)
        def _(i):
          @pl.when(save_smem[i] != 0)
          def _():
            _load(_source(source, n, src_smem[i], item_rows), stage.at[i],
                  barriers.at[i])

        @pl.loop(0, per_program)
        def _(i):
          @pl.when(save_smem[i] != 0)
          def _():
            plgpu.barrier_wait(barriers.at[i])
            item = first + i
            slot = temp.at[item] if n else temp.at[pl.ds(item * item_rows, item_rows)]
            plgpu.copy_smem_to_gmem(stage.at[i], slot, commit_group=False)

        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pl.when(buffer_index == k)(functools.partial(
          pl.run_scoped, scoped, _stage_type(source, n, per_program, item_rows),
          plgpu.Barrier(num_arrivals=1, num_barriers=per_program)))

  return plgpu.kernel(
      body,
      out_type=tuple(_temp_type(v, n, num_items, item_rows) for v, n in zip(views, narrow)),
      grid=(len(views), chunks),
      grid_names=("buffer", "chunk"),
      scratch_types=[plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=_compiler_params(),
      interpret=interpret,
  )(item_src, item_save, *views)


def _move_items(refs, item_src, item_tgt, item_save, temps, *, narrow, num_items,
                per_program, item_rows, pdl, interpret):
  """Pass 2: ``ref[item_tgt] = temp[item] if item_save else ref[item_src]`` for every item."""
  chunks = num_items // per_program

  def body(src_gmem, tgt_gmem, save_gmem, *rest):
    saved = rest[:len(refs)]
    buffers = rest[len(refs):2 * len(refs)]
    src_smem, tgt_smem, save_smem, index_barrier = rest[2 * len(refs):]
    if pdl:
      plgpu.griddepcontrol_wait()
    chunk = jax.lax.axis_index("chunk")
    first = chunk * per_program
    _load_indices([(src_gmem.at[pl.ds(first, per_program)], src_smem),
                   (tgt_gmem.at[pl.ds(first, per_program)], tgt_smem),
                   (save_gmem.at[pl.ds(first, per_program)], save_smem)], index_barrier)
    buffer_index = jax.lax.axis_index("buffer")
    for k, (buffer, temp, n) in enumerate(zip(buffers, saved, narrow)):

      def scoped(stage, barriers, buffer=buffer, temp=temp, n=n):
        @pl.loop(0, per_program)
        def _(i):
          moved = tgt_smem[i] >= 0
          from_temp = save_smem[i] != 0

          @pl.when(moved & from_temp)
          def _():
            item = first + i
            slot = temp.at[item] if n else temp.at[pl.ds(item * item_rows, item_rows)]
            _load(slot, stage.at[i], barriers.at[i])

          @pl.when(moved & jnp.logical_not(from_temp))
          def _():
            _load(_source(buffer, n, src_smem[i], item_rows), stage.at[i],
                  barriers.at[i])

        @pl.loop(0, per_program)
        def _(i):
          row = tgt_smem[i]

          @pl.when(row >= 0)
          def _():
            plgpu.barrier_wait(barriers.at[i])
            if n:
              source = src_smem[i]
              start = _window_start(source, _window(buffer.dtype))
              buffer[row] = stage[i, source - start]
            else:
              plgpu.copy_smem_to_gmem(stage.at[i], buffer.at[pl.ds(row, item_rows)],
                                      commit_group=False)

        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pl.when(buffer_index == k)(functools.partial(
          pl.run_scoped, scoped, _stage_type(buffer, n, per_program, item_rows),
          plgpu.Barrier(num_arrivals=1, num_barriers=per_program)))

  plgpu.kernel(
      body,
      out_type=(),
      grid=(len(refs), chunks),
      grid_names=("buffer", "chunk"),
      scratch_types=[plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.SMEM((per_program,), jnp.int32),
                     plgpu.Barrier(num_arrivals=3)],
      compiler_params=_compiler_params(),
      interpret=interpret,
  )(item_src, item_tgt, item_save, *temps, *refs)
