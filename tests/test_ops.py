"""Functional ops against the numpy model of the seed, bit for bit (SPEC §3-5)."""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mla_cache as mc
from tests.numpy_model import NumpyPool, quantize

PLAIN = [
    mc.SMALL,
    mc.SMALL_256,
    mc.SMALL.replace(dtype=jnp.float16),
    mc.SMALL.replace(dtype=jnp.float32),
    mc.SMALL.replace(dtype=jnp.float8_e4m3fn),
    mc.SMALL.replace(dtype=jnp.float8_e5m2),
]
QUANT = [
    mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head"),
    mc.SMALL_256.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head"),
    mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head",
                     model_dtype=jnp.float16),
    mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head",
                     model_dtype=jnp.float32),
]
CONFIGS = PLAIN + QUANT


def cfg_id(cfg):
  return f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}-{cfg.dtype.name}-{cfg.quant_method}-{cfg.model_dtype.name}"


def rows_input(rng, tokens, width, dtype=np.float32):
  """Values spanning magnitudes (per-row scale 1e-3..1e3), some past fp8 range."""
  scale = 10.0 ** rng.uniform(-3, 3, (tokens, 1, 1))
  return (rng.standard_normal((tokens, 1, width)) * scale).astype(dtype)


def slots(rng, cfg, tokens, hostile=True):
  loc = rng.choice(cfg.rows, size=tokens, replace=False).astype(np.int32)
  if hostile and tokens >= 4:
    loc[0] = 0                    # padded page 0 is a legal target
    loc[1] = -1                   # padding convention: skipped
    loc[2] = cfg.rows             # stale: skipped
    loc[3] = -cfg.rows - 5        # would wrap in numpy: skipped
  return loc


def fill(cache, model, rng, impl, tokens_list=(1, 5, 33), dtype=np.float32):
  cfg = cache.config
  for layer_id in range(cfg.layer_num):
    for tokens in tokens_list:
      loc = slots(rng, cfg, tokens)
      nope = rows_input(rng, tokens, cfg.kv_lora_rank, dtype)
      rope = rows_input(rng, tokens, cfg.qk_rope_head_dim, dtype)
      cache = mc.set_mla_kv_buffer(cache, layer_id, jnp.asarray(loc), jnp.asarray(nope),
                                   jnp.asarray(rope), implementation=impl)
      model.set_mla(layer_id, loc, nope, rope)
  return cache


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16])
def test_set_get_bit_exact(cfg, in_dtype, rng):
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  cache = fill(cache, model, rng, "xla", dtype=in_dtype)
  model.assert_equal(cache)
  loc = slots(rng, cfg, 40)
  for layer_id in range(cfg.layer_num):
    for dst in (None, jnp.float32, jnp.bfloat16):
      nope, rope = mc.get_mla_kv_buffer(cache, layer_id, jnp.asarray(loc), dst,
                                        implementation="xla")
      want_nope, want_rope = model.get_mla(layer_id, loc, dst)
      chex.assert_shape(nope, (40, 1, cfg.kv_lora_rank))
      chex.assert_shape(rope, (40, 1, cfg.qk_rope_head_dim))
      np.testing.assert_array_equal(np.asarray(nope), want_nope)
      np.testing.assert_array_equal(np.asarray(rope), want_rope)
      # out-of-range slots read as zeros
      assert not np.asarray(nope)[1:4].astype(np.float32).any()


@pytest.mark.parametrize("cfg", [mc.SMALL, QUANT[0]], ids=cfg_id)
def test_set_kv_buffer_is_set_mla_of_the_split_row(cfg, rng):
  a, b = mc.init_cache(cfg), mc.init_cache(cfg)
  loc = jnp.asarray(slots(rng, cfg, 9))
  row = jnp.asarray(rows_input(rng, 9, cfg.kv_cache_dim))
  a = mc.set_kv_buffer(a, 1, loc, row, implementation="xla")
  b = mc.set_mla_kv_buffer(b, 1, loc, row[..., :cfg.kv_lora_rank], row[..., cfg.kv_lora_rank:],
                           implementation="xla")
  chex.assert_trees_all_equal(a, b)


def test_quantization_matches_numpy_division_bits(rng):
  """The XLA path keeps a true division (XLA would rewrite x/bcast(y) to x*(1/y))."""
  from jax_mla_cache import reference
  nope = rows_input(rng, 2048, 512)
  nope[0] = 0.0                        # amax floor 1e-26
  nope[1, 0, :] = 1e-30                # below the floor
  nope[2, 0, 0] = 3e38                 # huge amax
  rope = rows_input(rng, 2048, 64)  # row 2: a few rope / scale are f32-subnormal (kept)
  q, s, r = jax.jit(reference.quantize_per_token_head, static_argnums=2)(
      jnp.asarray(nope), jnp.asarray(rope), jnp.bfloat16)
  wq, ws, wr = quantize(nope, rope, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(s), ws)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), wq.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(r).view(np.uint16), wr.view(np.uint16))


