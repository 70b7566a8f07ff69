"""Mosaic GPU kernels that write and read token rows of the MLA cache, in place.

Public functions (arrays in, arrays out; the cache buffers are aliased, never copied)::

    set_rows(kv, loc, nope, rope, *, pdl=False) -> kv
    set_rows_per_token_head(nope_buf, scale_buf, rope_buf, loc, nope, rope, *, pdl=False)
        -> (nope_buf, scale_buf, rope_buf)
    get_rows(kv, loc, *, kv_lora_rank, dst_dtype, pdl=False) -> (nope, rope)
    get_rows_per_token_head(nope_buf, scale_buf, rope_buf, loc, *, dst_dtype, pdl=False)
        -> (nope, rope)

Shapes: kv (rows, 1, R+Rr); loc (T,) int32; nope (T, 1, R); rope (T, 1, Rr); per_token_head
buffers nope_buf (rows, 1, R) float8_e4m3fn, scale_buf (rows, 1, 1) float32, rope_buf
(rows, 1, Rr) model dtype. Rows outside [0, rows) are never touched: writes are skipped,
reads give zeros. Numerics: SPEC §3 (see `common.cast_from_f32`, `common.true_divide`).

Duplicate slots (several tokens of one call target the same row): on the GPU the writers'
bulk stores run concurrently and land in independent pieces (the nope and rope parts, and
16-byte chunks within them), so such a row holds, element by element, a value from one of
its writers: it may mix writers. For per_token_head each of the three buffers' elements of
that row comes from one of the writers, possibly different ones (q from one, scale from
another), so the row's dequantized values are garbage, as the padding page's are. No other
row changes. Interpret mode (CPU) gives the last writer's row. An exact "one writer wins"
would need a dedupe pass (a sort or a scatter-max over rows) that costs more than the whole
kernel at small T; callers that need a defined value must not send duplicate slots.

Design
------
Every kernel is a 1-D grid of programs (one warpgroup each); program b owns tokens
[t0, t0 + B) with t0 = min(b*B, T - B): the last block is shifted back to end at T (it
re-does a few tokens of its neighbour, writing identical bytes), so every copy is in bounds
and any T >= 1 works without masking the token range.

All data movement but the direct gather's (last below) uses the TMA engine's plain bulk
copies (``cp.async.bulk``: contiguous, 16-byte sizes and addresses, no 256-element box
limit and no tensor map), because a token row is contiguous in every buffer:

* set: the block's ``nope`` and ``rope`` slices (contiguous in the inputs) arrive in shared
  memory with two bulk loads on one barrier, while every thread reads the block's ``loc``
  scalars from global memory. Then each in-range token gets its row(s) written with bulk
  stores straight to ``kv[loc]`` (pl.when around each, so bad slots are skipped on every
  backend). The program waits only until the stores have *read* shared memory.
  - same dtype (pure copy): two stores per token (the nope part and the rope part of the
    row); ``RowConfig.set_repack`` instead assembles whole rows in shared memory through
    registers and writes one store per token.
  - dtype change / fp8 storage: registers cast the block (through f32, fp8 saturating)
    into a row-assembled buffer; one store per token.
  - per_token_head: registers compute amax per row (a warp-local shuffle reduction in
    `common.row_layout`, where each warp owns whole rows), the scale, the true-divided and
    clipped fp8 ``q`` and the divided rope; one store per token for each of q and rope, and
    the 4-byte scale (too small for a bulk copy) is a scalar global store.
* get: mirrors set. Each token's row(s) arrive with bulk loads on one barrier (from the
  cache row, or from row 0 when the slot is out of range, zeroed in shared memory once
  landed, so the barrier always sees the same number of arrivals); registers convert when
  needed; then one bulk store per output block (contiguous in the outputs).
* get, same dtype, rows whose nope and rope bytes split evenly over 128 threads (bf16 and
  f32 512 + 64; `direct_layouts`): no bulk copies at all. Each thread loads its bytes of
  the row with plain vector loads into registers and stores them to the outputs
  (`_get_rows_direct`, B = 1 to 4 tokens per program): no barrier, no shared memory, no
  fence. A one-program bulk load + store kernel takes 1.10 us on the H200, this gather
  1.01 us at T = 1, and it is faster up to T = 4096 as well (benchmarks/diag_direct.py).
* per_token_head set at T <= 256 (`RowConfig.direct_block_tokens` = 1; jax 0.11, see
  `ONE_TOKEN_SET`): no shared memory or bulk copies either (`_set_pth_direct`). One token
  a program; every warp loads the whole input row from global memory into registers
  (`common.whole_row_layout`), quantizes it as above, and stores the fp8 row, the rope row
  and the scale straight to the cache (the four warps store the same bytes). On an H100 1.36-1.37 vs 1.49-1.50 us at T = 1 (bf16 set
  1.21), 1.44-1.45 vs 1.62 at 128, equal at 384, slower from 512 (1.89 vs 1.77), where the
  block kernel's copies overlap (`benchmarks/diag_pth_direct.py`,
  logs/2026-12-05h_diag_pth_direct_h100.log).

Block size (`RowConfig`, `copy_block_tokens`, `reg_block_tokens`): B = ceil(T /
target_programs) clamped to [1, max_block_tokens] (32; 12 for kernels that go through
registers, whose shared-memory blocks are 4 mod 8 rows, see `common.reg_block_rows`; B
above 4 is rounded up to that row count so no register work is padding). target_programs
is 528, four programs per SM of an H200: the first version used 132 (one program per SM),
which at T=4096 gave 128 programs of 32 tokens, one per SM, each loading then storing with
nothing to overlap its phases, and one thread issuing all 64 of its copies. Small T gives
one token per program (lowest latency: one dependent load, then the copies).

Gathers read all of a block's slots before issuing any copy (`RowConfig.loc_prefetch`):
the first version read a slot, issued its copies, then read the next slot, and each read
waited behind the previous copy issue (B dependent round trips to L2 per program).
`RowConfig.chunks` splits a pure-copy block into stages with one barrier each so that
stores start while later stages still load. `benchmarks/sweep_rows.py` times the knobs on
the GPU; `LEGACY_CONFIG` is the first version's behaviour.

PDL (``pdl=True``): the kernel starts with ``griddepcontrol.wait`` (nothing is read before
the previous kernel's writes are visible) and then lets dependents launch. Never in
interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, exact
from pallas_kernels.common import F32

FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The one-token per_token_head set (`_set_pth_direct`) stores each token's scale, one float
# that every thread holds, straight to global memory. jax 0.12's transfer planner refuses
# that store ("does not access a whole number of complete 32 byte sectors"); there the
# block kernel runs instead (`RowConfig.direct_block_tokens` is ignored) until a store
# path that 0.12 accepts has been run on a GPU.
ONE_TOKEN_SET = jax.__version_info__ < (0, 12)
AMAX_FLOOR = np.float32(1e-26)
INV_FP8_MAX = np.float32(1.0) / np.float32(448.0)  # == float32(1/448), as PyTorch


@dataclasses.dataclass(frozen=True)
class RowConfig:
  """Static tiling knobs of the row kernels (`benchmarks/sweep_rows.py` times them).

  Attributes:
    max_block_tokens: most tokens per program for the pure-copy kernels.
    max_reg_block_tokens: most tokens per program for kernels that pass rows through
      registers (casts, quantization, repacking). Best 4 mod 8 (see `common.reg_block_rows`).
    target_programs: below the maxima, B is chosen to give about this many programs.
      528 = 4 programs per SM of an H100/H200 (132 SMs): while one program of an SM waits
      for its loads another one's stores run, and one program's single issuing thread is
      not the only source of copies on its SM. (132, one program per SM, is the old choice.)
    set_repack: same-dtype set_rows assembles whole rows in shared memory (registers) and
      writes one bulk store per token instead of two.
    get_split: same-dtype get_rows loads each row as two bulk copies straight into the
      nope and rope output blocks (no registers); False loads whole rows and splits them
      in registers.
    loc_prefetch: the gather kernels read all of their block's ``loc`` scalars before
      issuing any copy (one global-memory round trip). False is the old order: read a
      slot, issue its copies, read the next slot (each read waits behind the previous copy
      issue, B dependent round trips per program).
    chunks: the pure-copy kernels and the per_token_head set split their block into this
      many stages with one barrier each (the largest divisor of B not above it): stage c
      is stored (per_token_head: quantized, then stored) as soon as it has landed in
      shared memory, while later stages still load. 1 = one barrier for the whole block.
    reg_fill: register kernels round B (when above 4) up to the rows their shared-memory
      block has anyway (`common.reg_block_rows`, 4 mod 8), within max_reg_block_tokens and
      T, so no registers work on padding rows. False keeps B as computed.
    direct_block_tokens: same-dtype get_rows moves rows with plain vector loads and stores
      through registers (no shared memory, barrier or bulk copy), this many tokens per
      program; 0 = bulk copies (`get_split`). Taken only where the row parts split evenly
      over a warpgroup's 128 threads as bytes (bf16 and f32 rows of DeepSeek's 512 + 64).
      The per_token_head set takes 1 (one token a program, `_set_pth_direct`; jax < 0.12,
      see `ONE_TOKEN_SET`) or 0.
    kernel_tag: appended to the kernel names (e.g. to tell variants apart in a profile).
  """

  max_block_tokens: int = 32
  max_reg_block_tokens: int = 12
  target_programs: int = 528
  set_repack: bool = False
  get_split: bool = True
  loc_prefetch: bool = True
  chunks: int = 1
  reg_fill: bool = True
  direct_block_tokens: int = 0
  kernel_tag: str = ""


DEFAULT_CONFIG = RowConfig()
# The first version's choices (one program per SM, B up to 32 / 28, slot-by-slot gathers).
LEGACY_CONFIG = RowConfig(max_reg_block_tokens=28, target_programs=132, loc_prefetch=False,
                          chunks=1, reg_fill=False)


# Per-T choices measured by benchmarks/sweep_rows.py on one H200 (2026-12-02,
# benchmarks/results/logs/2026-12-02_sweep_rows.log): (upper bound of T, config).
TUNED_CONFIGS = {
    "set": ((64, DEFAULT_CONFIG), (512, LEGACY_CONFIG),
            (None, dataclasses.replace(DEFAULT_CONFIG, chunks=2))),
    # get: plain loads and stores (direct_block_tokens) where the row allows them, measured
    # by benchmarks/diag_direct.py (2026-12-04, logs/2026-12-04_diag_direct.log): B = 1 up
    # to T = 64, 2 at T = 512, 4 at T = 2048 ... 32768 (T = 1024 interpolated). The bulk-copy
    # knobs stay for rows without such a split (fp8 storage: 64 rope bytes).
    "get": ((64, dataclasses.replace(DEFAULT_CONFIG, direct_block_tokens=1)),
            (512, dataclasses.replace(DEFAULT_CONFIG, target_programs=264,
                                      direct_block_tokens=2)),
            (1024, dataclasses.replace(DEFAULT_CONFIG, direct_block_tokens=2)),
            (4096, dataclasses.replace(DEFAULT_CONFIG, direct_block_tokens=4)),
            (None, dataclasses.replace(DEFAULT_CONFIG, max_block_tokens=16,
                                       direct_block_tokens=4))),
    # per_token_head set above T = 4096: B = 8 in two stages of 4 (the loads of both issued
    # first, the first quantized and stored while the second lands): 18.3 / 18.5 us at
    # T = 32768 vs 20.7 for B = 4 in one stage; at 4096 one stage of 4 stays faster (3.42 vs
    # 3.69). Two runs on one H200, 2026-12-05e (logs/2026-12-05e_sweep_rows_pth*.log).
    # Up to T = 256 one token a program with plain loads and stores (direct_block_tokens=1):
    # 1.12-1.23x the bf16 set there against 1.24-1.36x for the block kernel, equal at 384,
    # slower from 512 (H100, 2026-12-05h, logs/2026-12-05h_diag_pth_direct_h100.log).
    "set_per_token_head": ((256, dataclasses.replace(DEFAULT_CONFIG, direct_block_tokens=1)),
                           (512, LEGACY_CONFIG),
                           (4096, dataclasses.replace(DEFAULT_CONFIG, max_reg_block_tokens=4)),
                           (None, dataclasses.replace(DEFAULT_CONFIG, max_reg_block_tokens=8,
                                                      chunks=2))),
    "get_per_token_head": ((None, DEFAULT_CONFIG),),
}


def tuned_config(op: str, num_tokens: int) -> RowConfig:
  """The measured-best RowConfig for `op` at T = num_tokens (the default of every kernel)."""
  for bound, config in TUNED_CONFIGS[op]:
    if bound is None or num_tokens <= bound:
      return config
  raise AssertionError("unreachable: the last bound is None")


def block_tokens(num_tokens: int, max_tokens: int, target_programs: int) -> int:
  """Tokens per program for a call with `num_tokens` tokens (>= 1, <= num_tokens)."""
  b = -(-num_tokens // max(target_programs, 1))
  return max(1, min(b, max_tokens, num_tokens))


def copy_block_tokens(num_tokens: int, config: RowConfig) -> int:
  """B of the pure-copy kernels."""
  return block_tokens(num_tokens, config.max_block_tokens, config.target_programs)


def reg_block_tokens(num_tokens: int, config: RowConfig) -> int:
  """B of the kernels that go through registers (see `RowConfig.reg_fill`)."""
  b = block_tokens(num_tokens, config.max_reg_block_tokens, config.target_programs)
  if config.reg_fill and b > 4:
    b = max(b, min(common.reg_block_rows(b), config.max_reg_block_tokens, num_tokens))
  return b


def stage_count(B: int, chunks: int) -> int:
  """Stages of a pure-copy block: the largest divisor of B that is <= chunks (>= 1)."""
  return max(c for c in range(1, max(1, min(chunks, B)) + 1) if B % c == 0)


# ----------------------------------------------------------------------------------------
# Validation helpers (trace time).


def _check_loc(loc) -> None:
  if loc.ndim != 1 or not jnp.issubdtype(loc.dtype, jnp.integer):
    raise TypeError(f"loc must be a 1-D integer array, got {loc.dtype}{list(loc.shape)}")


def _check_float(name, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got {x.dtype}")
  if jnp.dtype(x.dtype) not in common.STORAGE_DTYPES:
    raise common.Unsupported(
        f"{name}: the kernels read {', '.join(d.name for d in common.STORAGE_DTYPES)} "
        f"inputs, got {x.dtype}")


def _check_dst(dst_dtype) -> jnp.dtype:
  dst = jnp.dtype(dst_dtype)
  if dst not in common.STORAGE_DTYPES:
    raise TypeError(
        f"dst_dtype must be one of {', '.join(d.name for d in common.STORAGE_DTYPES)}, "
        f"got {dst}")
  return dst


def _check_tokens(name, x, T, width) -> None:
  if x.shape != (T, 1, width):
    raise ValueError(f"{name} must have shape {(T, 1, width)}, got {x.shape}")


def _check_buffer(name, x, dtypes) -> None:
  if x.ndim != 3 or x.shape[1] != 1:
    raise ValueError(f"{name} must have shape (rows, 1, width), got {x.shape}")
  if jnp.dtype(x.dtype) not in dtypes:
    raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {x.dtype}")


def _check_bulk(name, width, dtype) -> None:
  if (width * jnp.dtype(dtype).itemsize) % common.BULK_ALIGN:
    raise common.Unsupported(
        f"{name}: a row of {width} x {jnp.dtype(dtype)} is not a multiple of 16 bytes"
    )


def _pdl_prologue(pdl: bool, interpret: bool) -> None:
  if pdl and not interpret:
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()


def _kernel(body, *, out_type, scratch, grid, name, interpret, grid_names=("b",)):
  return plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch,
      grid=grid if isinstance(grid, tuple) else (grid,),
      grid_names=grid_names,
      kernel_name=name,
      # Every shared-memory hand-off in these kernels is synchronized explicitly
      # (barrier_wait after bulk loads, commit_smem before bulk stores and before reading
      # what other threads stored), so Mosaic's conservative automatic warpgroup barriers
      # (one per bulk copy otherwise) are not needed.
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
      interpret=common.interpret_params() if interpret else None,
  )


def store_rows(slots, rows: int, blocks=(), scalars=()) -> None:
  """For each in-range slot r = slots[i]: bulk-store row i of every (smem block, gmem buffer)
  pair of `blocks` to row r, and element i of every (smem vector, gmem vector) pair of
  `scalars` (too small for a bulk copy) with a scalar store. Out-of-range slots store
  nothing (pl.when: skipped on every backend). The caller commits the bulk group."""
  for i, r in enumerate(slots):
    @pl.when(common.valid_row(r, rows))
    def _():
      for src, dst in blocks:
        plgpu.copy_smem_to_gmem(src.at[i], dst.at[r], commit_group=False)
      for src, dst in scalars:
        dst[r] = src[i]


def _block_start(B: int, T: int):
  b = jax.lax.axis_index("b")
  return jnp.minimum(b * B, T - B)


_PROMISE = dict(oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)


def _issue_token_loads(loc_ref, stage_blocks, bar, *, B: int, T: int, pdl: bool,
                       interpret: bool):
  """The write kernels' start: bulk-load the program's B input rows, in stages of
  n = B / len(stage_blocks) tokens, stage c's (gmem input, smem destination of n rows)
  pairs on barrier c (`_bar`); then read the B slots. Every load is issued before the
  first slot read; nothing is waited for. Returns the slots."""
  _pdl_prologue(pdl, interpret)
  t0 = _block_start(B, T)
  stages = len(stage_blocks)
  n = B // stages
  for c, pairs in enumerate(stage_blocks):
    for src, dst in pairs:
      plgpu.copy_gmem_to_smem(src.at[pl.ds(t0 + c * n, n)], dst, _bar(bar, c, stages),
                              **_PROMISE)
  return [loc_ref[t0 + i] for i in range(B)]


def _load_tokens(loc_ref, blocks, bar, *, B: int, T: int, pdl: bool, interpret: bool):
  """`_issue_token_loads` in one stage into rows [0, B) of each (gmem input, smem block)
  pair, then wait for them. Returns the slots."""
  rs = _issue_token_loads(loc_ref, [[(src, dst.at[pl.ds(0, B)]) for src, dst in blocks]],
                          bar, B=B, T=T, pdl=pdl, interpret=interpret)
  plgpu.barrier_wait(bar)
  return rs


def _barriers(num_arrivals: int, stages: int):
  """One barrier (stages == 1, the original kernels) or one per stage."""
  if stages == 1:
    return plgpu.Barrier(num_arrivals=num_arrivals)
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=stages)


def _bar(bar, c: int, stages: int):
  return bar if stages == 1 else bar.at[c]


def _stage(ref, start: int, n: int, stages: int):
  """Rows [start, start + n) of a shared-memory block (the whole ref for one stage)."""
  return ref if stages == 1 else ref.at[pl.ds(start, n)]


# ----------------------------------------------------------------------------------------
# set_rows


def set_rows(kv, loc, nope, rope, *, pdl: bool = False, config: RowConfig | None = None,
             sanitize: bool = False):
  """Write rows ``kv[loc[i]] = concat(nope[i], rope[i])`` cast to kv.dtype, in place.

  fp8 storage saturates at the format's max finite value (NaN stays NaN); all casts are
  round-to-nearest-even through float32. Slots outside [0, rows) are skipped.
  `sanitize` (SPEC §9): NaN is stored as 0 and values beyond kv.dtype's largest finite
  value (+-inf included) as that value with their sign, in the same kernel (the row then
  goes through registers even when no cast is needed).
  """
  config = config or tuned_config("set", int(loc.shape[0]))
  _check_buffer("kv", kv, common.STORAGE_DTYPES)
  _check_loc(loc)
  T = loc.shape[0]
  rows, W = kv.shape[0], kv.shape[2]
  _check_float("nope", nope)
  _check_float("rope", rope)
  R = nope.shape[-1]
  Rr = W - R
  _check_tokens("nope", nope, T, R)
  _check_tokens("rope", rope, T, Rr)
  if T == 0:
    return kv
  loc = exact.index_to_int32(loc)
  dtype = jnp.dtype(kv.dtype)
  same = (
      jnp.dtype(nope.dtype) == dtype
      and jnp.dtype(rope.dtype) == dtype
      and dtype != jnp.dtype(jnp.float8_e5m2)  # e5m2 inputs may hold inf: saturate
      and not sanitize
  )
  for name, width, dt in (("kv", W, dtype), ("kv nope part", R, dtype),
                          ("nope", R, nope.dtype), ("rope", Rr, rope.dtype)):
    _check_bulk(name, width, dt)
  registers = not same or config.set_repack
  if registers and (common.row_layout_vec(R) is None or common.row_layout_vec(Rr) is None):
    # No register layout for this width: cast with XLA (saturating, so the rows are
    # final storage values), then the pure-copy kernel.
    nope, rope = common.cast_to(nope, dtype, sanitize), common.cast_to(rope, dtype, sanitize)
    registers = False
  if not registers:
    B = copy_block_tokens(T, config)
    build = functools.partial(
        _set_rows_copy, T=T, rows=rows, R=R, Rr=Rr, dtype=dtype, B=B, pdl=pdl,
        stages=stage_count(B, config.chunks), tag=config.kernel_tag,
    )
  else:
    B = reg_block_tokens(T, config)
    build = functools.partial(
        _set_rows_regs, T=T, rows=rows, R=R, Rr=Rr, dtype=dtype,
        in_dtypes=(jnp.dtype(nope.dtype), jnp.dtype(rope.dtype)), B=B, pdl=pdl,
        tag=config.kernel_tag, sanitize=sanitize,
    )
  out = common.dispatch(
      build, kv.reshape(rows, W), loc, common.as_rows(nope), common.as_rows(rope)
  )
  return out.reshape(rows, 1, W)


def _set_rows_copy(interpret, *, T, rows, R, Rr, dtype, B, pdl, stages=1, tag=""):
  n = B // stages  # tokens per stage

  def body(loc_ref, n_ref, r_ref, kv_ref, nsm, rsm, bar):
    rs = _issue_token_loads(
        loc_ref, [[(n_ref, _stage(nsm, c * n, n, stages)), (r_ref, _stage(rsm, c * n, n, stages))]
                  for c in range(stages)],
        bar, B=B, T=T, pdl=pdl, interpret=interpret)
    for c in range(stages):
      plgpu.barrier_wait(_bar(bar, c, stages))
      for i in range(c * n, (c + 1) * n):
        r = rs[i]

        @pl.when(common.valid_row(r, rows))
        def _():
          plgpu.copy_smem_to_gmem(nsm.at[i], kv_ref.at[r, pl.ds(0, R)], commit_group=False)
          plgpu.copy_smem_to_gmem(rsm.at[i], kv_ref.at[r, pl.ds(R, Rr)], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = _kernel(
      body, out_type=(), grid=pl.cdiv(T, B), name="mla_set_rows" + tag, interpret=interpret,
      scratch=[plgpu.SMEM((B, R), dtype), plgpu.SMEM((B, Rr), dtype),
               _barriers(2, stages)],
  )

  def run(kv2, loc, n2, r2):
    kv_ref = jax.new_ref(kv2)
    kernel(loc, n2, r2, kv_ref)
    return jax.freeze(kv_ref)

  return run


def _set_rows_regs(interpret, *, T, rows, R, Rr, dtype, in_dtypes, B, pdl, tag="",
                   sanitize=False):
  Bc = common.reg_block_rows(B)
  W = R + Rr
  # Element-wise casts: strided layouts (they can store into the strided row parts).
  ln = common.strided_layout((Bc, R), in_dtypes[0], dtype)
  lr = common.strided_layout((Bc, Rr), in_dtypes[1], dtype)

  def body(loc_ref, n_ref, r_ref, kv_ref, nsm, rsm, osm, bar):
    rs = _load_tokens(loc_ref, [(n_ref, nsm), (r_ref, rsm)], bar, B=B, T=T, pdl=pdl,
                      interpret=interpret)
    osm.at[:, pl.ds(0, R)][...] = common.cast_to(plgpu.load(nsm, layout=ln), dtype, sanitize)
    osm.at[:, pl.ds(R, Rr)][...] = common.cast_to(plgpu.load(rsm, layout=lr), dtype, sanitize)
    plgpu.commit_smem()
    store_rows(rs, rows, [(osm, kv_ref)])
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = _kernel(
      body, out_type=(), grid=pl.cdiv(T, B), name="mla_set_rows_cast" + tag, interpret=interpret,
      scratch=[plgpu.SMEM((Bc, R), in_dtypes[0]), plgpu.SMEM((Bc, Rr), in_dtypes[1]),
               plgpu.SMEM((Bc, W), dtype), plgpu.Barrier(num_arrivals=2)],
  )

  def run(kv2, loc, n2, r2):
    kv_ref = jax.new_ref(kv2)
    kernel(loc, n2, r2, kv_ref)
    return jax.freeze(kv_ref)

  return run


# ----------------------------------------------------------------------------------------
# set_rows_per_token_head


def set_rows_per_token_head(
    nope_buf, scale_buf, rope_buf, loc, nope, rope, *, pdl: bool = False,
    config: RowConfig | None = None, sanitize: bool = False,
):
  """Quantize token rows (SPEC §3) and write them to the three buffers, in one kernel.

  Per row, in float32: amax = max|nope|; scale = max(amax, 1e-26) * float32(1/448);
  q = clip(nope / scale, -448, 448) -> float8_e4m3fn; rope_stored = (rope / scale) ->
  rope_buf.dtype; true IEEE divisions, round-to-nearest-even; NaN propagates.
  `sanitize` (SPEC §9): see `quantize_block`.
  """
  config = config or tuned_config("set_per_token_head", int(loc.shape[0]))
  _check_buffer("nope_buf", nope_buf, (FP8_E4M3,))
  _check_buffer("scale_buf", scale_buf, (jnp.dtype(F32),))
  _check_buffer("rope_buf", rope_buf, common.MODEL_DTYPES)
  _check_loc(loc)
  T = loc.shape[0]
  rows, R, Rr = nope_buf.shape[0], nope_buf.shape[2], rope_buf.shape[2]
  if scale_buf.shape != (rows, 1, 1) or rope_buf.shape[0] != rows:
    raise ValueError(
        f"buffers disagree: nope_buf {nope_buf.shape}, scale_buf {scale_buf.shape} "
        f"(expected {(rows, 1, 1)}), rope_buf {rope_buf.shape}"
    )
  _check_float("nope", nope)
  _check_float("rope", rope)
  _check_tokens("nope", nope, T, R)
  _check_tokens("rope", rope, T, Rr)
  if T == 0:
    return nope_buf, scale_buf, rope_buf
  if common.row_layout_vec(R) is None or common.row_layout_vec(Rr) is None:
    raise common.Unsupported(
        f"per_token_head kernel needs R and Rr multiples of 32, got R={R}, Rr={Rr}"
    )
  if config.direct_block_tokens not in (0, 1):
    raise ValueError("the per_token_head set takes direct_block_tokens 0 or 1, got "
                     f"{config.direct_block_tokens}")
  operands = (nope_buf.reshape(rows, R), scale_buf.reshape(rows), rope_buf.reshape(rows, Rr),
              exact.index_to_int32(loc), common.as_rows(nope), common.as_rows(rope))
  in_dtypes = (jnp.dtype(nope.dtype), jnp.dtype(rope.dtype))
  if config.direct_block_tokens and ONE_TOKEN_SET:
    build = functools.partial(
        _set_pth_direct, T=T, rows=rows, R=R, Rr=Rr, rope_dtype=jnp.dtype(rope_buf.dtype),
        in_dtypes=in_dtypes, pdl=pdl, tag=config.kernel_tag, sanitize=sanitize)
    q, s, r = common.dispatch(build, *operands)
    return q.reshape(rows, 1, R), s.reshape(rows, 1, 1), r.reshape(rows, 1, Rr)
  for name, width, dt in (("nope_buf", R, FP8_E4M3), ("rope_buf", Rr, rope_buf.dtype),
                          ("nope", R, nope.dtype), ("rope", Rr, rope.dtype)):
    _check_bulk(name, width, dt)
  B = reg_block_tokens(T, config)
  build = functools.partial(
      _set_pth, T=T, rows=rows, R=R, Rr=Rr, rope_dtype=jnp.dtype(rope_buf.dtype),
      in_dtypes=in_dtypes, B=B, pdl=pdl, stages=stage_count(B, config.chunks),
      tag=config.kernel_tag, sanitize=sanitize,
  )
  q, s, r = common.dispatch(build, *operands)
  return q.reshape(rows, 1, R), s.reshape(rows, 1, 1), r.reshape(rows, 1, Rr)


def quantize_block(x, y, *, ln, lr, rope_dtype, interpret, sanitize_limits=None,
                   valid_rows=None, x_dtype=None):
  """SPEC §3 on register blocks, shared by every per_token_head write kernel.

  Args:
    x: (rows, R) float32 nope values in the row layout `ln` (`common.row_layout`; for one
      row also `common.whole_row_layout`).
    y: (rows, Rr) float32 rope values in the row layout `lr`.
    valid_rows: None, or the static number of leading rows that hold tokens. The rows
      after them (the block's padding: uninitialized shared memory) are set to 1 first:
      garbage there can be NaN, inf, zero or subnormal, and any of those sends
      ``div.rn.f32`` down its slow path (`common.true_divide`; H200, one token:
      3.7 us with garbage or zero padding, 1.72 us with ones). For bf16 / f16 nope values
      (`common.scale_divide`: multiplies and fmas, no slow path) only the rope values and
      the padding rows' scales are set to 1 (a select on 64 columns and one a row instead
      of one on all 512).
    sanitize_limits: None, or (x_limit, y_limit) for SPEC §9: NaN -> 0 and +-inf ->
      +-limit (the largest finite values of the input dtypes) before quantizing, and a
      rope quotient beyond rope_dtype's range clamped to its largest finite value.
    x_dtype: the dtype x's values came from. bf16 / f16 (short significands): the nope
      quotients by `common.scale_divide` (one reciprocal a row and a correction, the same
      IEEE quotients); otherwise one ``div.rn.f32`` a value (`common.true_divide`). The
      rope quotients always divide: the row's amax does not bound them. (The same
      correction for them, with a predicated ``div.rn.f32`` wherever a step could leave
      float32's normal range, was exact on the H200 but slower: one token 1.41 vs 1.35 us,
      T=4096 3.47 vs 3.27, logs/2026-12-04c_*.)
  Returns:
    (q (rows, R) float8_e4m3fn, rope_stored (rows, Rr) rope_dtype, scale (rows,) float32).
  """
  padded = valid_rows is not None and valid_rows < x.shape[0]
  short = x_dtype is not None and jnp.dtype(x_dtype) in common.SHORT_SIGNIFICAND_DTYPES
  if padded:
    if not short:   # (`scale_divide` has no slow path: its padding rows only need a scale)
      x = _fill_rows_from(x, valid_rows, ln, interpret)
    y = _fill_rows_from(y, valid_rows, lr, interpret)
  if sanitize_limits is not None:
    x = common.sanitize_f32(x, sanitize_limits[0])
    y = common.sanitize_f32(y, sanitize_limits[1])
  amax = jnp.max(jnp.abs(x), axis=1)
  scale = jnp.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX
  if padded and short:
    scale = _fill_rows_from(scale, valid_rows, ln.reduce(1), interpret)
  if short:
    quotient = common.scale_divide(x, scale, interpret, ln, ln.reduce(1))
  else:
    quotient = common.true_divide(x, scale, interpret, ln)
  q = _to_fp8(quotient, interpret)
  rope = common.true_divide(y, scale, interpret, lr)
  if sanitize_limits is not None:
    limit = common.finite_max(rope_dtype)
    rope = jnp.clip(rope, -limit, limit)
  return q, common.cast_from_f32(rope, rope_dtype), scale


def _to_fp8(quotient, interpret: bool):
  """float32 quotients (|q| <= 448 up to rounding, or NaN) -> float8_e4m3fn, SPEC §3. Mosaic
  GPU converts with ``cvt.rn.satfinite`` (NaN stays NaN, beyond +-448 gives +-448), so the
  clip of `common.cast_from_f32` would only add two instructions a value there; interpret
  mode needs it (XLA's convert gives NaN past the range)."""
  if interpret:
    return common.cast_from_f32(quotient, FP8_E4M3)
  return quotient.astype(FP8_E4M3)


def _fill_rows_from(x, n: int, layout, interpret: bool):
  """x (rows, ...) with rows n.. set to 1 (a select on registers)."""
  rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=None if interpret else layout)
  return jnp.where(rows < n, x, jnp.ones_like(x))


