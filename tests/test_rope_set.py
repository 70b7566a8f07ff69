"""rope_set_mla_kv_buffer (SPEC §8, §9): the fused op against the unfused composition.

CPU: the XLA reference against a float64 numpy model; the Mosaic GPU kernel in interpret
mode against the reference (stored nope bytes and scales bit for bit, rotated values within
one unit in the last place of their stored dtype); deviceless CUDA lowering with the cache
aliased in place. `@pytest.mark.gpu`: the real kernel at DeepSeek-V3 shapes.

The rotation's tolerance: SPEC §8 allows the float32 rotation to round differently (an FMA
fuses one product of a*c - b*s). Where a*c and b*s nearly cancel, that difference, about
2^-24 * (|a*c| + |b*s|), exceeds one unit of a small result, so a rotated value passes when
it is within one ulp of its stored dtype OR within 2^-23 * (|a*c| + |b*s|) (scaled like
the stored value: divided by the row's scale in per_token_head).
Run the GPU ones with:  pytest -m gpu tests/test_rope_set.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mla_cache as mc
import pallas_kernels as pk
from jax_mla_cache import rope, rope_write
from tests.test_ops import cfg_id

F32 = np.float32
BF16 = jnp.bfloat16
MAX_POS = 48
TABLE = rope.rope_cos_sin_cache(MAX_POS, 64)
PLAIN = mc.SMALL.replace(layer_num=2)
PLAIN_FP8 = PLAIN.replace(dtype=jnp.float8_e4m3fn)
QUANT = PLAIN.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
QUANT_F16 = QUANT.replace(model_dtype=jnp.float16)
CONFIGS = [PLAIN, PLAIN_FP8, PLAIN.replace(dtype=jnp.float32), QUANT, QUANT_F16]


# ----------------------------------------------------------------------------------------
# inputs and comparisons


def inputs(rng, cfg, T, H, dtype=BF16, scale=3.0):
  """(q_nope, q_rope, k_nope, k_rope) of `dtype`, magnitudes ~`scale`."""
  R, Rr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  f = lambda *shape: jnp.asarray((rng.standard_normal(shape) * scale).astype(F32)).astype(dtype)
  return f(T, H, R), f(T, H, Rr), f(T, 1, R), f(T, 1, Rr)


def positions_for(rng, T):
  """Token positions: 0, the table's last row, past the table (clamped), negative (clamped)."""
  pos = rng.integers(0, MAX_POS, size=T).astype(np.int32)
  edges = [0, MAX_POS - 1, MAX_POS + 5, -3]
  pos[: min(T, 4)] = edges[: min(T, 4)]
  return pos


def slots_for(rng, cfg, T):
  """Distinct rows, with a negative and an out-of-range slot from T >= 4 (skipped)."""
  loc = rng.choice(cfg.rows, size=T, replace=False).astype(np.int32)
  if T >= 4:
    loc[1], loc[3] = -1, cfg.rows
  return loc


def ordered(x):
  """Float bit patterns as integers in value order (+0 and -0 both 0): adjacent values of a
  dtype differ by one."""
  x = np.asarray(x)
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.int64)
  sign = 1 << (8 * x.dtype.itemsize - 1)
  return np.where(bits & sign, -(bits & (sign - 1)), bits)


