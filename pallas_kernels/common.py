"""Helpers shared by the Mosaic GPU row kernels (arrays in, arrays out).

* Platform dispatch: the real Mosaic GPU kernel when lowering for CUDA (also deviceless
  lowering on a CPU host), the same kernel body in Mosaic GPU interpret mode when lowering
  for anything else (CPU tests).
* Views: the cache buffers keep the seed's ``(rows, 1, width)`` shape; kernels see them as
  ``(rows, width)`` (a free reshape).
* Casts: every value conversion goes through float32; fp8 destinations saturate at the
  format's max finite value (NaN stays NaN), rounding is round-to-nearest-even.
* Register layouts for whole-row work in registers (see `row_layout`).
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import exact

F32 = jnp.float32

# Max finite value of each fp8 storage format (saturating casts clip to it).
FP8_MAX = {
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
}
STORAGE_DTYPES = tuple(
    jnp.dtype(d)
    for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
MODEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))

# cp.async.bulk (the TMA engine's plain bulk copy) needs 16-byte sizes and addresses.
BULK_ALIGN = 16


class Unsupported(NotImplementedError):
  """The kernels do not cover this call (a row width, a buffer geometry, ``jax.vmap``).

  Raised at trace time, before anything runs; ``jax_mla_cache.dispatch`` falls through to
  the XLA implementation on it when the caller left the implementation to the library.
  """


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) in FP8_MAX


def cast_from_f32(x: jax.Array, dtype) -> jax.Array:
  """float32 -> dtype, round-to-nearest-even; fp8 saturates (clip, NaN stays NaN).

  On the GPU the clip is redundant with the ``cvt.rn.satfinite`` Mosaic emits for fp8,
  but interpret mode (XLA's convert) needs it, and it keeps both paths identical.
  """
  dtype = jnp.dtype(dtype)
  if dtype in FP8_MAX:
    limit = FP8_MAX[dtype]
    x = jnp.clip(x, -limit, limit)
  return x.astype(dtype)


def cast_to(x: jax.Array, dtype, sanitize: bool = False) -> jax.Array:
  """Any float dtype -> dtype through float32 (exact for every source dtype here).

  With `sanitize` (SPEC §9) NaN becomes 0 and values beyond dtype's largest finite value,
  +-inf included, become that value with their sign (`sanitize_f32`).
  """
  if sanitize:
    return cast_from_f32(sanitize_f32(x.astype(F32), finite_max(dtype)), dtype)
  if x.dtype == jnp.dtype(dtype) and not is_fp8(dtype):
    return x
  return cast_from_f32(x.astype(F32), dtype)


def finite_max(dtype) -> float:
  """The largest finite value of a float dtype."""
  return float(jnp.finfo(dtype).max)


def sanitize_f32(x: jax.Array, limit: float) -> jax.Array:
  """SPEC §9 on float32 values: NaN -> 0, values beyond +-limit (+-inf included) -> +-limit.

  Values within the limit are returned unchanged, so a finite row whose cast would not
  overflow is stored exactly as without sanitizing. Plain jnp ops: the same expression
  runs in the XLA reference, in interpret mode and in Mosaic GPU registers.
  """
  return jnp.where(jnp.isnan(x), jnp.float32(0), jnp.clip(x, -limit, limit))


def true_divide(x: jax.Array, per_row: jax.Array, interpret: bool, layout=None) -> jax.Array:
  """``x / per_row[:, None]`` as an IEEE float32 division of every element (SPEC §3).

  Speed: ``div.rn.f32`` runs a slow path (a called subroutine) for zero, subnormal, inf or
  NaN operands. On the H200 a one-token per_token_head write whose block held three zero
  padding rows took 3.7 us instead of 1.72 (see `rows.quantize_block`'s `valid_rows`);
  selecting around zeros instead cost 35% at large T, so real zero values take the slow
  path.

  On the GPU, Mosaic lowers ``arith.divf`` to ``div.full.f32`` (an approximation within
  2 ulp, as XLA:GPU and Triton do; measured on the H200: ~40% of f32 quotients off by one
  ulp). With the block's register `layout`, the quotient comes from inline PTX
  ``div.rn.f32`` instead: correctly rounded and subnormal-preserving (no ``.ftz``), as
  PyTorch's CUDA division and numpy's. In interpret mode the kernel body runs through
  XLA:CPU, which flushes subnormal operands and results to zero and would rewrite a division
  by a broadcast into a multiplication by the reciprocal: `exact.divide` gives the IEEE
  quotient there.
  """
  if interpret:
    return exact.divide(x, per_row[:, None])
  divisor = jnp.broadcast_to(per_row[:, None], x.shape)
  if layout is None:
    return x / divisor
  return _div_rn(x, divisor, layout)


SHORT_SIGNIFICAND_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TINY_SCALE = np.float32(2.0 ** -69)   # `scale_divide` lifts rows with a smaller scale


def scale_divide(x: jax.Array, scale: jax.Array, interpret: bool, layout, row_layout):
  """``x / scale[:, None]``, the IEEE float32 quotient, for SPEC §3's nope values: x holds
  bf16 or f16 values (at most 11 significant bits) and scale = RN(max(amax, floor) / 448)
  with amax = max|x| of the row (or inf / NaN).

  Instead of one ``div.rn.f32`` a value (a called subroutine on the GPU: 0.48 of a
  one-token write's 1.71 us on the H200, `benchmarks/diag_pth_set.py`), one correctly
  rounded reciprocal a row (``rcp.rn.f32``, `row_layout`) and per value a multiply and two
  fmas (Markstein's correction, with the residual negated)::

      r = rcp.rn(s); q0 = mul.rn(x, r); e = fma.rn(q0, min(s, FLT_MAX), -x)
      q = fma.rn(-e, r, q0)

  This equals the IEEE quotient for every pair of a bf16/f16 significand and a scale of
  that form (tests/test_reference_rounding.py runs the same sequence exhaustively: 8.4M
  pairs for f16, 130K for bf16; a power-of-two shift of either changes nothing above
  float32's subnormal range, and quotients below it become fp8 zeros either way). The
  negated residual keeps -0 / s = -0 with no select (x = -0: e = -0 + 0 = +0, and
  q = -0 + -0 = -0; the residual x - q0 s would give +0 and q = +0, which an ``e == 0``
  select had to undo: two instructions a value); ``min(s, FLT_MAX)`` gives x / inf = 0
  (and inf / inf = NaN); NaN propagates. Rows with s < 2^-69 (amax below ~2^-60) are first
  scaled by 2^64, x and s alike (exact): there the residual would be subnormal (the
  emulation found 40K wrong fp8-relevant quotients without it, none with it). Interpret
  mode: `exact.divide`, the IEEE quotient.
  """
  if interpret:
    return exact.divide(x, scale[:, None])
  from jax.experimental.mosaic import gpu as mgpu
  instr = mgpu.FragmentedArray._lift_fast_instr

  @plgpu.inline_mgpu(arg_types=(row_layout,),
                     return_type=plgpu.ShapeDtypeStruct(scale.shape, F32, layout=row_layout))
  def reciprocal(_, s):
    return s._pointwise(instr("rcp.rn.f32"))

  # Rows of tiny values: the residual e (~2^-24 |x|) would fall below float32's normal
  # range and lose bits; x and s scaled by 2^64 (exact) keep every step normal.
  lift_rows = jnp.where(scale < TINY_SCALE, np.float32(2.0 ** 64), np.float32(1.0))
  scale = scale * lift_rows
  x = x * jnp.broadcast_to(lift_rows[:, None], x.shape)
  one_row = x.shape[0] == 1
  if not one_row:
    r = reciprocal(scale)
  s_b = jnp.broadcast_to(jnp.minimum(scale, np.float32(np.finfo(np.float32).max))[:, None],
                         x.shape)
  if one_row:
    # One row (a layout whose warps all hold it: Mosaic's inline_mgpu refuses its fully
    # replicated (1,) layout): each thread takes the reciprocal of its first copy of the
    # scale and broadcasts it over its registers.
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, F32, layout=layout))
    def reciprocal_row(_, s):
      first = s.registers.flat[0]
      if isinstance(first.type, ir.VectorType):
        first = vector.extract(first, dynamic_position=[],
                               static_position=ir.DenseI64ArrayAttr.get([0]))
      return mgpu.FragmentedArray.splat(instr("rcp.rn.f32")(first), s.shape, s.layout,
                                        is_signed=s.is_signed)

    r_b = reciprocal_row(jnp.broadcast_to(scale[:, None], x.shape))
  else:
    r_b = jnp.broadcast_to(r[:, None], x.shape)

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, F32, layout=layout))
  def quotient(_, a, s, r):
    q0 = a._pointwise(instr("mul.rn.f32"), r)
    neg_a = a._pointwise(instr("neg.f32"))              # (negations: fma operand modifiers)
    e = q0._pointwise(instr("fma.rn.f32"), s, neg_a)    # q0 s - x, the negated residual
    neg_e = e._pointwise(instr("neg.f32"))
    return neg_e._pointwise(instr("fma.rn.f32"), r, q0)

  return quotient(x, s_b, r_b)


def multiply(x: jax.Array, per_row: jax.Array, interpret: bool) -> jax.Array:
  """``x * per_row[:, None]`` as an IEEE float32 multiplication of every element.

  On the GPU a plain ``mul.f32`` (Mosaic emits no ``.ftz``: subnormals are kept). In
  interpret mode XLA:CPU would flush subnormal operands and products to zero:
  `exact.multiply` keeps them.
  """
  if interpret:
    return exact.multiply(x, per_row[:, None])
  return x * per_row[:, None]


def _div_rn(x: jax.Array, y: jax.Array, layout) -> jax.Array:
  """Element-wise correctly rounded f32 ``x / y`` (PTX ``div.rn.f32``) on register arrays."""
  from jax.experimental.mosaic import gpu as mgpu

  @plgpu.inline_mgpu(
      arg_types=(layout, layout),
      return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout),
  )
  def div(_, a, b):
    return a._pointwise(mgpu.FragmentedArray._lift_fast_instr("div.rn.f32"), b)

  return div(x, y)


PROFILE: tuple[int, str] | None = None
"""None, or (events a warpgroup records, folder): kernels built while it is set (the decode
kernels, through `compiler_params`) record their named regions (``jax.named_scope`` in the
kernel body) with Mosaic GPU's in-kernel profiler and write a Perfetto trace per call into
the folder (benchmarks/trace_decode.py sets it and clears the kernel cache). The record
buffer takes 16 bytes an event a warpgroup of shared memory; later events are dropped."""


def compiler_params(**kwargs) -> plgpu.CompilerParams:
  """``plgpu.CompilerParams(**kwargs)``, with the in-kernel profiler when `PROFILE` is set."""
  if PROFILE is not None:
    space, folder = PROFILE
    kwargs.update(profile_space=space, profile_dir=folder, profile_bounds_check=True)
  return plgpu.CompilerParams(**kwargs)


def interpret_params() -> plgpu.InterpretGPUParams:
  # Out-of-bounds reads raise (they would be bugs: our kernels never read outside a buffer).
  return plgpu.InterpretGPUParams(out_of_bounds_reads="raise")


# The Mosaic GPU interpreter keeps global state; shards of a sharded cache run their
# callbacks concurrently (one thread per CPU device), so interpreted kernels run one at a time.
_INTERPRET_LOCK = threading.Lock()


class InterpretWarning(UserWarning):
  """Interpret mode in a set-up where it may hang (`_warn_single_cpu_device`)."""


@functools.cache
def _warn_single_cpu_device() -> None:
  """Warn once when kernels are interpreted with a single CPU device.

  The interpreter runs a kernel's warpgroups as threads that wait on each other's barriers.
  With one host CPU device on a 2-core machine, loops of calls of the four-warpgroup
  per_token_head decode kernel hung in 4 of 5 tries (after 1-6 calls: two warpgroups
  waiting on barriers, the other two never running) and each call took ~7x longer; with
  ``--xla_force_host_platform_device_count=4`` or ``8`` (as `tests/conftest.py` sets) 24
  calls in a row completed. (Session 2026-12-05, jax 0.11.2.)"""
  try:
    single = len(jax.devices("cpu")) == 1
  except RuntimeError:
    return
  if single:
    warnings.warn(
        "Pallas interpret mode with a single CPU device can hang (kernels whose warpgroups "
        "wait on each other); start Python with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8, as the tests do.",
        InterpretWarning, stacklevel=2)


def dispatch(build: Callable[[bool], Callable[..., Any]], *args):
  """Run ``build(interpret)(*args)``: the real kernel for CUDA, interpret mode elsewhere.

  The choice is made per lowering platform (``jax.lax.platform_dependent``), so lowering
  for CUDA on a CPU host (deviceless AOT) gives the real kernel.

  The CUDA branch is a jitted function cached per `build` (see `kernel_fn`): a model step
  that calls one kernel per layer with the same static shapes traces and lowers it once
  and calls it for every layer, instead of emitting one identical Mosaic GPU kernel per
  layer (most of a 61-layer step's compile time).

  Interpret mode carries an ordered IO effect; ``platform_dependent`` keeps only the
  lowering platform's branch but still expects that effect's token, so a bare interpret
  branch breaks CUDA lowering. The interpret branch therefore runs inside a
  ``pure_callback`` (which hides the effect; on CPU the buffers are then copied through the
  callback: interpret mode is for correctness only).
  """
  cuda = kernel_fn(build, False)
  out_types = jax.eval_shape(cuda, *args)
  interpreted = kernel_fn(build, True)
  if _build_key(build) is None:
    interpreted = jax.jit(interpreted)

  def run_interpreted(*x):
    _warn_single_cpu_device()
    with _INTERPRET_LOCK:
      return jax.device_get(interpreted(*x))

  def on_other(*a):
    return jax.pure_callback(run_interpreted, out_types, *a)

  return lax.platform_dependent(*args, cuda=cuda, default=on_other)


def kernel_fn(build: Callable[[bool], Callable[..., Any]], interpret: bool) -> Callable[..., Any]:
  """``jax.jit(build(interpret))``, one per distinct `build`.

  `build` is usually ``functools.partial(kernel, **static)`` made afresh by each call; two
  partials of the same function with equal (hashable) arguments get the same jitted
  function, so JAX's trace cache and the lowering's per-module cache of jitted callees
  reuse one kernel. Other callables (or unhashable arguments): ``build(interpret)`` as it
  comes (callers such as the move paths pass their own jitted function).
  """
  key = _build_key(build)
  if key is None:
    return build(interpret)
  return _cached_kernel_fn(key, interpret)


def _build_key(build) -> tuple | None:
  if not isinstance(build, functools.partial):
    return None
  key = (build.func, build.args, tuple(sorted(build.keywords.items())))
  try:
    hash(key)
  except TypeError:
    return None
  return key


@functools.lru_cache(maxsize=512)
def _cached_kernel_fn(key: tuple, interpret: bool) -> Callable[..., Any]:
  func, args, keywords = key
  return jax.jit(functools.partial(func, *args, **dict(keywords))(interpret))


def as_rows(x: jax.Array) -> jax.Array:
  """(n, 1, w) -> (n, w) (free)."""
  if x.ndim != 3 or x.shape[1] != 1:
    raise ValueError(f"expected shape (n, 1, w), got {x.shape}")
  return x.reshape(x.shape[0], x.shape[2])


def valid_row(r, rows: int):
  """Whether row index r (a traced int32 scalar) is a real row of a buffer of `rows`."""
  return (r >= 0) & (r < rows)


def invalid_row(r, rows: int):
  # Spelled out (not ~valid_row) because `not` has no lowering in some Mosaic contexts.
  return (r < 0) | (r >= rows)


def _max_vec(dtypes) -> int:
  """Elements per thread-vector so that no access of any of `dtypes` exceeds 16 bytes."""
  return max(1, min(8, 16 // max((jnp.dtype(d).itemsize for d in dtypes), default=1)))


def row_layout_vec(ncols: int, *dtypes) -> int | None:
  """Vector width of `row_layout(ncols, *dtypes)`, or None when no such layout exists."""
  v = _max_vec(dtypes)
  while v >= 1:
    if ncols % (32 * v) == 0:
      return v
    v //= 2
  return None


def row_layout(ncols: int, *dtypes):
  """A register layout for a (rows, ncols) block where each warp owns whole rows.

  Tiles of 4 rows x (32*v) columns: warp w holds row w of each tile, its 32 lanes hold v
  consecutive elements each. Row reductions (``jnp.max(x, axis=1)``) stay inside a warp
  (shuffles, no shared memory), and every row layout made here reduces to the same (rows,)
  layout, so a per-row scalar broadcasts back onto any of them (nope and rope blocks).
  Shared-memory accesses are contiguous per warp (no bank conflicts, no swizzle needed).
  The number of rows must be a multiple of 4; ncols a multiple of 32. `dtypes`: the dtypes
  the array is loaded from / stored to (each thread access stays <= 16 bytes, the widest
  shared-memory access Mosaic's optimized transfers use).
  """
  v = row_layout_vec(ncols, *dtypes)
  if v is None:
    raise Unsupported(f"row width {ncols} is not a multiple of 32")
  return plgpu.Layout.TILED(
      plgpu.Tiling(((4, 32 * v), (v,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
  )


def whole_row_layout(ncols: int, *dtypes):
  """A register layout for a (1, ncols) row that every warp of the warpgroup holds whole.

  Lane l holds v consecutive elements of each (32*v)-column tile (as `row_layout`), and
  the warp dimension is replicated: the row maximum stays inside a warp, a block needs no
  padding rows, and every warp stores the same bytes. For one token a program loaded from
  and stored to global memory directly (`rows._set_pth_direct`). ncols: a multiple of 32.
  """
  v = row_layout_vec(ncols, *dtypes)
  if v is None:
    raise Unsupported(f"row width {ncols} is not a multiple of 32")
  return plgpu.Layout.TILED(plgpu.Tiling(((1, 32 * v), (v,))),
                            warp_dims=(plgpu.Replicated(4),), lane_dims=(-2,), vector_dim=-1)


def strided_layout(shape: tuple[int, ...], *dtypes):
  """A layout that spreads a block over the warpgroup's threads in row-major order.

  Thread t holds vectors (i * 128 + t) * vec ... + vec - 1 of the flattened block
  (vec up to 16 bytes), so a warp touches contiguous shared memory (no bank conflicts), and
  it can store into / load from a strided view such as the nope part of a whole-row block
  (a tiled layout cannot). Used for element-wise casts (no reductions).
  """
  size = math.prod(shape)
  vec = _max_vec(dtypes)
  while vec > 1 and (size % (128 * vec) or shape[-1] % vec):
    vec //= 2
  if size % (128 * vec) or shape[-1] % vec:
    raise Unsupported(f"block {shape} does not spread over 128 threads")
  return plgpu.Layout.WG_STRIDED(tuple(shape), vec)


def reg_block_rows(block_tokens: int) -> int:
  """Shared-memory rows of a block that registers read or write.

  A multiple of 4 (the row layout's tile) that is NOT a multiple of 8: Mosaic's layout
  inference (warpgroup semantics) gives 2-D shared-memory buffers whose second-minor
  dimension is a multiple of 8 a tiled+swizzled layout, which would break the per-row
  bulk copies into and out of these buffers. Rows past the tokens of a block hold garbage
  that registers process and nothing stores.
  """
  n = -(-block_tokens // 4) * 4
  if n % 8 == 0:
    n += 4
  return n
