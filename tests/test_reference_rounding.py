"""Exact float32 arithmetic on every XLA backend (`pallas_kernels.exact`).

XLA:GPU elides the f32 step of f64 -> f32 -> bf16 (openxla/xla#41605) and XLA:CPU flushes
subnormal operands and results to zero, so the reference (and the kernels in interpret
mode) cross into float64 on the bit patterns and round back to f32 on the bit patterns.
Every result must equal numpy's IEEE float32 arithmetic, exact ties, overflow and
subnormals included.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import exact

TINY = np.finfo(np.float32).tiny


def test_round_to_f32_equals_numpy_cast():
  rng = np.random.default_rng(0)
  values = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-47, 38.5, 200_000)
  with np.errstate(over="ignore"):  # values past f32's range become inf, as intended
    f32 = values.astype(np.float32)
  up = np.nextafter(f32, np.float32(np.inf))
  ties = (f32.astype(np.float64) + up.astype(np.float64)) / 2      # exact midpoints
  ties = ties[np.isfinite(ties)]
  edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 3.4028235677973366e38,
                    3.5e38, -3.5e38, 1.1754943508222875e-38, 1.0, 1.0 + 2.0**-24,
                    2.0**-149, 2.0**-150, 3 * 2.0**-151, -(2.0**-150), 1.5 * 2.0**-149,
                    2.0**-126 - 2.0**-150, 2.0**-126 - 2.0**-151, 1e-300, 5e-324],
                   np.float64)
  wide = np.concatenate([values, ties, edges])
  with jax.enable_x64(True):
    got = np.asarray(jax.jit(exact.round_to_f32)(jnp.asarray(wide, jnp.float64)))
  with np.errstate(over="ignore"):
    want = wide.astype(np.float32)
  subnormal = (want != 0) & (np.abs(want) < TINY)
  assert subnormal.sum() > 1000  # the subnormal range is covered
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (wide[~same][:5], got[~same][:5], want[~same][:5])


def test_f32_to_f64_is_exact_for_subnormals():
  bits = np.concatenate([np.arange(0, 1 << 12), (1 << 23) - np.arange(1, 1 << 12),
                         np.random.default_rng(1).integers(0, 1 << 32, 100_000)])
  x = bits.astype(np.uint32).view(np.float32)
  with jax.enable_x64(True):
    got = np.asarray(jax.jit(exact.f32_to_f64)(jnp.asarray(x)))
  with np.errstate(invalid="ignore"):  # signalling NaN bit patterns
    want = x.astype(np.float64)
  same = (got.view(np.uint64) == want.view(np.uint64)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (x[~same][:5], got[~same][:5])


def test_divide_and_multiply_equal_numpy_with_subnormals():
  rng = np.random.default_rng(2)
  n = 100_000
  x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 38, n)).astype(np.float32)
  y = (rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 38, n)).astype(np.float32)
  x[:8] = [1e-40, -1e-40, 0.0, -0.0, np.inf, np.nan, 1.0, TINY]
  y[:8] = [np.float32(1 / 448), 2.2321429e-29, 1.0, 3.0, 1e-40, 1.0, 1e-40, 3.0]
  with np.errstate(all="ignore"):
    for fn, want in ((exact.divide, x / y), (exact.multiply, x * y)):
      got = np.asarray(jax.jit(fn)(jnp.asarray(x), jnp.asarray(y)))
      same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
      assert same.all(), (fn.__name__, x[~same][:5], y[~same][:5], got[~same][:5])
      assert ((want != 0) & (np.abs(want) < TINY)).sum() > 100  # subnormal results seen


def test_index_to_int32_never_wraps():
  wide = np.array([2**32 + 5, -(2**40), 5, -1, 2**31 - 1, -(2**31), 2**31], np.int64)
  want = np.array([-1, -1, 5, -1, 2**31 - 1, -(2**31), -1], np.int32)
  np.testing.assert_array_equal(exact.index_to_int32(wide), want)
  np.testing.assert_array_equal(exact.index_to_int32(np.array([2**63 + 5, 7], np.uint64)),
                                [-1, 7])
  np.testing.assert_array_equal(exact.index_to_int32(jnp.array([2**32 - 1, 3], jnp.uint32)),
                                [-1, 3])
  with jax.enable_x64(True):
    traced = jax.jit(exact.index_to_int32)(jnp.asarray(wide))
  assert traced.dtype == jnp.int32
  np.testing.assert_array_equal(traced, want)
