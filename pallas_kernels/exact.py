"""Plain-jnp helpers shared by the kernels and the XLA reference (no Pallas import).

Exact float32 arithmetic on every XLA backend. Three XLA behaviours stand between ``x / y``
and the IEEE single-precision quotient that SPEC §3 (and numpy, and PyTorch on CUDA) give:

* XLA:CPU runs with flush-to-zero and denormals-are-zero: a subnormal input of any float
  operation or float-to-float conversion reads as 0 and a subnormal result becomes 0
  (bf16, f16 and fp8 conversions are integer code and keep them);
* XLA:GPU emits the approximate ``div.full.f32`` (up to 2 ulp off) and elides intermediate
  narrowing casts (openxla/xla#41605: ``f64 -> f32 -> bf16`` becomes one rounding);
* XLA's algebraic simplifier rewrites ``x / broadcast(y)`` into ``x * broadcast(1 / y)``.

So operands cross into float64 exactly, on their bit patterns (`f32_to_f64`); the operation
runs in float64, where every f32 quotient and product is a normal number, nothing is flushed
and the result is exact enough (a double-precision quotient rounded to single equals the
correctly rounded single quotient, 53 >= 2*24 + 2 bits; a product of two f32 is exact); and
the result comes back to float32 on the bit patterns (`round_to_f32`), which no pass can
elide. `divide` and `multiply` are the entry points.

Row indices: `index_to_int32` narrows them without wrapping (an int64 ``2**32 + 5`` must not
become row 5).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
F64 = jnp.float64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# ----------------------------------------------------------------- float32 arithmetic
def f32_to_f64(x: jax.Array) -> jax.Array:
  """float32 -> float64, exact for every value, subnormals included (XLA:CPU's conversion
  reads a subnormal input as 0). Call under ``jax.enable_x64(True)``."""
  u32 = jnp.uint32
  bits = lax.bitcast_convert_type(x, u32)
  magnitude = bits & u32(0x7FFFFFFF)
  subnormal = (magnitude != u32(0)) & (magnitude < u32(0x00800000))
  # A subnormal is magnitude * 2**-149: an exact integer conversion, then a power-of-two
  # scaling into the normal float64 range (no float operation ever sees a subnormal).
  tiny = lax.convert_element_type(magnitude, F64) * np.float64(2.0**-149)
  tiny = jnp.where((bits >> u32(31)) == u32(1), -tiny, tiny)
  return jnp.where(subnormal, tiny, lax.convert_element_type(x, F64))


def round_to_f32(wide: jax.Array) -> jax.Array:
  """float64 -> float32, round to nearest even, computed on the bit patterns.

  Every finite result, subnormals included (XLA:CPU flushes them; XLA:GPU would fold the
  rounding into a following narrowing cast), comes from integer arithmetic on the f64 bits;
  NaN and infinities use the plain conversion. Call under ``jax.enable_x64(True)``.
  """
  u64 = jnp.uint64
  bits = lax.bitcast_convert_type(wide, u64)
  sign = bits >> u64(63)
  exponent = (bits >> u64(52)) & u64(0x7FF)
  mantissa = bits & u64((1 << 52) - 1)
  keep = mantissa >> u64(29)
  rest = mantissa & u64((1 << 29) - 1)
  half = u64(1 << 28)
  round_up = (rest > half) | ((rest == half) & ((keep & u64(1)) == u64(1)))
  # f32 normal exponents 1..254 are f64 exponents 897..1150; a mantissa carry bumps the
  # exponent (254 + carry = 255 with a zero mantissa: inf, the correct RNE overflow).
  normal = (exponent >= u64(897)) & (exponent <= u64(1150))
  normal_bits = ((jnp.where(normal, exponent - u64(896), u64(0)) << u64(23))
                 + keep + round_up.astype(u64))
  # Below 2**-126 (zero included) the f32 bit pattern is the integer RNE(|wide| * 2**149):
  # the scaling is exact and lands in the normal f64 range; a carry to 2**23 is the
  # smallest normal, whose bit pattern that is.
  small = exponent < u64(897)
  scaled = lax.abs(wide) * np.float64(2.0**149)
  small_bits = lax.convert_element_type(
      lax.round(scaled, lax.RoundingMethod.TO_NEAREST_EVEN), u64)
  magnitude = jnp.where(normal, normal_bits, jnp.where(small, small_bits, u64(0)))
  rounded = lax.bitcast_convert_type(((sign << u64(31)) | magnitude).astype(jnp.uint32), F32)
  return jnp.where(normal | small, rounded, lax.convert_element_type(wide, F32))


def divide(x: jax.Array, y: jax.Array) -> jax.Array:
  """``x / y`` for float32 arrays (y broadcast to x's shape), correctly rounded like an IEEE
  float32 division on every backend, subnormal operands and results included."""
  with jax.enable_x64(True):
    divisor = f32_to_f64(jnp.broadcast_to(y, x.shape).astype(F32))
    # The barrier keeps the simplifier from turning a division by a broadcast into a
    # multiplication by its reciprocal.
    divisor = lax.optimization_barrier(divisor)
    return round_to_f32(lax.div(f32_to_f64(x.astype(F32)), divisor))


def multiply(x: jax.Array, y: jax.Array) -> jax.Array:
  """``x * y`` for float32 arrays (numpy broadcasting), correctly rounded like an IEEE
  float32 multiplication on every backend, subnormal operands and results included."""
  x, y = jnp.broadcast_arrays(x, y)
  with jax.enable_x64(True):
    return round_to_f32(lax.mul(f32_to_f64(x.astype(F32)), f32_to_f64(y.astype(F32))))


# ----------------------------------------------------------------- row indices
def index_to_int32(index: Any) -> Any:
  """Integer row indices as int32; values outside int32's range become -1 instead of
  wrapping (-1 is outside every buffer, so writes skip it and reads give zeros).

  A numpy array (or scalar) is narrowed with numpy and stays numpy: `jnp.asarray` would
  truncate its 64-bit values first when ``jax_enable_x64`` is off. A jax array (int64 or
  uint64 under ``jax.enable_x64``, uint32 always) is compared in its own width.
  """
  dtype = np.dtype(index.dtype)
  if dtype == np.int32:
    return index
  info = np.iinfo(dtype)
  if info.min >= INT32_MIN and info.max <= INT32_MAX:
    return index.astype(np.int32)
  if isinstance(index, (np.ndarray, np.generic)):
    keep = np.ones(np.shape(index), bool)
    if info.min < INT32_MIN:
      keep &= index >= INT32_MIN
    if info.max > INT32_MAX:
      keep &= index <= INT32_MAX
    return np.where(keep, index.astype(np.int32), np.int32(-1))
  with jax.enable_x64(True):
    keep = jnp.ones(index.shape, bool)
    if info.min < INT32_MIN:
      keep &= index >= jnp.asarray(INT32_MIN, dtype)
    if info.max > INT32_MAX:
      keep &= index <= jnp.asarray(INT32_MAX, dtype)
    return jnp.where(keep, lax.convert_element_type(index, jnp.int32), jnp.int32(-1))


def block_rows(rows: int, blocks: Any) -> int:
  """Rows of each of ``blocks`` equal blocks of ``rows`` rows (a stacked buffer's layers);
  ValueError naming ``layers`` unless ``blocks`` is a positive int dividing ``rows``."""
  if not isinstance(blocks, int) or blocks < 1 or rows % blocks:
    raise ValueError(f"layers: expected a positive int dividing the buffers' rows, got "
                     f"{blocks!r} for {rows} rows")
  return rows // blocks


def every_block(index: jax.Array, units: int, blocks: int) -> jax.Array:
  """Indices (T,) valid in ``[0, units)`` -> (blocks * T,) int32: the same indices in each of
  ``blocks`` consecutive blocks of ``units`` (block by block; a stacked cache's layers), -1
  where an index is outside ``[0, units)``. No overflow while ``blocks * units < 2**31``."""
  index = index_to_int32(index)
  ok = (index >= 0) & (index < units)
  offsets = jnp.arange(blocks, dtype=jnp.int32)[:, None] * units
  return jnp.where(ok[None, :], index[None, :] + offsets, -1).reshape(-1)


def every_block_pages(pages: jax.Array, page_size: int, block_rows: int,
                      blocks: int) -> jax.Array:
  """Page ids (P,) of each block of ``block_rows`` rows -> row indices (blocks * P *
  page_size,) of the whole buffer, block by block; -1 for every row of a page not wholly
  inside ``[0, block_rows)``. For blocks whose rows are not a multiple of ``page_size``,
  where a page id of one block is no page id of the whole buffer."""
  pages = index_to_int32(pages)
  ok = (pages >= 0) & (pages < block_rows // page_size)
  rows = pages[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]
  return every_block(jnp.where(ok[:, None], rows, -1).reshape(-1), block_rows, blocks)


# ----------------------------------------------------------------- inputs
def as_stored(x: jax.Array) -> jax.Array:
  """`x` with exactly the values its dtype holds.

  Under ``jit``, XLA (``xla_allow_excess_precision``, on by default) may hand a fused
  consumer the unrounded float32 value a producer computed for a bf16 / f16 array (XLA:CPU
  did: a jitted step's ``a * b + a`` quantized to fp8 gave other bytes than the same step
  eagerly, and than the kernels, whose inputs are materialized). An optimization barrier
  makes the array's own values the operand. Arrays of 32 bits or more pass unchanged.
  """
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype).itemsize >= 4:
    return x
  return lax.optimization_barrier(x)