def _pth_in_place(kernel):
  """run(q2, s1, r2, loc, n2, rr2) for a per_token_head write kernel: the three cache
  buffers become refs (the kernel writes them in place), loc and the inputs stay arrays."""
  def run(q2, s1, r2, loc, n2, rr2):
    refs = [jax.new_ref(a) for a in (q2, s1, r2)]
    kernel(loc, n2, rr2, *refs)
    return tuple(jax.freeze(ref) for ref in refs)

  return run


def _set_pth(interpret, *, T, rows, R, Rr, rope_dtype, in_dtypes, B, pdl, stages=1, tag="",
             sanitize=False):
  """The per_token_head set kernel: B tokens a program in `stages` stages of n = B / stages
  tokens, each with its own shared-memory blocks and barrier: every stage's loads are
  issued first, then stage c is quantized and stored while stages after it still land."""
  n = B // stages
  Bc = common.reg_block_rows(n)
  limits = tuple(map(common.finite_max, in_dtypes)) if sanitize else None
  ln = common.row_layout(R, in_dtypes[0], FP8_E4M3)
  lr = common.row_layout(Rr, in_dtypes[1], rope_dtype)

  def body(loc_ref, n_ref, r_ref, qb_ref, sb_ref, rb_ref, *scratch):
    blocks, bar = [scratch[5 * c:5 * c + 5] for c in range(stages)], scratch[-1]
    rs = _issue_token_loads(
        loc_ref, [[(n_ref, nsm.at[pl.ds(0, n)]), (r_ref, rsm.at[pl.ds(0, n)])]
                  for nsm, rsm, *_ in blocks],
        bar, B=B, T=T, pdl=pdl, interpret=interpret)
    for c, (nsm, rsm, qsm, rosm, ssm) in enumerate(blocks):
      plgpu.barrier_wait(_bar(bar, c, stages))
      qsm[...], rosm[...], ssm[...] = quantize_block(
          plgpu.load(nsm, layout=ln).astype(F32), plgpu.load(rsm, layout=lr).astype(F32),
          ln=ln, lr=lr, rope_dtype=rope_dtype, interpret=interpret, sanitize_limits=limits,
          valid_rows=n, x_dtype=in_dtypes[0])
      plgpu.commit_smem()  # fence for the bulk stores + warpgroup barrier for ssm reads
      store_rows(rs[c * n:(c + 1) * n], rows, [(qsm, qb_ref), (rosm, rb_ref)],
                 [(ssm, sb_ref)])
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  stage_blocks = [plgpu.SMEM((Bc, R), in_dtypes[0]), plgpu.SMEM((Bc, Rr), in_dtypes[1]),
                  plgpu.SMEM((Bc, R), FP8_E4M3), plgpu.SMEM((Bc, Rr), rope_dtype),
                  plgpu.SMEM((Bc,), F32)]
  kernel = _kernel(
      body, out_type=(), grid=pl.cdiv(T, B), name="mla_set_rows_per_token_head" + tag,
      interpret=interpret, scratch=stage_blocks * stages + [_barriers(2, stages)],
  )

  return _pth_in_place(kernel)


