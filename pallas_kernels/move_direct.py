"""Direct move path (GPU): one launch, programs over (buffer, column band), no XLA work.

Each program owns a column band of one buffer (the same 16-byte items of every row; the
element itself for one-element rows) and its 128 threads hold that band of all moved rows
in registers: every thread loads its items, the program meets at a barrier (``bar.sync``:
every load of the program is performed), then every thread stores, skipping pairs with an
index out of range. No other program touches those bytes, so this is the snapshot for any
overlap, and int32 indices go into the kernel as they are. A duplicated target row may mix
its writers by 16-byte items (as the row kernels).

A unit is ``unit_rows`` consecutive rows (1 for token moves, ``page_size`` for small page
moves): thread items index rows of the moved units, and the kernel reads each row's pair
from ``row // unit_rows`` (page ids expand in the kernel, not in XLA).

A stacked buffer (``layers`` equal blocks of rows, a ``StackedMLAKVCache``'s layers) moves
the same pairs in every block: each block is a member of its own (its base address offset
by the block), so 61 stacked layers run the code and the programs of 61 separate buffers.

When the items do not fit the registers the path can run in rounds: XLA computes "any
source is another pair's target"; if none is, each round loads then stores; otherwise each
program first copies its band of all sources to a temporary, meets at a barrier, then
copies the temporary to the targets.

The code is written at the thread level (``inline_mgpu``) and picks each program's buffer
address with selects or uniform branches, so it exists once per row layout: 61 layers
lower in a fraction of a second. Interpret mode has no thread-level code and runs a
stand-in (the next path that takes the move) instead, with the same results.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels import move_common as mc


@dataclasses.dataclass(frozen=True)
class DirectGroup:
  """Buffers of one row layout, moved by the same code (only the base address differs)."""
  members: tuple[int, ...]  # buffer position * layers + layer (block of rows) within it
  first: int  # first program
  bands: int  # programs per member
  row_bytes: int
  item_bytes: int  # 16, or the element size of a one-element row
  band: int  # items of a row per program (a power of two)
  steps: int  # items per thread (per round)
  rounds: int = 1  # > 1: the rows are moved in rounds (needs the "any endangered" flag)


@dataclasses.dataclass(frozen=True)
class DirectPlan:
  tokens: int  # rows moved: pairs x unit_rows
  units: int  # units of a layer (rows // layers // unit_rows): the index range
  groups: tuple[DirectGroup, ...]
  programs: int
  select: str = "chain"  # how a program finds its buffer's address: "chain" or "tree"
  unit_rows: int = 1
  layers: int = 1  # blocks of rows per buffer, each moving the same pairs
  layer_rows: int = 0  # rows of a block (rows // layers)

  @property
  def in_rounds(self) -> bool:
    return any(g.rounds > 1 for g in self.groups)


def plan(buffers, num_units: int, unit_rows: int, tiling: mc.MoveTiling,
         layers: int = 1) -> DirectPlan | None:
  """Column bands per row layout, or None to hand the move to the next path.

  ``layers``: each buffer is that many equal blocks of rows, every block moving the
  ``num_units`` pairs (a member per block: limits and bands as for separate buffers).

  None when ``tiling.path`` is "auto" and the move is larger than the direct path's limits
  (``direct_max_tokens`` / ``direct_rounds_max_tokens`` rows for token moves,
  ``page_direct_max_rows`` for page moves), or when the rows do not fit the threads'
  registers and rounds are off.
  """
  tokens = num_units * unit_rows
  rounds = tiling.direct_rounds
  if rounds is None:  # rounds pay off where the streamed path is slow: one-element rows
    rounds = any(mc.row_bytes(b) % mc.BULK_ALIGN for b in buffers)
  if tiling.path == "auto":
    if unit_rows > 1:
      if tokens > tiling.page_direct_max_rows:
        return None
    elif tokens > tiling.direct_max_tokens and not (
        rounds and tokens <= tiling.direct_rounds_max_tokens):
      return None
  layouts: dict[tuple[int, int], list[int]] = {}
  for k, b in enumerate(buffers):
    row_bytes = mc.row_bytes(b)
    item = b.dtype.itemsize if row_bytes % mc.BULK_ALIGN else mc.BULK_ALIGN
    layouts.setdefault((row_bytes, item), []).extend(range(k * layers, (k + 1) * layers))
  total = layers * sum(mc.row_bytes(b) for b in buffers)
  limit = tiling.direct_items_per_thread
  groups, first = [], 0
  for (row_bytes, item), members in layouts.items():
    cols = row_bytes // item
    steps = lambda band: -(-tokens * band // mc.WARPGROUP)
    widest = 1
    while widest * 2 <= min(cols, 32) and steps(widest * 2) <= limit:
      widest *= 2
    if steps(widest) > limit and not rounds:
      return None
    if rounds and steps(min(2, cols)) > limit:
      # Rounds of ``limit`` items per thread, 32-byte sectors per row and warp (one
      # 16-byte item per lane and row writes half sectors: 704 us at T=4096 on the H200).
      band = min(2, cols)
      bands = -(-cols // band)
      groups.append(DirectGroup(tuple(members), first, bands, row_bytes, item, band,
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
    groups.append(DirectGroup(tuple(members), first, bands, row_bytes, item, band,
                              steps(band)))
    first += len(members) * bands
  select = tiling.direct_select
  if select == "auto":
    select = "tree" if len(groups) > 1 else "chain"
  layer_rows = buffers[0].shape[0] // layers
  return DirectPlan(tokens, layer_rows // unit_rows, tuple(groups), first, select, unit_rows,
                    layers, layer_rows)


def move(buffers, tgt, src, dplan: DirectPlan, *, pdl: bool, tiling: mc.MoveTiling,
         stand_in: Callable, interpret=None):
  """Moves units ``tgt[i] <- src[i]`` (int32, unchecked ranges) of every buffer.

  ``stand_in(buffers, tgt, src, interpret)``: the interpret-mode replacement (the next path
  that takes the move, run in interpret mode).
  """
  if interpret is not None:
    return stand_in(buffers, tgt, src, interpret)
  args = (tgt, src)
  if dplan.in_rounds:  # rounds need to know whether any source is some other pair's target
    tgt, src = mc.sanitize(tgt, src, dplan.units)
    save = mc.endangered(tgt, src, dplan.units, tiling.small_t_compare,
                         tiling.writer_period)
    args = (tgt, src, jnp.max(save, keepdims=True))

  # One jitted CUDA branch: the dispatcher's shape evaluation and its branch share a trace.
  cuda = jax.jit(functools.partial(
      mc.in_place, functools.partial(_kernel, plan=dplan, pdl=pdl), None))

  def build(interpreted: bool):
    if interpreted:
      return lambda buffers, tgt, src, *_: stand_in(buffers, tgt, src,
                                                     common.interpret_params())
    return cuda

  return common.dispatch(build, buffers, *args)


def _kernel(refs, tgt, src, *flag, plan: DirectPlan, pdl: bool, interpret):
  del interpret  # GPU only
  # Rounds: a temporary per buffer for the endangered case (an output: only its memory is
  # needed; dropped right after).
  temp_types = tuple(jax.ShapeDtypeStruct((plan.layers * plan.tokens, *r.shape[1:]), r.dtype)
                     for r in refs) if plan.in_rounds else ()

  def body(*args):
    tgt_gmem, src_gmem, *rest = args
    flag_gmem = rest.pop(0) if plan.in_rounds else None
    buffers, temps = rest[:len(refs)], rest[len(refs):]
    if pdl:
      plgpu.griddepcontrol_wait()
    copy_rows(plan, tgt_gmem, src_gmem, buffers, flag_gmem, temps)

  plgpu.kernel(
      body,
      out_type=temp_types,
      grid=(plan.programs,),
      grid_names=("job",),
      compiler_params=mc.compiler_params(),
  )(tgt, src, *flag, *refs)


def copy_rows(plan: DirectPlan, tgt_gmem, src_gmem, buffers, flag_gmem=None, temps=()):
  """Thread-level body of a direct program (Mosaic GPU IR through ``inline_mgpu``).

  Program ``p`` of group ``g`` moves items ``[band * B, band * B + B)`` (B = ``g.band``) of
  every moved row of member ``g.members[p // g.bands]`` (block ``member % layers`` of buffer
  ``member // layers``). Thread ``l`` takes item ``l % B``
  of moved rows ``l // B + s * (128 // B)`` for ``s < g.steps`` (plus ``g.steps * 128 // B``
  per round); moved row ``t`` is row ``t % unit_rows`` of the units of pair
  ``t // unit_rows``. The buffer's base address is chosen by selects or branches, so the
  code exists once per row layout, not once per buffer.

  One round: load every item, barrier, store. Several rounds: if no source is endangered
  (``flag_gmem[0] == 0``) each round loads then stores its items (no store can reach a row
  that is read); otherwise the program first copies all its source items to ``temps``
  (row = moved row), meets at a barrier, then copies the temporary to the targets.
  """
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  extra = (flag_gmem, *temps) if flag_gmem is not None else ()
  unit = plan.unit_rows

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
    lane = arith.remui(mgpu_utils.thread_idx(), c32(mc.WARPGROUP))

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

        def select_base(refs_, block_rows: int):
          def address_of(v):  # member v: block v % layers (of block_rows rows) of a buffer
            k, block = divmod(v, plan.layers)
            start = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(refs_[k]))
            return arith.addi(start, c64(block * block_rows * g.row_bytes)) if block else start

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

        base = select_base(bufs, plan.layer_rows)
        temp_base = select_base(temp_refs, plan.tokens) if g.rounds > 1 else None
        per_step = mc.WARPGROUP // g.band
        per_round = g.steps * per_step
        col = arith.addi(arith.muli(arith.remui(local, c32(g.bands)), c32(g.band)),
                         arith.remui(lane, c32(g.band)))
        col_ok = ult(col, c32(g.row_bytes // g.item_bytes))
        col_off = arith.muli(arith.extui(i64, arith.select(col_ok, col, c32(0))),
                             c64(g.item_bytes))
        token0 = arith.divui(lane, c32(g.band))
        if g.item_bytes == mc.BULK_ALIGN:
          item_ty = ir.VectorType.get([4], i32)
        else:
          item_ty = ir.IntegerType.get_signless(8 * g.item_bytes)

        def address(start, row):
          offset = arith.muli(arith.extui(i64, row), c64(g.row_bytes))
          return llvm.inttoptr(global_ptr, arith.addi(arith.addi(start, offset), col_off))

        def load(first_token, from_temp: bool):
          """This thread's items of moved rows from ``first_token`` (i32):
          (ok, target row, moved row, value)."""
          items = []
          for step in range(g.steps):
            token = arith.addi(first_token, arith.addi(token0, c32(step * per_step)))
            ok = col_ok
            if g.rounds > 1 or (step + 1) * per_step > plan.tokens:
              token_ok = ult(token, c32(plan.tokens))
              ok = arith.andi(ok, token_ok)
              token = arith.select(token_ok, token, c32(0))
            pair = token if unit == 1 else arith.divui(token, c32(unit))
            at = [arith.index_cast(index, pair)]
            tgt, src = memref.load(tgt_ref, at), memref.load(src_ref, at)
            ok = arith.andi(ok, arith.andi(ult(tgt, c32(plan.units)),
                                           ult(src, c32(plan.units))))
            src = arith.select(ok, src, c32(0))
            if unit > 1:  # unit index -> row (in range: index < units = rows // unit)
              within = arith.remui(token, c32(unit))
              tgt = arith.addi(arith.muli(tgt, c32(unit)), within)
              src = arith.addi(arith.muli(src, c32(unit)), within)
            where = address(temp_base, token) if from_temp else address(base, src)
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
