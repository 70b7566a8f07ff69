"""Mosaic GPU kernels that move token rows and pages of every cache buffer, in place.

Plain-JAX equivalent of both operations (snapshot semantics: every read happens before any
write; pairs with an index outside ``[0, rows)`` are skipped)::

    def move_rows_reference(buffers, tgt_loc, src_loc):
      keep = (0 <= tgt_loc) & (tgt_loc < rows) & (0 <= src_loc) & (src_loc < rows)
      return tuple(b.at[jnp.where(keep, tgt_loc, rows)].set(b[jnp.where(keep, src_loc, 0)],
                                                            mode="drop") for b in buffers)

``move_pages`` is the same with whole pages (``page_size`` consecutive rows) as the unit.

Which path runs: a move walks ``PATHS`` in order and the first path whose plan function
returns a plan (not None) takes it (``MoveTiling.path`` names the first path to try):

1. direct (``move_direct``; one launch, no XLA work before it): token moves up to
   ``direct_max_tokens`` = 1024 rows; buffer sets with one-element rows (per_token_head's
   scale) up to ``direct_rounds_max_tokens`` = 16384 rows, in rounds above 1024 (then XLA
   computes one flag before the launch); page moves of at most ``page_direct_max_rows`` =
   1024 rows (16 pages of 64). Interpret mode (CPU) runs the next path instead.
2. stream (``move_stream``; one launch after a few small XLA ops on the indices): page
   moves of up to 4096 items (``stream_index_bytes``) of whole rows (blocks of up to
   ``stream_item_bytes`` = 16 KiB): 17-512 pages of 64 plain rows, per_token_head 17-2048
   pages (H200, 61 plain layers: 47.1 us at 17 pages, 607.6 us at 256 against 667.4 for
   two-pass; 8 KiB items took 740 us). Token moves only when forced (``path="stream"``): two-pass was faster on the H200
   (61 plain layers: 126.6 vs 129.6 us at T=2048, 229.8 vs 329.8 us at T=4096).
3. two_pass (``move_two_pass``; two launches per batch of at most ``two_pass_max_buffers``
   = 32 buffers, i.e. 4 launches for 61 plain layers, 12 for 61 per_token_head trios):
   everything else (plain token moves above 1024 rows, per_token_head above 16384, larger
   page moves).

Stacked buffers (``layers`` > 1: each buffer is ``layers`` equal blocks of rows, a
``StackedMLAKVCache``'s layers, and the pairs apply in every block): the direct path takes
each block as a member of its own (the same programs as separate buffers); the other paths
get the pairs of every block as pairs of the whole buffers (``exact.every_block``; page
moves whose blocks are not whole pages as row moves), their writer counts kept per block
(``MoveTiling.writer_period``).

Each path owns distinct bytes per program, so no program races another. Buffers enter the
kernels as refs (``jax.new_ref`` / ``jax.freeze``), so the kernels alias them: under a
donating ``jit`` no buffer is copied. On CPU the same kernels run in Mosaic GPU interpret
mode; the choice is made per lowering platform (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from pallas_kernels import exact
from pallas_kernels import move_common as mc
from pallas_kernels import move_direct, move_stream, move_two_pass
from pallas_kernels.move_common import DEFAULT_TILING, MoveTiling

__all__ = ["MoveTiling", "DEFAULT_TILING", "PATHS", "move_rows", "move_pages", "choose"]


class Path(NamedTuple):
  """One move path: ``plan(buffers, num_units, unit_rows, tiling)`` returns its plan or
  None (hand over to the next path); ``run(buffers, tgt, src, plan, **kw)`` moves."""
  name: str
  plan: Callable
  run: Callable


def _run_direct(buffers, tgt, src, dplan, *, unit_rows, pdl, tiling, interpret=None):
  def stand_in(buffers, tgt, src, interpret):
    # Interpret mode: the next path that takes the move (same results).
    unit, til = unit_rows, tiling
    if dplan.layers > 1:
      tgt, src, unit, til = _every_layer(buffers, tgt, src, unit_rows, tiling, dplan.layers)
    name, nplan = choose(buffers, tgt.shape[0], unit, til, after="direct")
    return _BY_NAME[name].run(buffers, tgt, src, nplan, unit_rows=unit, pdl=pdl,
                              tiling=til, interpret=interpret)

  return move_direct.move(buffers, tgt, src, dplan, pdl=pdl, tiling=tiling,
                          stand_in=stand_in, interpret=interpret)


def _run_stream(buffers, tgt, src, splan, *, unit_rows, pdl, tiling, interpret=None):
  del unit_rows  # in the plan
  return move_stream.move(buffers, tgt, src, splan, pdl=pdl, tiling=tiling,
                          interpret=interpret)


PATHS = (
    Path("direct", move_direct.plan, _run_direct),
    Path("stream", move_stream.plan, _run_stream),
    Path("two_pass", move_two_pass.plan, move_two_pass.move),
)
_BY_NAME = {p.name: p for p in PATHS}


def _every_layer(buffers, tgt, src, unit_rows: int, tiling: MoveTiling, layers: int):
  """A stacked move's pairs (units of a block) as pairs of the whole buffers: ``(tgt, src,
  unit_rows, tiling)`` for the paths that know no blocks. Pages of blocks that are not
  whole pages become their rows; the tiling's writer counts are kept per block."""
  block_rows = buffers[0].shape[0] // layers
  if block_rows % unit_rows:
    tgt, src = (exact.every_block_pages(x, unit_rows, block_rows, layers) for x in (tgt, src))
    unit_rows, units = 1, block_rows
  else:
    units = block_rows // unit_rows
    tgt, src = (exact.every_block(x, units, layers) for x in (tgt, src))
  return tgt, src, unit_rows, dataclasses.replace(tiling, writer_period=units)