def _set_pth_direct(interpret, *, T, rows, R, Rr, rope_dtype, in_dtypes, pdl, tag="",
                    sanitize=False):
  """The per_token_head set without shared memory: program t loads token t's rows from
  global memory into registers (`common.whole_row_layout`: each warp holds the whole row),
  quantizes them (`quantize_block` on one row) and, for an in-range slot, stores the fp8
  row, the rope row and the scale straight to the cache (the four warps store the same
  bytes)."""
  limits = tuple(map(common.finite_max, in_dtypes)) if sanitize else None
  ln = common.whole_row_layout(R, in_dtypes[0], FP8_E4M3)
  lr = common.whole_row_layout(Rr, in_dtypes[1], rope_dtype)

  def body(loc_ref, n_ref, r_ref, qb_ref, sb_ref, rb_ref):
    _pdl_prologue(pdl, interpret)
    t = jax.lax.axis_index("b")
    r = loc_ref[t]
    # (optimized=False: Mosaic's optimized transfers are for shared memory only)
    x = plgpu.load(n_ref.at[pl.ds(t, 1)], layout=ln, optimized=False).astype(F32)
    y = plgpu.load(r_ref.at[pl.ds(t, 1)], layout=lr, optimized=False).astype(F32)
    q, rope, scale = quantize_block(x, y, ln=ln, lr=lr, rope_dtype=rope_dtype,
                                    interpret=interpret, sanitize_limits=limits,
                                    x_dtype=in_dtypes[0])

    @pl.when(common.valid_row(r, rows))
    def _():
      qb_ref.at[pl.ds(r, 1)][...] = q
      rb_ref.at[pl.ds(r, 1)][...] = rope
      sb_ref.at[pl.ds(r, 1)][...] = scale

  kernel = plgpu.kernel(
      body, out_type=(), grid=(T,), grid_names=("b",),
      kernel_name="mla_set_rows_per_token_head_direct" + tag,
      interpret=common.interpret_params() if interpret else None)

  return _pth_in_place(kernel)