def test_nan_stays_nan():
  cfg = QUANT[0]
  cache = mc.init_cache(cfg)
  nope = jnp.ones((2, 1, 512)).at[0, 0, 7].set(jnp.nan)
  rope = jnp.ones((2, 1, 64))
  cache = mc.set_mla_kv_buffer(cache, 0, jnp.array([5, 6]), nope, rope, implementation="xla")
  n, r = mc.get_mla_kv_buffer(cache, 0, jnp.array([5, 6]), jnp.float32, implementation="xla")
  assert np.isnan(np.asarray(n[0])).all() and np.isnan(np.asarray(r[0])).all()
  assert not np.isnan(np.asarray(n[1])).any()
  plain = mc.init_cache(mc.SMALL.replace(dtype=jnp.float8_e4m3fn))
  plain = mc.set_mla_kv_buffer(plain, 0, jnp.array([5]), nope[:1] * 1000, rope[:1],
                               implementation="xla")
  n, _ = mc.get_mla_kv_buffer(plain, 0, jnp.array([5]), jnp.float32, implementation="xla")
  assert np.isnan(np.asarray(n)[0, 0, 7]) and np.asarray(n)[0, 0, 0] == 448.0  # saturates


@pytest.mark.parametrize("cfg", [mc.SMALL, QUANT[0]], ids=cfg_id)
def test_duplicate_slots_one_writer_wins(cfg, rng):
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  cache = fill(cache, model, rng, "xla")
  loc = np.array([7, 9, 7, 7, 11], np.int32)
  nope, rope = rows_input(rng, 5, cfg.kv_lora_rank), rows_input(rng, 5, cfg.qk_rope_head_dim)
  cache = mc.set_mla_kv_buffer(cache, 0, jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope),
                               implementation="xla")
  got = [np.asarray(b) for b in cache.layer(0)]
  candidates = []
  for i in (0, 2, 3):
    m = NumpyPool(cfg)
    m.set_mla(0, loc[i:i + 1], nope[i:i + 1], rope[i:i + 1])
    candidates.append([b[7] for b in m.buffers[0]])
  assert any(all(np.array_equal(g[7].view(np.uint8), c.view(np.uint8)) for g, c in zip(got, cand))
             for cand in candidates)
  model.set_mla(0, np.array([9, 11]), nope[[1, 4]], rope[[1, 4]])
  for g, m in zip(got, model.buffers[0]):   # every other row as the model
    g, m = g.copy(), m.copy()
    g[7] = m[7] = 0
    np.testing.assert_array_equal(g.view(np.uint8), m.view(np.uint8))


MOVES = {
    "disjoint": ([40, 41, 42], [3, 4, 5]),
    "swap": ([10, 11], [11, 10]),
    "shift_chain": ([21, 22, 23, 24], [20, 21, 22, 23]),
    "self": ([30, 31], [30, 31]),
    "out_of_range": ([-1, 50, 10**6, 51], [5, -3, 6, 10**6]),
    "empty": ([], []),
}


@pytest.mark.parametrize("cfg", [mc.SMALL, QUANT[0]], ids=cfg_id)
@pytest.mark.parametrize("case", MOVES)
def test_move_kv_cache(cfg, case, rng):
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  cache = fill(cache, model, rng, "xla", tokens_list=(150,))
  tgt, src = (np.array(x, np.int32) for x in MOVES[case])
  cache = mc.move_kv_cache(cache, jnp.asarray(tgt), jnp.asarray(src), implementation="xla")
  model.move(tgt, src)
  model.assert_equal(cache)


@pytest.mark.parametrize("cfg", [mc.SMALL, QUANT[0]], ids=cfg_id)
def test_move_kv_pages(cfg, rng):
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  cache = fill(cache, model, rng, "xla", tokens_list=(150,))
  tgt, src = np.array([2, 3, 1, -1, 99], np.int32), np.array([3, 2, 5, 4, 1], np.int32)
  cache = mc.move_kv_pages(cache, jnp.asarray(tgt), jnp.asarray(src), implementation="xla")
  model.move_pages(tgt, src)
  model.assert_equal(cache)


def test_ops_inside_one_jitted_step():
  cfg = QUANT[0]

  @functools.partial(jax.jit, donate_argnums=0)
  def step(cache, loc, nope, rope):
    for layer_id in range(cfg.layer_num):
      cache = mc.set_mla_kv_buffer(cache, layer_id, loc, nope * (layer_id + 1), rope)
    out = mc.get_mla_kv_buffer(cache, 1, loc, jnp.float32)
    return cache, out

  rng = np.random.default_rng(1)
  loc = jnp.array([4, 8])
  nope, rope = jnp.asarray(rows_input(rng, 2, 512)), jnp.asarray(rows_input(rng, 2, 64))
  cache, (n, r) = step(mc.init_cache(cfg), loc, nope, rope)
  model = NumpyPool(cfg)
  for layer_id in range(cfg.layer_num):
    model.set_mla(layer_id, np.asarray(loc), np.asarray(nope) * (layer_id + 1), np.asarray(rope))
  model.assert_equal(cache)
  np.testing.assert_array_equal(np.asarray(n), model.get_mla(1, np.asarray(loc), np.float32)[0])


def test_donated_cache_is_invalidated():
  cache = mc.init_cache(mc.SMALL)
  new = mc.set_mla_kv_buffer(cache, 0, jnp.array([1]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  assert new.layer(0)[0].shape == (mc.SMALL.rows, 1, 576)
  if jax.devices()[0].platform != "cpu":  # CPU ignores donation
    with pytest.raises(RuntimeError, match="deleted|donated"):
      np.asarray(cache.layer(0)[0])
