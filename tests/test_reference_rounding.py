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


# --- `common.scale_divide`: the per_token_head kernels' nope quotients -------------------
# The GPU sequence, emulated exactly in numpy: r = rcp.rn(s); q0 = mul.rn(x, r);
# e = fma.rn(q0, s, -x); q = fma.rn(-e, r, q0). Float64 holds every product here exactly
# (<= 48 bits) and q0 * s - x exactly (Sterbenz), signed zeros included (IEEE sums in
# float64 give the zeros' signs as in float32); the last fma's sum is rounded to float32
# from an exact two-sum (ties decided by the remainder).

F32, F64 = np.float32, np.float64
INV_448 = F32(1.0) / F32(448.0)


def _rn32_of_sum(a, b):
  """Correctly rounded float32 of a + b (float64 arrays holding exact values)."""
  s = a + b
  bb = s - a
  t = (a - (s - bb)) + (b - bb)                    # s + t == a + b exactly
  near = s.astype(F32)
  other = np.nextafter(near, np.where(s > near.astype(F64), F32(np.inf), F32(-np.inf)))
  tie = (near.astype(F64) != s) & ((near.astype(F64) + other.astype(F64)) / 2 == s)
  toward_other = np.sign(t) == np.sign(other.astype(F64) - near.astype(F64))
  return np.where(tie & (t != 0) & toward_other, other, near)


def _scale_divide_emulated(x, s):
  lift = np.where(s < F32(2.0 ** -69), F32(2.0 ** 64), F32(1.0))   # tiny rows, exactly
  x, s = (x * lift).astype(F32), (s * lift).astype(F32)
  r = (1.0 / s.astype(F64)).astype(F32)                     # rcp.rn (no double rounding
  q0 = (x.astype(F64) * r.astype(F64)).astype(F32)         # for these s: checked below)
  e = (q0.astype(F64) * np.minimum(s, np.finfo(F32).max).astype(F64) - x.astype(F64)
       ).astype(F32)
  return _rn32_of_sum(q0.astype(F64), -e.astype(F64) * r.astype(F64))


def _scales(bits):
  """Every scale RN(amax / 448) of an amax with `bits` significant bits (and the floor's)."""
  amax = np.arange(1, 1 << bits, dtype=np.float64).astype(F32)
  return np.concatenate([(amax * INV_448).astype(F32), [F32(1e-26) * INV_448]])


def test_scale_divide_reciprocals_are_correctly_rounded():
  from fractions import Fraction
  for s in _scales(11)[::7]:
    exact_r = 1 / Fraction(float(s))
    r = F32(1.0 / F64(s))
    lo, hi = np.nextafter(r, F32(0)), np.nextafter(r, F32(np.inf))
    err = abs(Fraction(float(r)) - exact_r)
    assert err <= abs(Fraction(float(lo)) - exact_r) and err <= abs(Fraction(float(hi)) - exact_r)


def test_scale_divide_equals_ieee_division_for_every_bf16_and_f16_significand():
  """Every (x significand, scale) pair of bf16 (8 bits) and f16 (11 bits) values: the
  quotient is numpy's IEEE float32 division; a power-of-two shift of x or amax shifts the
  quotient exactly, so the pairs cover every normal-range case."""
  for bits in (8, 11):
    x = np.arange(1, 1 << bits, dtype=np.float64).astype(F32)
    for s in np.array_split(_scales(bits), 4):
      X, S = np.broadcast_arrays(x[:, None], s[None, :])
      for sign in (1, -1):
        got = _scale_divide_emulated(sign * X, S)
        want = (sign * X) / S
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), bits


def test_scale_divide_edge_values():
  """Signed zeros, a row with an inf (scale inf: finite values give 0, infs NaN), NaN. (An
  inf x always comes with scale inf: the scale is the row's amax / 448.)"""
  x = np.array([0.0, -0.0, 1.0, -3.0, np.inf, -np.inf, np.nan, 5.0, -0.0], F32)
  s = np.array([0.5, 0.5, np.inf, np.inf, np.inf, np.inf, 1.0, np.nan, np.inf], F32)
  with np.errstate(invalid="ignore"):
    got, want = _scale_divide_emulated(x, s), x / s
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (got, want)


def test_scale_divide_rows_of_tiny_values():
  """Scales down to the floor's (amax < 1e-26) and values down to bf16 subnormals: without
  the 2^64 lift of tiny rows the residual is subnormal and ~1.6% of these quotients came
  out wrong; with it every one is the IEEE quotient."""
  x = np.arange(1, 256, dtype=np.float64)
  scales = _scales(8)[:-1].astype(F64)
  for s_shift in (60, 90, 100, 110, 120):
    s = (scales * 2.0 ** -s_shift).astype(F32)
    for x_shift in range(s_shift - 10, s_shift + 21, 3):
      X, S = np.broadcast_arrays((x * 2.0 ** -x_shift).astype(F32)[:, None], s[None, :])
      got, want = _scale_divide_emulated(X, S), X / S
      assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (s_shift, x_shift)

