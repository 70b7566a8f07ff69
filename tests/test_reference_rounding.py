"""The XLA reference's f64 -> f32 rounding on the bit patterns (reference._round_to_f32).

XLA:GPU elides the f32 step of f64 -> f32 -> bf16 (openxla/xla#41605), so the reference
rounds the f64 quotient to f32 with integer operations; they must equal numpy's IEEE
round-to-nearest-even cast for every normal f32 result, exact ties and overflow included
(f32-subnormal results use the plain conversion).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache import reference


def test_round_to_f32_equals_numpy_cast():
  rng = np.random.default_rng(0)
  values = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-37, 38.5, 200_000)
  with np.errstate(over="ignore"):  # values past f32's range become inf, as intended
    f32 = values.astype(np.float32)
  up = np.nextafter(f32, np.float32(np.inf))
  ties = (f32.astype(np.float64) + up.astype(np.float64)) / 2      # exact midpoints
  ties = ties[np.isfinite(ties)]
  edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 3.4028235677973366e38,
                    3.5e38, -3.5e38, 1.1754943508222875e-38, 1.0, 1.0 + 2.0**-24], np.float64)
  wide = np.concatenate([values, ties, edges])
  with jax.enable_x64(True):
    got = np.asarray(jax.jit(reference._round_to_f32)(jnp.asarray(wide, jnp.float64)))
  with np.errstate(over="ignore"):
    want = wide.astype(np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  # f32-subnormal results take XLA's plain conversion (XLA:CPU flushes them to zero).
  subnormal = (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)
  assert subnormal.sum() < 0.01 * len(wide)
  ok = same | subnormal
  assert ok.all(), (wide[~ok][:5], got[~ok][:5], want[~ok][:5])
