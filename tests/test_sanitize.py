"""SPEC §9: `sanitize=True` on the writes, against a numpy model, on both implementations
(CPU: the Pallas kernels in interpret mode) and both storage modes.

The model: NaN -> 0; plain storage clips to the storage dtype's largest finite value (so
+-inf lands there); per_token_head clips nope and rope to their input dtype's largest
finite value before quantizing (SPEC §3) and the rope quotient to model_dtype's.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mla_cache as mc
from tests import numpy_model
from tests.test_ops import cfg_id

F32 = np.float32
PLAIN = [mc.SMALL, mc.SMALL.replace(dtype=jnp.float16), mc.SMALL.replace(dtype=jnp.float32),
         mc.SMALL.replace(dtype=jnp.float8_e4m3fn), mc.SMALL.replace(dtype=jnp.float8_e5m2)]
QUANT = [mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head"),
         mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head",
                          model_dtype=jnp.float16)]
IMPLS = ["xla", "pallas"]


def finite_max(dtype) -> F32:
  return F32(ml_dtypes.finfo(np.dtype(dtype)).max)


@np.errstate(invalid="ignore")
def np_sanitize(x, limit):
  x = np.asarray(x, F32)
  return np.where(np.isnan(x), F32(0), np.clip(x, -limit, limit)).astype(F32)


@np.errstate(invalid="ignore", over="ignore", divide="ignore")
def model_rows(cfg, nope, rope):
  """What a sanitized write stores: [row (T,1,W)] plain, or (q, scale, rope) quantized."""
  if not cfg.quantized:
    limit = finite_max(cfg.dtype)
    row = np.concatenate([np_sanitize(nope, limit), np_sanitize(rope, limit)], -1)
    return (numpy_model.cast_to_storage(row, cfg.dtype),)
  n = np_sanitize(nope, finite_max(nope.dtype))
  r = np_sanitize(rope, finite_max(rope.dtype))
  q, scale, _ = numpy_model.quantize(n, r, cfg.model_dtype)
  limit = finite_max(cfg.model_dtype)
  stored = np.clip(r / scale, -limit, limit).astype(np.dtype(cfg.model_dtype))
  return q, scale, stored


def poisoned(rng, T, width, dtype, huge=True):
  """Normal values with NaN, +inf and -inf planted in rows 1, 2, 3, and (`huge`) a finite
  value beyond the f16 / fp8 ranges (beyond model_dtype's after a per_token_head
  division) in row 4."""
  x = rng.standard_normal((T, 1, width)).astype(F32) * 3
  for row, value in zip((1, 2, 3), (np.nan, np.inf, -np.inf)):
    x[row, 0, rng.integers(width)] = value
  if huge:
    x[4, 0, 0] = 3e38
  return x.astype(np.dtype(dtype))


def stored_rows(cache, layer, loc):
  return [np.asarray(b)[loc] for b in cache.layer(layer)]


def assert_bits(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, what
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", PLAIN + QUANT, ids=cfg_id)
@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16])
def test_sanitized_set_matches_model(cfg, impl, in_dtype, rng):
  T = 6
  loc = np.array([7, 30, 31, 32, 33, 50], np.int32)
  # A huge finite nope would make per_token_head's rope quotients subnormal, which
  # XLA:CPU flushes to zero (a known gap, issue 16), so only plain rows get one.
  nope = poisoned(rng, T, cfg.kv_lora_rank, in_dtype, huge=not cfg.quantized)
  rope = poisoned(rng, T, cfg.qk_rope_head_dim, in_dtype)
  cache = mc.set_mla_kv_buffer(mc.init_cache(cfg), 1, loc, nope, rope, implementation=impl,
                               sanitize=True)
  got = stored_rows(cache, 1, loc)
  for g, w, name in zip(got, model_rows(cfg, nope, rope), ("kv/nope", "scale", "rope")):
    assert_bits(g, w, name)
    assert np.isfinite(g.astype(F32)).all(), name
  # Whole rows through set_kv_buffer: the same bytes.
  row = np.concatenate([nope, rope], -1)
  other = mc.set_kv_buffer(mc.init_cache(cfg), 1, loc, row, implementation=impl, sanitize=True)
  for g, h in zip(got, stored_rows(other, 1, loc)):
    assert_bits(h, g, "set_kv_buffer")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", [PLAIN[0], PLAIN[3], QUANT[0]], ids=cfg_id)
def test_finite_rows_are_stored_as_without_sanitize(cfg, impl, rng):
  T = 9
  loc = np.arange(T, dtype=np.int32) * 5 + 3
  loc[2] = -1  # skipped either way
  nope = (rng.standard_normal((T, 1, cfg.kv_lora_rank)) * 10).astype(ml_dtypes.bfloat16)
  rope = (rng.standard_normal((T, 1, cfg.qk_rope_head_dim)) * 10).astype(ml_dtypes.bfloat16)
  nope[0] = 0  # an all-zero row (amax below the floor)
  plain = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, nope, rope, implementation=impl)
  clean = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, nope, rope, implementation=impl,
                               sanitize=True)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(clean)):
    assert_bits(b, a, "sanitized finite rows")


def test_without_sanitize_nan_stays_nan():
  cfg = PLAIN[0]
  nope = jnp.ones((1, 1, 512)).at[0, 0, 3].set(jnp.nan)
  cache = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, jnp.array([5]), nope, jnp.ones((1, 1, 64)),
                               implementation="xla")
  assert np.isnan(np.asarray(cache.layer(0)[0][5, 0, 3], F32))


def test_pool_default_and_per_call_override():
  pool = mc.MLATokenToKVPool(size=192, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                             quant_method=None, kv_lora_rank=512, qk_rope_head_dim=64,
                             layer_num=1, page_size=16, implementation="xla", sanitize=True)
  nope = jnp.full((2, 1, 512), jnp.nan, jnp.bfloat16)
  rope = jnp.full((2, 1, 64), jnp.inf, jnp.bfloat16)
  pool.set_mla_kv_buffer(0, jnp.array([3, 4]), nope, rope)
  row = np.asarray(pool.cache.layer(0)[0][3, 0], F32)
  assert (row[:512] == 0).all() and (row[512:] == finite_max(jnp.bfloat16)).all()
  pool.set_kv_buffer(0, jnp.array([5]), jnp.concatenate([nope, rope], -1)[:1], sanitize=False)
  assert np.isnan(np.asarray(pool.cache.layer(0)[0][5, 0, 0], F32))


def test_sharded_writes_take_sanitize():
  from jax.sharding import Mesh
  from jax_mla_cache import sharding as sh
  cfg = mc.SMALL
  layout = sh.ShardedLayout("context_parallel", Mesh(np.array(jax.devices()[:2]), ("c",)), "c")
  cache = sh.init_sharded_cache(cfg, layout)
  nope = jnp.full((2, 1, 512), jnp.nan, jnp.float32)
  rope = jnp.full((2, 1, 64), -jnp.inf, jnp.float32)
  cache = sh.set_mla_kv_buffer(cache, 0, jnp.array([3, 4]), nope, rope, implementation="xla",
                               sanitize=True)
  got = sh.get_mla_kv_buffer(cache, 0, jnp.array([3, 4]), implementation="xla")
  assert (np.asarray(got[0], F32) == 0).all()
  assert (np.asarray(got[1], F32) == -finite_max(jnp.bfloat16)).all()


# ----------------------------------------------------------------------------------------
# the kernels: CUDA lowering on this host (no GPU), and the real kernels on a GPU


@pytest.mark.parametrize("storage,in_dtype", [(jnp.bfloat16, jnp.bfloat16),
                                              (jnp.float8_e4m3fn, jnp.bfloat16),
                                              (jnp.float32, jnp.float32)])
def test_sanitized_set_rows_lowers_for_cuda_in_place(storage, in_dtype):
  import functools
  import pallas_kernels as pk
  from tests.test_pallas_rows import BIG_ROWS, S, assert_aliased, lower_cuda
  for T in (1, 4096):
    text = lower_cuda(functools.partial(pk.set_rows, sanitize=True),
                      S((BIG_ROWS, 1, 576), storage), S((T,), jnp.int32),
                      S((T, 1, 512), in_dtype), S((T, 1, 64), in_dtype), donate=(0,))
    assert_aliased(text, 1)
    bufs = (S((BIG_ROWS, 1, 512), jnp.float8_e4m3fn), S((BIG_ROWS, 1, 1), jnp.float32),
            S((BIG_ROWS, 1, 64), jnp.bfloat16))
    text = lower_cuda(functools.partial(pk.set_rows_per_token_head, sanitize=True), *bufs,
                      S((T,), jnp.int32), S((T, 1, 512), in_dtype), S((T, 1, 64), in_dtype),
                      donate=(0, 1, 2))
    assert_aliased(text, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", PLAIN + QUANT, ids=cfg_id)
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gpu_sanitized_set_kernel_equals_xla(cfg, T):
  """The fused sanitize of the Mosaic GPU set kernels against the XLA reference on the GPU."""
  rng = np.random.default_rng(T)
  cfg = cfg.replace(size=2**16)
  loc = rng.choice(cfg.rows, size=T, replace=False).astype(np.int32)
  nope = poisoned(rng, max(T, 5), cfg.kv_lora_rank, ml_dtypes.bfloat16, huge=not cfg.quantized)[:T]
  rope = poisoned(rng, max(T, 5), cfg.qk_rope_head_dim, ml_dtypes.bfloat16)[:T]
  got = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, nope, rope, implementation="pallas",
                             sanitize=True)
  want = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, nope, rope, implementation="xla",
                              sanitize=True)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_bits(g, w, "pallas vs xla")
    assert np.isfinite(np.asarray(g).astype(F32)).all()