def choose(buffers, num_units: int, unit_rows: int, tiling: MoveTiling = DEFAULT_TILING,
           after: str | None = None):
  """``(path name, plan)`` of the first path in ``PATHS`` that takes the move (starting at
  ``tiling.path`` unless "auto"; past ``after`` when given)."""
  names = [p.name for p in PATHS]
  start = 0 if tiling.path == "auto" else names.index(tiling.path)
  if after is not None:
    start = max(start, names.index(after) + 1)
  for path in PATHS[start:]:
    plan = path.plan(buffers, num_units, unit_rows, tiling)
    if plan is not None:
      return path.name, plan
  raise AssertionError("the two-pass path takes every move")


def move_rows(
    buffers: Sequence[jax.Array],
    tgt_loc: jax.Array,
    src_loc: jax.Array,
    *,
    pdl: bool = False,
    tiling: MoveTiling = DEFAULT_TILING,
    layers: int = 1,
) -> tuple[jax.Array, ...]:
  """For every buffer ``b``: ``b[tgt_loc[i]] = old_b[src_loc[i]]``, all reads before any write.

  Args:
    buffers: arrays sharing the leading ``rows`` dimension, e.g. 61 x ``(rows, 1, 576)``
      bfloat16, or per layer ``(rows, 1, 512)`` float8_e4m3fn, ``(rows, 1, 1)`` float32 and
      ``(rows, 1, 64)`` bfloat16. A row must be a multiple of 16 bytes or a single element
      (then ``rows`` a multiple of 16 bytes' worth of elements).
    tgt_loc, src_loc: ``(T,)`` integer row indices. Pairs with either index outside
      ``[0, rows)`` are skipped. ``T == 0`` returns the buffers unchanged.
    pdl: launch with programmatic dependent launch (waits on the previous kernel in-kernel).
    tiling: path choice and tile sizes.
    layers: each buffer is ``layers`` equal blocks of ``rows // layers`` rows (a stacked
      cache's layers) and every block moves the pairs, indices in ``[0, rows // layers)``.

  Returns:
    The updated buffers, same shapes and dtypes; they alias the inputs (donate them).
  """
  buffers = mc.check_buffers(buffers)
  tgt, src = mc.check_indices(tgt_loc, src_loc, "tgt_loc", "src_loc")
  return _move(buffers, tgt, src, 1, pdl, tiling, layers)


def move_pages(
    buffers: Sequence[jax.Array],
    tgt_pages: jax.Array,
    src_pages: jax.Array,
    *,
    page_size: int,
    pdl: bool = False,
    tiling: MoveTiling = DEFAULT_TILING,
    layers: int = 1,
) -> tuple[jax.Array, ...]:
  """Moves whole pages: rows ``[p*page_size, (p+1)*page_size)`` of every buffer.

  For every buffer ``b`` and pair ``i``: page ``tgt_pages[i]`` gets the old contents of page
  ``src_pages[i]``; all reads happen before any write. Pairs with a page outside
  ``[0, rows // page_size)`` are skipped. Arguments as :func:`move_rows` (with ``layers``,
  page ids of a block, ``[0, rows // layers // page_size)``; the block's rows need not be
  a multiple of ``page_size``).
  """
  buffers = mc.check_buffers(buffers)
  tgt, src = mc.check_indices(tgt_pages, src_pages, "tgt_pages", "src_pages")
  if not isinstance(page_size, int) or page_size < 1:
    raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
  return _move(buffers, tgt, src, page_size, pdl, tiling, layers)


def _move(buffers, tgt, src, unit_rows: int, pdl: bool, tiling: MoveTiling, layers: int = 1):
  exact.block_rows(buffers[0].shape[0] if buffers else 0, layers)   # (the check)
  if tgt.shape[0] == 0 or not buffers:
    return buffers
  if layers > 1:
    if tiling.path in ("auto", "direct"):
      dplan = move_direct.plan(buffers, tgt.shape[0], unit_rows, tiling, layers)
      if dplan is not None:
        return _run_direct(buffers, tgt, src, dplan, unit_rows=unit_rows, pdl=pdl,
                           tiling=tiling)
    tgt, src, unit_rows, tiling = _every_layer(buffers, tgt, src, unit_rows, tiling, layers)
  name, plan = choose(buffers, tgt.shape[0], unit_rows, tiling)
  return _BY_NAME[name].run(buffers, tgt, src, plan, unit_rows=unit_rows, pdl=pdl,
                            tiling=tiling)