# ----------------------------------------------------------------------------------------
# get_rows


def get_rows(kv, loc, *, kv_lora_rank: int, dst_dtype, pdl: bool = False,
             config: RowConfig | None = None):
  """Gather rows ``kv[loc]`` as (nope (T,1,R), rope (T,1,Rr)) cast to dst_dtype.

  Out-of-range slots read as zeros. Casts go through float32; an fp8 dst_dtype saturates.
  """
  config = config or tuned_config("get", int(loc.shape[0]))
  _check_buffer("kv", kv, common.STORAGE_DTYPES)
  _check_loc(loc)
  rows, W = kv.shape[0], kv.shape[2]
  R = int(kv_lora_rank)
  Rr = W - R
  if not 0 < R < W:
    raise ValueError(f"kv_lora_rank must be in (0, {W}), got {kv_lora_rank}")
  dst = _check_dst(dst_dtype)
  T = loc.shape[0]
  if T == 0:
    return jnp.zeros((0, 1, R), dst), jnp.zeros((0, 1, Rr), dst)
  dtype = jnp.dtype(kv.dtype)
  for name, width, dt in (("kv", W, dtype), ("kv nope part", R, dtype),
                          ("nope", R, dst), ("rope", Rr, dst)):
    _check_bulk(name, width, dt)
  same = dst == dtype and dtype != jnp.dtype(jnp.float8_e5m2)
  direct = direct_layouts(R, Rr, dtype) if same and config.direct_block_tokens else None
  if direct is not None:
    B = min(config.direct_block_tokens, T)
    build = functools.partial(
        _get_rows_direct, T=T, rows=rows, layouts=direct, B=B, pdl=pdl,
        tag=config.kernel_tag,
    )
    nope, rope = common.dispatch(build, as_bytes(kv.reshape(rows, W)),
                                 exact.index_to_int32(loc))
    return from_bytes(nope, dtype).reshape(T, 1, R), from_bytes(rope, dtype).reshape(T, 1, Rr)
  registers = not (same and config.get_split)
  # No register layout for this width: gather the stored rows with the pure-copy kernel,
  # then convert them with XLA.
  convert_after = registers and (
      common.row_layout_vec(R) is None or common.row_layout_vec(Rr) is None)
  if not registers or convert_after:
    B = copy_block_tokens(T, config)
    build = functools.partial(
        _get_rows_copy, T=T, rows=rows, R=R, Rr=Rr, dtype=dtype, B=B, pdl=pdl,
        stages=stage_count(B, config.chunks), prefetch=config.loc_prefetch,
        tag=config.kernel_tag,
    )
  else:
    B = reg_block_tokens(T, config)
    build = functools.partial(
        _get_rows_regs, T=T, rows=rows, R=R, Rr=Rr, dtype=dtype, dst=dst, B=B, pdl=pdl,
        prefetch=config.loc_prefetch, tag=config.kernel_tag,
    )
  nope, rope = common.dispatch(build, kv.reshape(rows, W), exact.index_to_int32(loc))
  nope, rope = nope.reshape(T, 1, R), rope.reshape(T, 1, Rr)
  if convert_after:
    return common.cast_to(nope, dst), common.cast_to(rope, dst)
  return nope, rope


