"""Pieces shared by the move paths (`move_direct`, `move_stream`, `move_two_pass`).

Tile sizes (`MoveTiling`), argument checks, index preparation in plain XLA (skip rule,
"endangered" sources), platform dispatch with in-place refs, and the buffer views the
kernels see. Every path moves *units* of ``unit_rows`` consecutive rows: one row for
``move_rows``, one page for ``move_pages``.
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

BULK_ALIGN = common.BULK_ALIGN  # cp.async.bulk and TMA: 16-byte sizes, addresses, strides
WARPGROUP = 128  # threads of one Mosaic GPU program

PATHS = ("auto", "direct", "stream", "two_pass")


@dataclasses.dataclass(frozen=True)
class MoveTiling:
  """Path choice and tile sizes of the move kernels (static; change them only to tune).

  Attributes:
    path: "auto" walks the paths in order (direct, stream, two_pass), each taking the move
      when its size limits below allow it; naming a path starts the walk there and lifts
      the direct path's T limits (a path that cannot run still hands over to the next).
    direct_max_tokens: "auto": token moves up to this T take the direct path.
    direct_items_per_thread: direct path: the most 16-byte items one thread holds in
      registers (sets how many rows a program covers per column band, and a round's size).
    direct_programs: direct path: bands widen (fewer, larger programs) while the grid has
      more programs than this.
    direct_rounds: direct path: when T items do not fit the registers, move them in rounds
      (XLA computes "any source endangered"; if so each program first copies its band of
      the sources to a temporary). None: only for buffer sets with one-element rows
      (per_token_head), where "auto" then keeps the direct path up to
      ``direct_rounds_max_tokens``; True: every buffer set; False: never.
    direct_rounds_max_tokens: with rounds on, "auto" takes the direct path up to this T.
    direct_select: how a direct program finds its buffer's address among the buffers of
      its row layout: "chain" (a select per buffer), "tree" (branches on the
      program-uniform buffer number) or "auto" (tree when there are several row layouts).
    page_direct_max_rows: "auto": page moves of at most this many rows (pages x
      page_size) take the direct path (the token path, no XLA work before it).
    stream_programs: streamed path: target number of (buffer, chunk) programs.
    stream_max_chunk, stream_min_chunk: bounds of a streamed program's chunk of units.
    stream_slots, stream_lookahead: the streamed ring: shared-memory row slots, and how many
      row loads run ahead of the stores (``< stream_slots``).
    stream_index_bytes: shared memory for all indices (tgt, src, save); above it, two-pass.
    stream_item_bytes: page moves on the streamed path copy blocks of whole rows of at most
      this many bytes (one bulk copy each).
    stream_ring_bytes: page moves on the streamed path: cap on a program's ring bytes.
    small_t_compare: up to this many pairs, endangered sources come from an all-pairs
      compare (one fused XLA kernel) instead of writer counts.
    two_pass_smem_bytes: shared memory of one two-pass program (its items of one buffer).
    max_items_per_program: cap on the items one two-pass program moves.
    writer_period: the pairs repeat every this many units (set by ``move_rows(...,
      layers=L)`` where a path gets every layer's pairs: the same pairs in every block,
      offset by the block's rows or pages): the writer counts of
      `endangered` are kept per unit modulo it (exact for such moves, conservative for any
      other), so they cost one layer's units, not the whole stacked buffer's. None: per unit.
    two_pass_max_buffers: two-pass launches each move at most this many buffers (equal
      batches share one kernel: its lowering time grows faster than linearly with the
      buffers). 32: 61 plain layers in 2 batches, 229.8 us at T=4096 on the H200 against
      275.5 with batches of 8 and 220.0 in one launch (whose lowering takes ~17 s).
  """

  path: str = "auto"
  direct_max_tokens: int = 1024
  direct_items_per_thread: int = 32
  direct_programs: int = 1024
  direct_rounds: bool | None = None
  direct_rounds_max_tokens: int = 16384
  direct_select: str = "auto"
  page_direct_max_rows: int = 1024
  stream_programs: int = 1024
  stream_max_chunk: int = 256
  stream_min_chunk: int = 8
  stream_slots: int = 16
  stream_lookahead: int = 8
  stream_index_bytes: int = 48 * 1024
  stream_item_bytes: int = 16 * 1024
  stream_ring_bytes: int = 128 * 1024
  small_t_compare: int = 1024
  two_pass_smem_bytes: int = 64 * 1024
  max_items_per_program: int = 32
  two_pass_max_buffers: int = 32
  writer_period: int | None = None

  def __post_init__(self):
    if self.path not in PATHS:
      raise ValueError(f"tiling.path: expected one of {'/'.join(PATHS)}, got {self.path!r}")
    if self.direct_select not in ("auto", "chain", "tree"):
      raise ValueError(
          f"tiling.direct_select: expected auto/chain/tree, got {self.direct_select!r}")


DEFAULT_TILING = MoveTiling()


# ----------------------------------------------------------------------------------------
# Checks and index preparation (plain XLA on T indices)


def check_buffers(buffers: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """The buffers as a tuple; raises unless they share ``rows`` and the kernels cover them."""
  buffers = tuple(buffers)
  if not buffers:
    return buffers
  rows = buffers[0].shape[0] if buffers[0].ndim else None
  for i, b in enumerate(buffers):
    if b.ndim < 1 or b.shape[0] != rows:
      raise ValueError(
          f"buffers[{i}]: expected shape (rows={rows}, ...), got {b.shape}")
    width = math.prod(b.shape[1:])
    if row_bytes(b) % BULK_ALIGN and width != 1:
      raise common.Unsupported(
          f"buffers[{i}]: expected a row of a multiple of {BULK_ALIGN} bytes or of one "
          f"element, got shape {b.shape} of {b.dtype} ({row_bytes(b)} bytes a row)")
    if width == 1 and rows % window(b.dtype):
      raise common.Unsupported(
          f"buffers[{i}]: a one-element-row buffer needs a multiple of "
          f"{window(b.dtype)} rows (16-byte windows), got {rows}")
  return buffers


def check_indices(tgt, src, tgt_name: str, src_name: str):
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


def sanitize(tgt, src, limit: int):
  """int32 indices: skipped pairs get ``tgt = -1`` and ``src = 0`` (a harmless unit)."""
  keep = (tgt >= 0) & (tgt < limit) & (src >= 0) & (src < limit)
  return jnp.where(keep, tgt, -1), jnp.where(keep, src, 0)


def endangered(tgt, src, units: int, small_t_compare: int = 0, period: int | None = None):
  """``save[j]``: some other kept pair writes unit ``src[j]``, so it must be read first.

  ``tgt``/``src`` are sanitized (skipped pairs: ``tgt = -1``, ``src = 0``); ``units`` is the
  number of rows (or pages). Up to ``small_t_compare`` pairs an all-pairs compare (one
  fused XLA reduction); beyond, a count of writers per unit (a scatter-add into ``units``
  int32 counters, then a gather): O(T) work, where a sort and binary searches cost ~100 us
  at T=4096 on the H200. With ``period`` (< ``units``), the counters are per unit modulo
  ``period`` (``MoveTiling.writer_period``): a unit's writers are all counted at its residue,
  so nothing endangered is missed; pairs of other periods may add false alarms (a save that
  was not needed), none when every period holds the same pairs.
  """
  n = tgt.shape[0]
  if n <= small_t_compare:
    other = jnp.arange(n)[:, None] != jnp.arange(n)[None, :]
    hit = jnp.any((src[:, None] == tgt[None, :]) & other, axis=1)
    return (hit & (tgt >= 0)).astype(jnp.int32)
  if period is not None and 0 < period < units:
    units, tgt_unit, src_unit = period, jnp.where(tgt >= 0, tgt % period, -1), src % period
  else:
    tgt_unit, src_unit = tgt, src
  writers = jnp.zeros((units + 1,), jnp.int32).at[
      jnp.where(tgt_unit >= 0, tgt_unit, units)].add(1, mode="promise_in_bounds")
  others = writers[src_unit] - (tgt == src).astype(jnp.int32)
  return ((others > 0) & (tgt >= 0)).astype(jnp.int32)


def expand_units(tgt, src, blocks: int):
  """Sanitized unit pairs -> pairs of their ``blocks`` consecutive sub-units (tgt -1 kept)."""
  offset = jnp.arange(blocks, dtype=jnp.int32)
  item_tgt = jnp.where(tgt[:, None] >= 0, tgt[:, None] * blocks + offset, -1).reshape(-1)
  item_src = (src[:, None] * blocks + offset).reshape(-1)
  return item_tgt, item_src


# ----------------------------------------------------------------------------------------
# Platform dispatch and refs


def on_platform(fn: Callable, *args, interpret=None, cuda: Callable | None = None):
  """Calls ``fn(interpret, *args)`` (arrays in, arrays out).

  ``interpret=None``: per lowering platform through ``common.dispatch`` (``fn`` gets None
  for the real CUDA kernel, interpret-mode parameters elsewhere). Otherwise ``fn`` runs
  with the given interpret-mode parameters (inside another path's interpret branch).
  The CUDA branch is one jitted function, so ``common.dispatch``'s shape evaluation and
  its CUDA branch share one trace of the kernel body; ``cuda``, when given, is that jitted
  ``fn(None, ...)`` (callers that launch one kernel several times pass the same one, which
  is then traced and lowered once).
  """
  if interpret is not None:
    return fn(interpret, *args)
  if cuda is None:
    cuda = jax.jit(functools.partial(fn, None))
  return common.dispatch(
      lambda interpreted: (functools.partial(fn, common.interpret_params()) if interpreted
                           else cuda), *args)


def in_place(run: Callable, interpret, buffers, *args):
  """Runs ``run(refs, *args, interpret=...)`` on refs to kernel views of ``buffers``.

  Returns the buffers, frozen and in their own shapes (the kernel aliases them).
  """
  refs = [jax.new_ref(rows_view(b)) for b in buffers]
  run(refs, *args, interpret=interpret)
  return tuple(jax.freeze(r).reshape(b.shape) for r, b in zip(refs, buffers))


def row_bytes(buffer) -> int:
  return math.prod(buffer.shape[1:]) * buffer.dtype.itemsize


def rows_view(buffer):
  """Kernel view of a buffer: 2-D ``(rows, width)``, or 1-D for one-element rows.

  TMA needs every stride but the last to be a multiple of 16 bytes, which ``(rows, 1)``
  float32 is not.
  """
  rows = buffer.shape[0]
  return buffer.reshape(rows) if math.prod(buffer.shape[1:]) == 1 else buffer.reshape(rows, -1)


def is_narrow(buffer, rows_per_item: int) -> bool:
  """Whether an item of ``rows_per_item`` rows is too small for a bulk copy."""
  return (rows_per_item * row_bytes(buffer)) % BULK_ALIGN != 0


def window(dtype) -> int:
  """Elements in the 16-byte TMA window read around a narrow row."""
  return BULK_ALIGN // jnp.dtype(dtype).itemsize


def window_start(row, size: int):
  """First element of the 16-byte-aligned window of ``size`` elements holding ``row`` (the
  buffer's rows are a multiple of ``size``, checked in :func:`check_buffers`).

  An aligned window is a plain 16-byte bulk copy. (A TMA tensor-map box at an unaligned
  start would need a 128-byte-aligned shared destination per row: compute-sanitizer
  flagged the 16-byte-strided slots a first version used.)
  """
  return pl.multiple_of(row - row % size, size)


def load(gmem, smem, barrier):
  """Async bulk copy into shared memory (contiguous, 16-byte aligned, in bounds)."""
  plgpu.copy_gmem_to_smem(gmem, smem, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)


def load_indices(pairs, barrier):
  """Copies ``(gmem, smem)`` index chunks into shared memory and waits for them."""
  for gmem, smem in pairs:
    load(gmem, smem, barrier)
  plgpu.barrier_wait(barrier)


def compiler_params():
  return plgpu.CompilerParams()