def assert_rotated_close(got, want, magnitude, what):
  """Same dtype and shape, NaN in the same places, every other element within one unit in
  the last place of the dtype or within 2^-23 * magnitude (module docstring)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
  gn, wn = np.isnan(got.astype(F32)), np.isnan(want.astype(F32))
  np.testing.assert_array_equal(gn, wn, err_msg=what)
  ulps = np.abs(ordered(got) - ordered(want))
  with np.errstate(invalid="ignore"):
    near = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= 2.0 ** -23 * magnitude
  bad = (ulps > 1) & ~near & ~gn
  assert not bad.any(), (f"{what}: {bad.sum()} elements off by up to {ulps[bad].max()} ulp, "
                         f"e.g. got {got[bad][:4]} want {want[bad][:4]}")


def assert_bits(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


def rotation_magnitude(x, pos, table, is_neox):
  """|a*c| + |b*s| for every rotated element of x (T, h, Rr), float64."""
  half = table.shape[1] // 2
  rows = np.abs(table[np.clip(pos, 0, table.shape[0] - 1)].astype(np.float64))[:, None]
  c, s = rows[..., :half], rows[..., half:]
  x = np.abs(np.asarray(x, np.float64))
  if is_neox:
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c + b * s, b * c + a * s], -1)
  a, b = x[..., 0::2], x[..., 1::2]
  return np.stack([a * c + b * s, b * c + a * s], -1).reshape(x.shape)


def check(cfg, layer, loc, pos, args, table=TABLE, **kw):
  """Run the fused op and the composition on fresh caches and compare (SPEC §8):
  stored nope bytes and scales bit for bit, rotated values as `assert_rotated_close`, the
  nope part of q_out bit for bit. Returns (fused, composition) results."""
  got, want = run_both(cfg, layer, loc, pos, args, table, **kw)
  (cache, q_out), (ref_cache, ref_q) = got, want
  R, rows = cfg.kv_lora_rank, cfg.rows
  is_neox = kw.get("is_neox", False)
  k_rope = np.asarray(args[3], F32)
  if kw.get("sanitize"):
    limit = float(ml_dtypes.finfo(np.asarray(args[3]).dtype).max)
    k_rope = np.nan_to_num(k_rope, nan=0.0, posinf=limit, neginf=-limit)
  mag_k = rotation_magnitude(k_rope, pos, table, is_neox)[:, 0]
  k_mag = np.zeros((rows, 1, cfg.qk_rope_head_dim))
  for i, r in enumerate(np.asarray(loc)):  # in order: the last duplicate wins, as the writes
    if 0 <= r < rows:
      k_mag[r, 0] = mag_k[i]
  for other in range(cfg.layer_num):  # other layers untouched, this one compared below
    if other != layer:
      for a, b in zip(cache.layer(other), ref_cache.layer(other)):
        assert_bits(a, b, f"layer {other}")
  bufs, ref = [np.asarray(b) for b in cache.layer(layer)], [np.asarray(b) for b in ref_cache.layer(layer)]
  if cfg.quantized:
    assert_bits(bufs[0], ref[0], "stored nope (fp8)")
    assert_bits(bufs[1], ref[1], "scales")
    with np.errstate(divide="ignore", invalid="ignore"):  # rows never written: scale 0
      rope_mag = k_mag / ref[1].astype(np.float64)
    assert_rotated_close(bufs[2], ref[2], rope_mag, "stored rope")
  else:
    assert_bits(bufs[0][..., :R], ref[0][..., :R], "stored nope")
    assert_rotated_close(bufs[0][..., R:], ref[0][..., R:], k_mag, "stored rope")
  assert_bits(np.asarray(q_out)[..., :R], np.asarray(ref_q)[..., :R], "q_out nope")
  q_mag = rotation_magnitude(np.asarray(args[1], F32), pos, table, is_neox)
  assert_rotated_close(np.asarray(q_out)[..., R:], np.asarray(ref_q)[..., R:], q_mag,
                       "q_out rope")
  return got, want


def run_both(cfg, layer, loc, pos, args, table=TABLE, **kw):
  """(fused Pallas result, XLA composition result) on fresh caches."""
  fused = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), layer, loc, pos, *args, table,
                                    implementation="pallas", **kw)
  ref = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), layer, loc, pos, *args, table,
                                  implementation="xla", **kw)
  return fused, ref


# ----------------------------------------------------------------------------------------
# the reference against float64 numpy


def np_rope(x, pos, table, is_neox):
  """float64 rotation of x (T, h, Rr) by the (clamped) table rows at pos."""
  half = table.shape[1] // 2
  rows = table[np.clip(pos, 0, table.shape[0] - 1)].astype(np.float64)[:, None]
  c, s = rows[..., :half], rows[..., half:]
  x = np.asarray(x, np.float64)
  if is_neox:
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)
  a, b = x[..., 0::2], x[..., 1::2]
  return np.stack([a * c - b * s, b * c + a * s], -1).reshape(x.shape)


@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("cfg", [PLAIN, PLAIN.replace(dtype=jnp.float32), QUANT], ids=cfg_id)
def test_reference_matches_float64_model(cfg, is_neox, rng):
  T, H = 7, 16
  args = inputs(rng, cfg, T, H, dtype=jnp.float32)
  pos, loc = positions_for(rng, T), slots_for(rng, cfg, T)
  cache, q_out = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 1, loc, pos, *args, TABLE,
                                           is_neox=is_neox, q_out_dtype=BF16,
                                           implementation="xla")
  q_nope, q_rope, k_nope, k_rope = (np.asarray(a) for a in args)
  q_out = np.asarray(q_out, F32)
  assert q_out.shape == (T, H, 576)
  np.testing.assert_array_equal(q_out[..., :512], q_nope.astype(ml_dtypes.bfloat16).astype(F32))
  np.testing.assert_allclose(q_out[..., 512:], np_rope(q_rope, pos, TABLE, is_neox),
                             rtol=2 ** -8, atol=1e-5)
  k_rot = np_rope(k_rope, pos, TABLE, is_neox)
  nope, rope_part = mc.get_mla_kv_buffer(cache, 1, loc, jnp.float32, implementation="xla")
  ok = (loc >= 0) & (loc < cfg.rows)
  tol = dict(rtol=2 ** -7, atol=1e-2) if cfg.quantized else dict(rtol=2 ** -8, atol=1e-5)
  np.testing.assert_allclose(np.asarray(rope_part)[ok], k_rot[ok], **tol)
  if not cfg.quantized:
    np.testing.assert_array_equal(np.asarray(nope)[ok],
                                  k_nope[ok].astype(cfg.dtype).astype(F32))
  assert not np.asarray(cache.layer(0)[0]).astype(F32).any()  # layer 0 untouched


# ----------------------------------------------------------------------------------------
# fused (interpret mode) == composition


@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
@pytest.mark.parametrize("T,H", [(1, 16), (6, 1)])
def test_fused_equals_composition(cfg, is_neox, T, H, rng):
  args = inputs(rng, cfg, T, H)
  pos, loc = positions_for(rng, T), slots_for(rng, cfg, T)
  got, _ = check(cfg, 1, loc, pos, args, is_neox=is_neox)
  assert got[1].dtype == jnp.bfloat16 and got[1].shape == (T, H, 576)


@pytest.mark.parametrize("is_neox", [False, True])
def test_fused_128_heads_and_mixed_dtypes(is_neox, rng):
  """DeepSeek's 128 heads (32 head blocks), f32 q, bf16 k, f32 q_out, a ragged last token
  block (T=5: blocks of 4, the last shifted back)."""
  cfg = QUANT
  q_nope, q_rope, _, _ = inputs(rng, cfg, 5, 128, dtype=jnp.float32)
  _, _, k_nope, k_rope = inputs(rng, cfg, 5, 1)
  pos, loc = positions_for(rng, 5), slots_for(rng, cfg, 5)
  got, _ = check(cfg, 0, loc, pos, (q_nope, q_rope, k_nope, k_rope), is_neox=is_neox,
                 q_out_dtype=jnp.float32)
  assert got[1].dtype == jnp.float32


def test_empty_call_is_a_noop():
  cfg = PLAIN
  cache = mc.init_cache(cfg)
  before = jax.tree.map(np.asarray, cache)
  args = inputs(np.random.default_rng(0), cfg, 0, 16)
  for impl in ("pallas", "xla"):
    cache, q_out = mc.rope_set_mla_kv_buffer(cache, 0, np.zeros(0, np.int32),
                                             np.zeros(0, np.int32), *args, TABLE,
                                             implementation=impl)
    assert q_out.shape == (0, 16, 576) and q_out.dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
    assert_bits(b, a, "empty call")


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_hostile_slots_and_64bit_indices(impl, rng):
  """Negative, >= rows and 64-bit 2**32 + 5 slots are skipped (never wrapped onto row 5);
  64-bit positions past the table are clamped to its last row."""
  cfg = PLAIN
  T = 6
  args = inputs(rng, cfg, T, 2)
  loc = np.array([7, -1, 2**32 + 5, cfg.rows, -(2**40), 9], np.int64)
  pos = np.array([0, 1, 2**40, 3, -(2**33), MAX_POS + 1], np.int64)
  want_pos = np.array([0, 1, MAX_POS - 1, 3, 0, MAX_POS - 1], np.int32)
  for wide in (False, True):  # host numpy int64 (x64 off), then traced int64 (x64 on)
    with jax.enable_x64(wide):
      l, p = (jnp.asarray(loc), jnp.asarray(pos)) if wide else (loc, pos)
      cache, q_out = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, l, p, *args, TABLE,
                                               implementation=impl)
      ref = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, np.array([7, -1, -1, -1, -1, 9]),
                                      want_pos, *args, TABLE, implementation=impl)
    written = np.nonzero(np.asarray(cache.layer(0)[0]).astype(F32).any(axis=(1, 2)))[0]
    np.testing.assert_array_equal(written, [7, 9])
    for a, b in zip(jax.tree.leaves((cache, q_out)), jax.tree.leaves(ref)):
      assert_bits(a, b, f"wide={wide}")


def test_duplicate_slots_write_one_of_the_rows(rng):
  """Interpret mode (like the CPU reference): the last writer wins."""
  cfg = PLAIN
  args = inputs(rng, cfg, 5, 2)
  loc = np.array([4, 9, 4, 4, 11], np.int32)
  check(cfg, 0, loc, positions_for(rng, 5), args)


def test_unsupported_widths_fall_back_to_the_composition(rng):
  """Rr = 32 has no layout in the fused kernel: "pallas" runs the composition with the set
  kernel and still equals the XLA reference."""
  cfg = mc.SMALL_256.replace(qk_rope_head_dim=32, layer_num=1)
  assert pk.rope_set.unsupported_reason(256, 32) is not None
  args = inputs(rng, cfg, 3, 2)
  table = rope.rope_cos_sin_cache(MAX_POS, 32)
  check(cfg, 0, slots_for(rng, cfg, 3), positions_for(rng, 3), args, table)


def test_unfused_op_is_the_composition(rng):
  cfg = QUANT
  args = inputs(rng, cfg, 5, 4)
  pos, loc = positions_for(rng, 5), slots_for(rng, cfg, 5)
  a = rope_write.unfused_rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, pos, *args, TABLE,
                                                implementation="pallas")
  b = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, pos, *args, TABLE,
                                implementation="xla")
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert_bits(x, y, "unfused with the Pallas set kernel vs XLA")


# ----------------------------------------------------------------------------------------
# sanitize (SPEC §9)


def poisoned_inputs(rng, cfg, T, H):
  q_nope, q_rope, k_nope, k_rope = (np.array(a) for a in inputs(rng, cfg, T, H))
  k_nope[1, 0, 5], k_nope[2, 0, 7], k_nope[3, 0, 9] = np.nan, np.inf, -np.inf
  k_rope[1, 0, 2], k_rope[2, 0, 3], k_rope[4, 0, 6] = np.nan, np.inf, -np.inf
  return q_nope, q_rope, k_nope, k_rope


@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("cfg", [PLAIN, PLAIN_FP8, QUANT], ids=cfg_id)
def test_sanitize_every_stored_value_finite(cfg, is_neox, rng):
  T = 6
  args = poisoned_inputs(rng, cfg, T, 2)
  loc = np.arange(T, dtype=np.int32) * 3 + 20
  pos = positions_for(rng, T)
  got, _ = check(cfg, 0, loc, pos, args, is_neox=is_neox, sanitize=True)
  for buf in got[0].layer(0):
    assert np.isfinite(np.asarray(buf)[loc].astype(F32)).all()
  # Rows 0 and 5 are finite: stored exactly as without sanitize.
  plain = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, pos, *args, TABLE,
                                    is_neox=is_neox, implementation="pallas")
  for a, b in zip(got[0].layer(0), plain[0].layer(0)):
    assert_bits(np.asarray(a)[loc[[0, 5]]], np.asarray(b)[loc[[0, 5]]], "finite rows")
  assert_bits(got[1], plain[1], "q_out is never sanitized")
  # NaN in k_nope is stored as 0 (plain) / quantized as 0 (per_token_head).
  nope, _ = mc.get_mla_kv_buffer(got[0], 0, loc[1:2], jnp.float32, implementation="xla")
  assert np.asarray(nope)[0, 0, 5] == 0


def test_sanitize_composition_definition(rng):
  """The reference's sanitize: k_rope's NaN / inf replaced before the rotation, then the
  sanitized set of the float32 rotation."""
  cfg = PLAIN
  q_nope, q_rope, k_nope, k_rope = poisoned_inputs(rng, cfg, 6, 2)
  pos, loc = positions_for(rng, 6), np.arange(6, dtype=np.int32) + 30
  cache, _ = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, pos, q_nope, q_rope, k_nope,
                                       k_rope, TABLE, sanitize=True, implementation="xla")
  limit = F32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  clean = np.where(np.isnan(k_rope.astype(F32)), F32(0), np.clip(k_rope.astype(F32), -limit, limit))
  rot = rope.apply_rope(jnp.asarray(clean), pos, TABLE)
  want = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, k_nope, rot, sanitize=True,
                              implementation="xla")
  assert_bits(cache.layer(0)[0], want.layer(0)[0], "composition")


# ----------------------------------------------------------------------------------------
# bad input, pool, sharding


def bad_calls():
  cfg, rng = PLAIN, np.random.default_rng(0)
  qn, qr, kn, kr = inputs(rng, cfg, 2, 4)
  loc, pos = np.array([1, 2]), np.array([0, 1])
  call = lambda **kw: (lambda c: mc.rope_set_mla_kv_buffer(
      c, kw.pop("layer", 0), kw.pop("loc", loc), kw.pop("pos", pos), kw.pop("qn", qn),
      kw.pop("qr", qr), kw.pop("kn", kn), kw.pop("kr", kr), kw.pop("table", TABLE), **kw))
  return [
      (call(layer=2), ValueError, "layer_id"),
      (call(loc=np.array([1.0, 2.0])), TypeError, "loc must have an integer dtype"),
      (call(pos=np.array([0.0, 1.0])), TypeError, "positions must have an integer dtype"),
      (call(pos=np.array([0, 1, 2])), ValueError, r"positions must have shape \(T,\)"),
      (call(qn=qn[:, :, :256]), ValueError, r"q_nope must have shape \(T, H, 512\)"),
      (call(qr=qr[:, :2]), ValueError, r"q_rope must have shape \(T, 4, 64\)"),
      (call(qr=qr.astype(jnp.int32)), TypeError, "q_rope must have a float dtype"),
      (call(kn=kn[:1]), ValueError, "k_nope must have shape"),
      (call(kr=kr[..., :32]), ValueError, "k_rope"),
      (call(table=TABLE[:, :32]), ValueError, "cos_sin_cache must be a float array of shape"),
      (call(q_out_dtype=jnp.float8_e4m3fn), TypeError, "q_out_dtype must be one of"),
      (call(implementation="triton"), ValueError, "implementation must be"),
  ]


@pytest.mark.parametrize("index", range(12))
def test_errors_name_the_argument(index):
  call, exc, match = bad_calls()[index]
  cache = mc.init_cache(PLAIN)
  before = jax.tree.map(np.asarray, cache)
  with pytest.raises(exc, match=match):
    call(cache)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
    assert_bits(b, a, "nothing written")
  with pytest.raises(TypeError, match="must be an MLAKVCache"):
    mc.rope_set_mla_kv_buffer("cache", 0, [1], [0], *inputs(np.random.default_rng(0), PLAIN, 1, 1),
                              TABLE)


def test_pool_method(rng):
  pool = mc.MLATokenToKVPool(size=192, model_dtype=BF16, dtype=jnp.float8_e4m3fn,
                             quant_method="per_token_head", kv_lora_rank=512,
                             qk_rope_head_dim=64, layer_num=2, page_size=16,
                             implementation="xla", sanitize=True)

  class Layer:
    layer_id = 1

  args = poisoned_inputs(rng, QUANT, 6, 2)
  loc, pos = np.arange(6) + 40, positions_for(rng, 6)
  q_out = pool.rope_set_mla_kv_buffer(Layer(), loc, pos, *args, TABLE, is_neox=True)
  want = mc.rope_set_mla_kv_buffer(mc.init_cache(QUANT), 1, loc, pos, *args, TABLE,
                                   is_neox=True, sanitize=True, implementation="xla")
  for a, b in zip(jax.tree.leaves((pool.cache, q_out)), jax.tree.leaves(want)):
    assert_bits(a, b, "pool (sanitize default on)")
  pool.debug_checks = True
  with pytest.raises(IndexError, match="loc"):
    pool.rope_set_mla_kv_buffer(0, np.array([-1]), np.array([0]),
                                *(a[:1] for a in args), TABLE)


@pytest.mark.parametrize("kind,impl", [("data_parallel", "pallas"), ("context_parallel", "xla"),
                                       ("replicated", "xla"), ("pipeline", "xla")])
def test_sharded_equals_unsharded(kind, impl, rng):
  from jax.sharding import Mesh
  from jax_mla_cache import sharding as sh
  devices = np.array(jax.devices()[:2])
  axis = {"data_parallel": "data", "context_parallel": "context", "pipeline": "stage"}.get(kind, "x")
  layout = sh.ShardedLayout(kind, Mesh(devices, (axis,)), axis)
  cfg = PLAIN
  T = 4
  args = inputs(rng, cfg, T, 2)
  pos = positions_for(rng, T)
  loc = np.array([5, 17, -1, 30], np.int32)
  cache = sh.init_sharded_cache(cfg, layout)
  cache, q_out = sh.rope_set_mla_kv_buffer(cache, 1, loc, pos, *args, TABLE, implementation=impl)
  ref = mc.init_cache(cfg)
  if kind == "data_parallel":  # each rank: its half of the batch into its own pool
    outs = [mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 1, loc[k * 2:(k + 1) * 2],
                                      pos[k * 2:(k + 1) * 2], *(a[k * 2:(k + 1) * 2] for a in args),
                                      TABLE, implementation="xla") for k in range(2)]
    want_q = np.concatenate([np.asarray(o[1]) for o in outs])
    got = np.asarray(cache.cache.layer(1)[0])
    for k, (c, _) in enumerate(outs):
      assert_bits(got[k * cfg.rows:(k + 1) * cfg.rows], c.layer(1)[0], f"rank {k}")
  else:
    ref, want_q = mc.rope_set_mla_kv_buffer(ref, 1, loc, pos, *args, TABLE, implementation="xla")
    nope, rope_part = sh.get_mla_kv_buffer(cache, 1, np.arange(cfg.rows), implementation="xla")
    want = mc.get_mla_kv_buffer(ref, 1, np.arange(cfg.rows), implementation="xla")
    assert_bits(nope, want[0], "nope")
    assert_bits(rope_part, want[1], "rope")
  assert_bits(q_out, want_q, "q_out")


# ----------------------------------------------------------------------------------------
# deviceless CUDA lowering (no GPU needed): the real kernel, the cache aliased in place

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("quant,is_neox,T,H,sanitize", [
    (False, False, 1, 128, False), (False, True, 64, 16, False), (False, False, 4096, 128, True),
    (True, False, 8, 128, False), (True, True, 4096, 16, True), (True, False, 1, 16, False),
])
def test_lowers_for_cuda_in_place(quant, is_neox, T, H, sanitize):
  cfg = (mc.DEEPSEEK_V3_FP8 if quant else mc.DEEPSEEK_V3).replace(layer_num=2)
  cache = mc.cache_spec(cfg)
  args = (S((T,), jnp.int32), S((T,), jnp.int32), S((T, H, 512), BF16), S((T, H, 64), BF16),
          S((T, 1, 512), BF16), S((T, 1, 64), BF16), S((163840, 64), jnp.float32))

  def step(c, *a):
    c, q0 = mc.rope_set_mla_kv_buffer(c, 0, *a, is_neox=is_neox, sanitize=sanitize,
                                      implementation="pallas")
    c, q1 = mc.rope_set_mla_kv_buffer(c, 1, *a, is_neox=is_neox, sanitize=sanitize,
                                      implementation="pallas")
    return c, q0, q1

  text = jax.jit(step, donate_argnums=0).trace(cache, *args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mla_rope_set_rows") >= 2 and "mosaic_gpu" in text
  # Only the fused kernel: no XLA RoPE or concatenate around it.
  assert "stablehlo.concatenate" not in text and "stablehlo.sine" not in text
  n_buffers = len(jax.tree.leaves(cache))
  assert text.count("tf.aliasing_output") == n_buffers
  # Both layers call one kernel function (same static shapes), which aliases its buffers.
  assert text.count("output_operand_aliases") >= 1


@pytest.mark.parametrize("storage,in_dtype,out_dtype,model", [
    (jnp.float8_e4m3fn, jnp.float32, jnp.float32, None),
    (jnp.float8_e5m2, jnp.float16, jnp.float16, None),
    (jnp.float32, BF16, jnp.float32, None),
    (None, jnp.float32, BF16, jnp.float32),
    (None, jnp.float16, jnp.float16, jnp.float16),
])
def test_kernel_dtypes_lower_for_cuda(storage, in_dtype, out_dtype, model):
  """Every storage mode and activation dtype has a kernel (not only bf16)."""
  rows, T, H = 2**18 + 64, 33, 16
  bufs = ((S((rows, 1, 576), storage),) if storage is not None else
          (S((rows, 1, 512), jnp.float8_e4m3fn), S((rows, 1, 1), jnp.float32),
           S((rows, 1, 64), model)))
  f = functools.partial(pk.rope_set_rows, q_out_dtype=out_dtype, sanitize=True)
  text = jax.jit(f, donate_argnums=0).trace(
      bufs, S((T,), jnp.int32), S((T,), jnp.int32), S((T, H, 512), in_dtype),
      S((T, H, 64), in_dtype), S((T, 1, 512), in_dtype), S((T, 1, 64), in_dtype),
      S((4096, 64), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mla_rope_set_rows" in text and text.count("tf.aliasing_output") == len(bufs)


def test_head_blocks_fit_the_shared_memory_budget():
  from pallas_kernels import rope_set
  per_head = 2 * (512 + 64) + 2 * 576
  assert rope_set.heads_per_program(128, lambda hb: 4 * hb * per_head + 10_000) == 4
  assert rope_set.heads_per_program(16, lambda hb: 4 * hb * per_head + 10_000) == 4
  assert rope_set.heads_per_program(7, lambda hb: 4 * hb * per_head) == 1
  assert rope_set.heads_per_program(3, lambda hb: 10 ** 9) == 1


# ----------------------------------------------------------------------------------------
# real GPU (DeepSeek-V3 dims); run with `pytest -m gpu`


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "per_token_head"])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [1, 5, 64, 513, 4096])
def test_gpu_fused_equals_composition(T, H, quant, is_neox):
  rng = np.random.default_rng(T + H)
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1)
  if quant:
    cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  table = rope.cos_sin_cache_from_hf_config(dict(
      qk_rope_head_dim=64, rope_theta=10000.0, max_position_embeddings=163840,
      rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)))
  args = inputs(rng, cfg, T, H)
  loc = rng.choice(cfg.rows, size=T, replace=False).astype(np.int32)
  if T >= 4:
    loc[: T // 8 + 1] = -1  # padding slots
  pos = rng.integers(0, table.shape[0] + 100, size=T).astype(np.int32)
  check(cfg, 0, loc, pos, args, table, is_neox=is_neox)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "per_token_head"])
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gpu_sanitize_and_f32(T, quant):
  """Sanitized rows of NaN / inf, f32 inputs and q_out: kernel vs composition on the GPU."""
  rng = np.random.default_rng(T)
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1)
  if quant:
    cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  args = [np.array(a) for a in inputs(rng, cfg, max(T, 6), 16, dtype=jnp.float32)]
  args[2][1, 0, 5], args[2][2, 0, 7], args[3][3, 0, 9], args[3][4, 0, 1] = (
      np.nan, np.inf, -np.inf, np.nan)
  args = [a[:T] for a in args]
  table = rope.rope_cos_sin_cache(4096, 64)
  loc = rng.choice(cfg.rows, size=T, replace=False).astype(np.int32)
  pos = rng.integers(0, 4096, size=T).astype(np.int32)
  (cache, _), _ = check(cfg, 0, loc, pos, args, table, sanitize=True, q_out_dtype=jnp.float32)
  for buf in cache.layer(0):
    assert np.isfinite(np.asarray(buf)[loc].astype(F32)).all()


@pytest.mark.gpu
def test_gpu_one_kernel_per_call():
  """The fused op is one launch (kernel events of a profiler trace, as the benchmark
  counts them)."""
  from jax_mla_cache import bench
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1)
  rng = np.random.default_rng(0)
  args = inputs(rng, cfg, 8, 128)
  loc = jnp.arange(8, dtype=jnp.int32) + 64
  pos = jnp.arange(8, dtype=jnp.int32)
  table = jnp.asarray(rope.rope_cos_sin_cache(4096, 64))
  # Slots and positions are arguments, as in an engine: closed-over aranges become constants
  # that XLA rebuilds with an iota kernel of its own.
  f = jax.jit(lambda c, *a: mc.rope_set_mla_kv_buffer(c, 0, *a, implementation="pallas")[0],
              donate_argnums=0)
  breakdown = {}
  bench.time_per_call(lambda st: (f(*st), *st[1:]),
                      (mc.init_cache(cfg), loc, pos, *args, table), 5, breakdown)
  assert len(breakdown) == 1 and "mla_rope_set_rows" in next(iter(breakdown)), breakdown