def as_bytes(x: jax.Array) -> jax.Array:
  """(..., n) of any dtype -> (..., n * itemsize) uint8, the same bytes (an XLA bitcast)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], -1)


def from_bytes(x: jax.Array, dtype) -> jax.Array:
  """The inverse of `as_bytes`: (..., m) uint8 -> (..., m / itemsize) of dtype."""
  n = jnp.dtype(dtype).itemsize
  if n == 1:
    return jax.lax.bitcast_convert_type(x, dtype)
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, n), dtype)


def direct_layouts(R: int, Rr: int, dtype):
  """Register layouts of a row's nope and rope bytes split over a warpgroup (each thread
  loads vec bytes per access, up to 16), or None where a part does not split evenly over
  128 threads (e.g. the 64 rope bytes of an fp8 row)."""
  out = []
  for nbytes in (R * jnp.dtype(dtype).itemsize, Rr * jnp.dtype(dtype).itemsize):
    vec = next((v for v in (16, 8, 4, 2, 1) if nbytes % (128 * v) == 0), None)
    if vec is None:
      return None
    out.append((nbytes, vec))
  return tuple(out)


def _get_rows_direct(interpret, *, T, rows, layouts, B, pdl, tag=""):
  """Gather without bulk copies: each token's nope and rope bytes are one strided register
  load each from the cache and one store each to the outputs. A bad slot loads row 0 and
  stores zeros instead. All of a block's loads are issued before its first store."""
  (NB, vn), (RB, vr) = layouts
  ln = plgpu.Layout.WG_STRIDED((NB,), vec_size=vn)
  lr = plgpu.Layout.WG_STRIDED((RB,), vec_size=vr)

  def body(kv_ref, loc_ref, on_ref, or_ref):
    _pdl_prologue(pdl, interpret)
    t0 = _block_start(B, T)
    got = []
    for i in range(B):
      r = loc_ref[t0 + i]
      ok = common.valid_row(r, rows)
      r = jnp.where(ok, r, 0)
      got.append((ok, plgpu.load(kv_ref.at[r, pl.ds(0, NB)], layout=ln),
                  plgpu.load(kv_ref.at[r, pl.ds(NB, RB)], layout=lr)))
    for i, (ok, n, p) in enumerate(got):
      @pl.when(ok)
      def _():
        on_ref.at[t0 + i][...] = n
        or_ref.at[t0 + i][...] = p

      @pl.when(jnp.logical_not(ok))
      def _():
        on_ref.at[t0 + i][...] = jnp.zeros((NB,), jnp.uint8)
        or_ref.at[t0 + i][...] = jnp.zeros((RB,), jnp.uint8)

  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((T, NB), jnp.uint8),
                jax.ShapeDtypeStruct((T, RB), jnp.uint8)),
      grid=(pl.cdiv(T, B),), grid_names=("b",), kernel_name="mla_get_rows_direct" + tag,
      interpret=common.interpret_params() if interpret else None,
  )


def _load_row(src, dst, bar, r, rows):
  """Bulk-load row r of `src` (a ref view per row: src(r)) into dst. An out-of-range r
  loads row 0 instead (nothing outside the buffer is read); `_zero_bad_rows` then clears
  it. One copy either way, so the barrier always sees one arrival."""
  plgpu.copy_gmem_to_smem(src(jnp.where(common.valid_row(r, rows), r, 0)), dst, bar,
                          **_PROMISE)


def _zero_bad_rows(slots, rows: int, blocks, first: int = 0) -> None:
  """Once the loads have landed: row first + i of every shared-memory block becomes zeros
  where slots[i] is out of range (thread stores; the caller's `commit_smem` orders them
  before the bulk stores or register loads that read the blocks). Out-of-range reads give
  zeros this way without a zero row in global memory (an XLA broadcast kernel per call)."""
  for i, r in enumerate(slots):
    @pl.when(common.invalid_row(r, rows))
    def _():
      for block in blocks:
        _store_zeros(block.at[first + i])


def _store_zeros(row) -> None:
  """Zero a 1-D shared-memory row: one vector store per thread when the warpgroup's 128
  threads split it evenly, else element by element (every thread stores the same zeros)."""
  n = row.shape[0]
  if n % 128 == 0:
    row[...] = jnp.zeros(row.shape, row.dtype)
    return

  def zero(j, carry):
    row[j] = jnp.zeros((), row.dtype)
    return carry

  jax.lax.fori_loop(0, n, zero, None)


def _block_slots(loc_ref, t0, B: int, prefetch: bool):
  """The block's slots: all read up front (prefetch), or lazily, one per use (old order)."""
  if prefetch:
    rs = [loc_ref[t0 + i] for i in range(B)]
    return lambda i: rs[i]
  return lambda i: loc_ref[t0 + i]


def _load_block(loc_ref, load, *, B: int, T: int, prefetch: bool, pdl: bool,
                interpret: bool):
  """The gather kernels' start: the PDL prologue, then load(i, r) for each token i of the
  program's block at its slot r (slots read as `_block_slots` says). Returns (t0, slots)."""
  _pdl_prologue(pdl, interpret)
  t0 = _block_start(B, T)
  slot = _block_slots(loc_ref, t0, B, prefetch)
  rs = []
  for i in range(B):
    rs.append(slot(i))
    load(i, rs[-1])
  return t0, rs


def _store_block(blocks, t0, B: int) -> None:
  """After the block's shared-memory stores: bulk-store rows [0, B) of every (smem block,
  gmem output) pair to rows [t0, t0 + B) and wait until shared memory may be reused."""
  plgpu.commit_smem()
  for src, dst in blocks:
    plgpu.copy_smem_to_gmem(src.at[pl.ds(0, B)], dst.at[pl.ds(t0, B)], commit_group=False)
  plgpu.commit_smem_to_gmem_group()
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _get_rows_copy(interpret, *, T, rows, R, Rr, dtype, B, pdl, stages=1, prefetch=False,
                   tag=""):
  n = B // stages  # tokens per stage

  def body(kv_ref, loc_ref, on_ref, or_ref, nsm, rsm, bar):
    def load(i, r):
      b = _bar(bar, i // n, stages)
      _load_row(lambda r: kv_ref.at[r, pl.ds(0, R)], nsm.at[i], b, r, rows)
      _load_row(lambda r: kv_ref.at[r, pl.ds(R, Rr)], rsm.at[i], b, r, rows)

    t0, rs = _load_block(loc_ref, load, B=B, T=T, prefetch=prefetch, pdl=pdl,
                         interpret=interpret)
    for c in range(stages):
      s0 = c * n
      plgpu.barrier_wait(_bar(bar, c, stages))
      _zero_bad_rows(rs[s0:s0 + n], rows, (nsm, rsm), first=s0)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(_stage(nsm, s0, n, stages), on_ref.at[pl.ds(t0 + s0, n)],
                              commit_group=False)
      plgpu.copy_smem_to_gmem(_stage(rsm, s0, n, stages), or_ref.at[pl.ds(t0 + s0, n)],
                              commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _kernel(
      body, grid=pl.cdiv(T, B), name="mla_get_rows" + tag, interpret=interpret,
      out_type=(jax.ShapeDtypeStruct((T, R), dtype), jax.ShapeDtypeStruct((T, Rr), dtype)),
      scratch=[plgpu.SMEM((B, R), dtype), plgpu.SMEM((B, Rr), dtype),
               _barriers(2 * n, stages)],
  )


def _get_rows_regs(interpret, *, T, rows, R, Rr, dtype, dst, B, pdl, prefetch=False,
                   tag=""):
  Bc = common.reg_block_rows(B)
  W = R + Rr
  ln = common.strided_layout((Bc, R), dtype, dst)
  lr = common.strided_layout((Bc, Rr), dtype, dst)

  def body(kv_ref, loc_ref, on_ref, or_ref, csm, nsm, rsm, bar):
    t0, rs = _load_block(
        loc_ref, lambda i, r: _load_row(lambda r: kv_ref.at[r], csm.at[i], bar, r, rows),
        B=B, T=T, prefetch=prefetch, pdl=pdl, interpret=interpret)
    plgpu.barrier_wait(bar)
    _zero_bad_rows(rs, rows, (csm,))
    plgpu.commit_smem()
    nsm[...] = common.cast_to(plgpu.load(csm.at[:, pl.ds(0, R)], layout=ln), dst)
    rsm[...] = common.cast_to(plgpu.load(csm.at[:, pl.ds(R, Rr)], layout=lr), dst)
    _store_block([(nsm, on_ref), (rsm, or_ref)], t0, B)

  return _kernel(
      body, grid=pl.cdiv(T, B), name="mla_get_rows_cast" + tag, interpret=interpret,
      out_type=(jax.ShapeDtypeStruct((T, R), dst), jax.ShapeDtypeStruct((T, Rr), dst)),
      scratch=[plgpu.SMEM((Bc, W), dtype), plgpu.SMEM((Bc, R), dst),
               plgpu.SMEM((Bc, Rr), dst), plgpu.Barrier(num_arrivals=B)],
  )


# ----------------------------------------------------------------------------------------
# get_rows_per_token_head


def get_rows_per_token_head(
    nope_buf, scale_buf, rope_buf, loc, *, dst_dtype, pdl: bool = False,
    config: RowConfig | None = None,
):
  """Gather and dequantize rows: nope = f32(q) * scale, rope = f32(rope_stored) * scale,
  both cast to dst_dtype (fp8 saturates). Out-of-range slots read as zeros."""
  config = config or tuned_config("get_per_token_head", int(loc.shape[0]))
  _check_buffer("nope_buf", nope_buf, (FP8_E4M3,))
  _check_buffer("scale_buf", scale_buf, (jnp.dtype(F32),))
  _check_buffer("rope_buf", rope_buf, common.MODEL_DTYPES)
  _check_loc(loc)
  rows, R, Rr = nope_buf.shape[0], nope_buf.shape[2], rope_buf.shape[2]
  if scale_buf.shape != (rows, 1, 1) or rope_buf.shape[0] != rows:
    raise ValueError(
        f"buffers disagree: nope_buf {nope_buf.shape}, scale_buf {scale_buf.shape} "
        f"(expected {(rows, 1, 1)}), rope_buf {rope_buf.shape}"
    )
  dst = _check_dst(dst_dtype)
  T = loc.shape[0]
  if T == 0:
    return jnp.zeros((0, 1, R), dst), jnp.zeros((0, 1, Rr), dst)
  if common.row_layout_vec(R) is None or common.row_layout_vec(Rr) is None:
    raise common.Unsupported(
        f"per_token_head kernel needs R and Rr multiples of 32, got R={R}, Rr={Rr}"
    )
  rope_dtype = jnp.dtype(rope_buf.dtype)
  for name, width, dt in (("nope_buf", R, FP8_E4M3), ("rope_buf", Rr, rope_dtype),
                          ("nope", R, dst), ("rope", Rr, dst)):
    _check_bulk(name, width, dt)
  B = reg_block_tokens(T, config)
  build = functools.partial(
      _get_pth, T=T, rows=rows, R=R, Rr=Rr, rope_dtype=rope_dtype, dst=dst, B=B, pdl=pdl,
      prefetch=config.loc_prefetch, tag=config.kernel_tag,
  )
  nope, rope = common.dispatch(
      build, nope_buf.reshape(rows, R), scale_buf.reshape(rows), rope_buf.reshape(rows, Rr),
      exact.index_to_int32(loc),
  )
  return nope.reshape(T, 1, R), rope.reshape(T, 1, Rr)


def _get_pth(interpret, *, T, rows, R, Rr, rope_dtype, dst, B, pdl, prefetch=False, tag=""):
  Bc = common.reg_block_rows(B)
  ln = common.row_layout(R, FP8_E4M3, dst)
  lr = common.row_layout(Rr, rope_dtype, dst)

  def body(qb_ref, sb_ref, rb_ref, loc_ref, on_ref, or_ref, qsm, rsm, ssm, nsm, orsm, bar):
    def load(i, r):
      _load_row(lambda r: qb_ref.at[r], qsm.at[i], bar, r, rows)
      _load_row(lambda r: rb_ref.at[r], rsm.at[i], bar, r, rows)

    t0, rs = _load_block(loc_ref, load, B=B, T=T, prefetch=prefetch, pdl=pdl,
                         interpret=interpret)
    for i, r in enumerate(rs):
      ok = common.valid_row(r, rows)
      s = sb_ref[jnp.where(ok, r, 0)]  # always an in-bounds read
      ssm[i] = jnp.where(ok, s, jnp.float32(0))
    for i in range(B, Bc):
      ssm[i] = jnp.float32(0)
    plgpu.barrier_wait(bar)
    _zero_bad_rows(rs, rows, (qsm, rsm))
    plgpu.commit_smem()  # warpgroup barrier: every thread's ssm and zero stores are visible
    scale = plgpu.load(ssm, layout=ln.reduce(1))
    x = common.multiply(plgpu.load(qsm, layout=ln).astype(F32), scale, interpret)
    nsm[...] = common.cast_from_f32(x, dst)
    y = common.multiply(plgpu.load(rsm, layout=lr).astype(F32), scale, interpret)
    orsm[...] = common.cast_from_f32(y, dst)
    _store_block([(nsm, on_ref), (orsm, or_ref)], t0, B)

  return _kernel(
      body, grid=pl.cdiv(T, B), name="mla_get_rows_per_token_head" + tag, interpret=interpret,
      out_type=(jax.ShapeDtypeStruct((T, R), dst), jax.ShapeDtypeStruct((T, Rr), dst)),
      scratch=[plgpu.SMEM((Bc, R), FP8_E4M3), plgpu.SMEM((Bc, Rr), rope_dtype),
               plgpu.SMEM((Bc,), F32), plgpu.SMEM((Bc, R), dst), plgpu.SMEM((Bc, Rr), dst),
               plgpu.Barrier(num_arrivals=2 * B)],
  )
