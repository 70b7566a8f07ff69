"""pallas_kernels row kernels (set/get, plain and per_token_head) against a numpy model.

CPU: the kernels run in Mosaic GPU interpret mode (small shapes), and every kernel variant
is lowered for CUDA without a GPU (deviceless) to catch lowering errors and to check that
the cache is aliased. `@pytest.mark.gpu` tests run the real kernels at DeepSeek-V3 sizes.
Run the GPU ones with:  pytest -m gpu tests/test_pallas_rows.py
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import rows as rows_mod

F32 = np.float32
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
STORAGE = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2]


# ----------------------------------------------------------------------------------------
# numpy model (numpy's `/` is IEEE float32 division; ml_dtypes casts round to nearest even)


def np_cast(x, dtype):
  """float32 -> dtype; fp8 saturates at the max finite value (NaN stays NaN)."""
  dtype = jnp.dtype(dtype)
  x = np.asarray(x, F32)
  if dtype in FP8_MAX:
    x = np.clip(x, -FP8_MAX[dtype], FP8_MAX[dtype])
  with np.errstate(over="ignore", invalid="ignore"):
    return x.astype(dtype)


def np_valid(loc, rows):
  loc = np.asarray(loc)
  return (loc >= 0) & (loc < rows)


def np_set_rows(kv, loc, nope, rope):
  out = np.array(kv)
  row = np.concatenate([np.asarray(nope, F32), np.asarray(rope, F32)], axis=-1)
  for i, r in enumerate(np.asarray(loc)):
    if 0 <= r < kv.shape[0]:
      out[r] = np_cast(row[i], kv.dtype)
  return out


@np.errstate(over="ignore", invalid="ignore")
def np_quantize(nope, rope, rope_dtype):
  x = np.asarray(nope, F32)[:, 0]
  amax = np.max(np.abs(x), axis=-1)
  scale = np.maximum(amax, F32(1e-26)) * (F32(1) / F32(448))
  q = np_cast(x / scale[:, None], E4M3)
  rs = np_cast(np.asarray(rope, F32)[:, 0] / scale[:, None], rope_dtype)
  return q[:, None], scale[:, None, None].astype(F32), rs[:, None]


def np_scatter(buf, loc, vals):
  out = np.array(buf)
  for i, r in enumerate(np.asarray(loc)):
    if 0 <= r < buf.shape[0]:
      out[r] = vals[i]
  return out


def np_gather(buf, loc):
  loc = np.asarray(loc)
  ok = np_valid(loc, buf.shape[0])
  g = np.asarray(buf)[np.where(ok, loc, 0)]
  return np.where(ok.reshape(-1, *([1] * (g.ndim - 1))), g, np.zeros((), g.dtype))


def bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_same(got, want):
  """Bit-exact equality; NaNs only need to be NaN in the same places (payloads differ)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, (got.dtype, want.dtype)
  assert got.shape == want.shape, (got.shape, want.shape)
  gn = np.isnan(got.astype(F32))
  wn = np.isnan(want.astype(F32))
  np.testing.assert_array_equal(gn, wn)
  gb, wb = bits(got), bits(want)
  bad = (gb != wb) & ~gn
  if bad.any():
    idx = np.argwhere(bad)[:5]
    raise AssertionError(
        f"{bad.sum()} elements differ, e.g. at {idx.tolist()}: "
        f"got {got[tuple(idx.T)]} want {want[tuple(idx.T)]}"
    )


# ----------------------------------------------------------------------------------------
# inputs


def hostile_loc(rng, T, rows, *, unique=True):
  """Distinct in-range slots mixed with negative and >= rows ones (and row 0)."""
  loc = rng.choice(rows, size=T, replace=False).astype(np.int32)
  if T >= 3:
    bad = rng.choice(T, size=max(1, T // 4), replace=False)
    loc[bad] = rng.choice([-1, -7, rows, rows + 5, 2**31 - 1, -(2**31)], size=bad.size)
  if T >= 5:
    loc[T // 2] = 0
  if not unique and T >= 4:
    loc[-1] = loc[1] if 0 <= loc[1] < rows else 3
    loc[-2] = loc[-1]
  return loc


@np.errstate(over="ignore")
def values(rng, shape, dtype, *, scale=1.0, specials=True):
  x = (rng.standard_normal(shape) * scale).astype(F32)
  if specials and x.size > 8:
    flat = x.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, 1e6, -1e6, 3e-39]
    rng.shuffle(flat)
  return np.asarray(x.astype(jnp.dtype(dtype)))


def cache(rng, rows, width, dtype):
  return np.asarray(values(rng, (rows, 1, width), dtype, scale=4.0, specials=False))


ROWS = 192
# (R, Rr, T): DeepSeek widths with a single token and a ragged multi-block T, and the
# smaller 256+64 rows.
SHAPES = [(512, 64, 1), (512, 64, 33), (256, 64, 5)]


# ----------------------------------------------------------------------------------------
# interpret mode (CPU)


@pytest.mark.parametrize("R,Rr,T", SHAPES)
@pytest.mark.parametrize("storage", STORAGE)
def test_set_rows_same_dtype(rng, R, Rr, T, storage):
  kv = cache(rng, ROWS, R + Rr, storage)
  loc = hostile_loc(rng, T, ROWS)
  nope = values(rng, (T, 1, R), storage, scale=100.0, specials=storage != jnp.float8_e4m3fn)
  rope = values(rng, (T, 1, Rr), storage, scale=100.0, specials=False)
  out = jax.jit(pk.set_rows)(jnp.asarray(kv), jnp.asarray(loc), jnp.asarray(nope),
                             jnp.asarray(rope))
  assert_same(out, np_set_rows(kv, loc, nope, rope))


@pytest.mark.parametrize("storage,in_dtype", [
    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16), (jnp.float32, jnp.float16),
    (jnp.float8_e4m3fn, jnp.float32), (jnp.float8_e4m3fn, jnp.bfloat16),
    (jnp.float8_e5m2, jnp.float32), (jnp.float8_e5m2, jnp.float16),
])
def test_set_rows_cast(rng, storage, in_dtype):
  R, Rr, T = 256, 64, 5
  kv = cache(rng, ROWS, R + Rr, storage)
  loc = hostile_loc(rng, T, ROWS)
  # Large values: fp8 saturation (448 / 57344), f16 overflow; plus NaN / inf / denormal.
  nope = values(rng, (T, 1, R), in_dtype, scale=3000.0)
  rope = values(rng, (T, 1, Rr), in_dtype, scale=70000.0 if storage == E5M2 else 300.0)
  out = jax.jit(pk.set_rows)(jnp.asarray(kv), jnp.asarray(loc), jnp.asarray(nope),
                             jnp.asarray(rope))
  assert_same(out, np_set_rows(kv, loc, nope, rope))


@pytest.mark.parametrize("T", [2, 33])
def test_set_rows_repack_and_ragged(rng, T):
  """The register-repack variant of the same-dtype set, ragged last block (B=4)."""
  R, Rr = 512, 64
  cfg = pk.RowConfig(set_repack=True, max_reg_block_tokens=4, target_programs=1)
  kv = cache(rng, ROWS, R + Rr, jnp.bfloat16)
  loc = hostile_loc(rng, T, ROWS)
  nope = values(rng, (T, 1, R), jnp.bfloat16)
  rope = values(rng, (T, 1, Rr), jnp.bfloat16)
  f = jax.jit(functools.partial(pk.set_rows, config=cfg))
  out = f(jnp.asarray(kv), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope))
  assert_same(out, np_set_rows(kv, loc, nope, rope))


@pytest.mark.parametrize("cfg", [
    pk.RowConfig(max_block_tokens=8, target_programs=1, chunks=4),  # 4 stages of 2 tokens
    rows_mod.LEGACY_CONFIG,
])
def test_staged_and_legacy_copy_kernels(rng, cfg):
  """Pipelined stages (`chunks`) and the first version's order, ragged last block."""
  R, Rr, T = 512, 64, 19
  kv = cache(rng, ROWS, R + Rr, jnp.bfloat16)
  loc = hostile_loc(rng, T, ROWS)
  nope = values(rng, (T, 1, R), jnp.bfloat16)
  rope = values(rng, (T, 1, Rr), jnp.bfloat16)
  f = jax.jit(functools.partial(pk.set_rows, config=cfg))
  out = f(jnp.asarray(kv), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope))
  assert_same(out, np_set_rows(kv, loc, nope, rope))
  rloc = hostile_loc(rng, T, ROWS, unique=False)
  g = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=jnp.bfloat16,
                                config=cfg))
  gn, gr = g(jnp.asarray(kv), jnp.asarray(rloc))
  want = np_gather(kv, rloc)
  assert_same(gn, want[..., :R])
  assert_same(gr, want[..., R:])


def test_set_rows_duplicates(rng):
  """Duplicate targets in interpret mode: the last writer's row; nothing else changes.

  (On the GPU a duplicated row may mix writers element-wise: `check_rows_with_duplicates`.)
  """
  R, Rr, T = 256, 64, 9
  kv = cache(rng, ROWS, R + Rr, jnp.bfloat16)
  loc = np.array([5, 9, 5, -1, 9, 9, 200, 7, 5], np.int32)
  nope = values(rng, (T, 1, R), jnp.bfloat16, specials=False)
  rope = values(rng, (T, 1, Rr), jnp.bfloat16, specials=False)
  out = np.asarray(jax.jit(pk.set_rows)(jnp.asarray(kv), jnp.asarray(loc),
                                        jnp.asarray(nope), jnp.asarray(rope)))
  assert_same(out, np_set_rows(kv, loc, nope, rope))  # the numpy model: last writer wins


@pytest.mark.parametrize("R,Rr,T", SHAPES)
@pytest.mark.parametrize("storage", STORAGE)
def test_get_rows_same_dtype(rng, R, Rr, T, storage):
  kv = cache(rng, ROWS, R + Rr, storage)
  loc = hostile_loc(rng, T, ROWS, unique=False)
  f = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=storage))
  nope, rope = f(jnp.asarray(kv), jnp.asarray(loc))
  want = np_cast(np_gather(kv, loc).astype(F32), storage)
  assert_same(nope, want[..., :R])
  assert_same(rope, want[..., R:])


@pytest.mark.parametrize("storage,dst", [
    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
    (jnp.float32, jnp.float8_e4m3fn), (jnp.float8_e4m3fn, jnp.bfloat16),
    (jnp.float8_e5m2, jnp.float32), (jnp.bfloat16, jnp.float8_e5m2),
])
def test_get_rows_cast(rng, storage, dst):
  R, Rr, T = 256, 64, 5
  kv = np.asarray(values(rng, (ROWS, 1, R + Rr), storage, scale=1000.0))
  loc = hostile_loc(rng, T, ROWS)
  f = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=dst))
  nope, rope = f(jnp.asarray(kv), jnp.asarray(loc))
  want = np_cast(np_gather(kv, loc).astype(F32), dst)
  assert_same(nope, want[..., :R])
  assert_same(rope, want[..., R:])


def test_get_rows_whole_row_variant(rng):
  """get_split=False: whole-row loads split in registers; ragged blocks of 4."""
  R, Rr, T = 512, 64, 11
  cfg = pk.RowConfig(get_split=False, max_reg_block_tokens=4, target_programs=1)
  kv = cache(rng, ROWS, R + Rr, jnp.bfloat16)
  loc = hostile_loc(rng, T, ROWS)
  f = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=jnp.bfloat16,
                                config=cfg))
  nope, rope = f(jnp.asarray(kv), jnp.asarray(loc))
  want = np_gather(kv, loc)
  assert_same(nope, want[..., :R])
  assert_same(rope, want[..., R:])


@pytest.mark.parametrize("storage,B,T", [
    (jnp.bfloat16, 1, 3), (jnp.bfloat16, 2, 5), (jnp.bfloat16, 4, 11), (jnp.float32, 2, 7),
])
def test_get_rows_direct(rng, storage, B, T):
  """Plain loads and stores (no bulk copies): hostile slots (bad ones read as zeros;
  64-bit ones: test_hostile_inputs through the public op, which takes this path), duplicates,
  ragged last block, row bytes bit-exact (NaN payloads too)."""
  R, Rr = 512, 64
  cfg = pk.RowConfig(direct_block_tokens=B)
  kv = cache(rng, ROWS, R + Rr, storage)
  loc = hostile_loc(rng, T, ROWS, unique=False)
  f = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=storage, config=cfg))
  nope, rope = f(jnp.asarray(kv), jnp.asarray(loc))
  want = np_gather(kv, loc)
  assert_same(nope, want[..., :R])
  assert_same(rope, want[..., R:])


def test_direct_layouts():
  """Which rows the direct gather takes: nope / rope bytes over 128 threads, <= 16 each."""
  layouts = rows_mod.direct_layouts
  assert layouts(512, 64, jnp.bfloat16) == ((1024, 8), (128, 1))
  assert layouts(512, 64, jnp.float32) == ((2048, 16), (256, 2))
  assert layouts(512, 64, jnp.float8_e4m3fn) is None  # 64 rope bytes
  assert layouts(256, 32, jnp.bfloat16) is None
  # Every vector access stays aligned to its width: row starts (the row stride) for both
  # parts and the rope part's offset, for any widths the path takes.
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn):
    for R in range(64, 2049, 64):
      for Rr in (32, 64, 128, 192, 256):
        got = layouts(R, Rr, dtype)
        if got is None:
          continue
        (nb, vn), (rb, vr) = got
        stride = (R + Rr) * jnp.dtype(dtype).itemsize
        assert nb + rb == stride and nb % (128 * vn) == 0 and rb % (128 * vr) == 0
        assert stride % vn == 0 and stride % vr == 0 and nb % vr == 0


@np.errstate(over="ignore")
def pth_inputs(rng, T, R, Rr, in_dtype):
  nope = values(rng, (T, 1, R), F32, scale=3.0, specials=False)
  rope = values(rng, (T, 1, Rr), F32, scale=3.0, specials=False)
  if T >= 5:
    nope[0] = 0.0  # amax below the floor (1e-26): q = 0, rope / 2.2e-29
    rope[0] = 1e-30
    nope[1, 0, 3] = np.nan  # NaN row: everything NaN
    nope[2] *= 1e-20  # tiny amax
    nope[3] *= 1e30  # huge amax
    rope[3] *= 1e30
    nope[4, 0, :] = 1e-41  # denormal nope (amax < floor)
  return nope.astype(in_dtype), rope.astype(in_dtype)


@pytest.mark.parametrize("R,Rr,T,model,in_dtype", [
    (512, 64, 1, jnp.bfloat16, jnp.bfloat16),
    (512, 64, 33, jnp.bfloat16, jnp.float32),
    (256, 64, 5, jnp.float16, jnp.float16),
    (512, 64, 5, jnp.float32, jnp.bfloat16),
])
@pytest.mark.parametrize("direct", [1, 0], ids=["direct", "block"])
def test_per_token_head_set_get(rng, R, Rr, T, model, in_dtype, direct):
  """Both set kernels (one token a program with plain loads and stores; the bulk-copy
  block kernel) against the numpy model: hostile slots, tiny, huge and subnormal rows.
  (jax 0.12 runs the block kernel for both: `rows.ONE_TOKEN_SET`.)"""
  nope, rope = pth_inputs(rng, T, R, Rr, in_dtype)
  qb = values(rng, (ROWS, 1, R), E4M3, specials=False)
  sb = np.abs(values(rng, (ROWS, 1, 1), F32, specials=False))
  rb = values(rng, (ROWS, 1, Rr), model, specials=False)
  loc = hostile_loc(rng, T, ROWS)
  cfg = pk.RowConfig(direct_block_tokens=direct)
  q, s, r = jax.jit(functools.partial(pk.set_rows_per_token_head, config=cfg))(
      jnp.asarray(qb), jnp.asarray(sb), jnp.asarray(rb), jnp.asarray(loc),
      jnp.asarray(nope), jnp.asarray(rope))
  wq, ws, wr = np_quantize(nope, rope, model)
  assert_same(q, np_scatter(qb, loc, wq))
  assert_same(s, np_scatter(sb, loc, ws))
  assert_same(r, np_scatter(rb, loc, wr))

  # Read back (duplicates and bad slots included), dequantized.
  rloc = hostile_loc(rng, T, ROWS, unique=False)
  for dst in dict.fromkeys((jnp.dtype(model), jnp.dtype(jnp.float32))):
    f = jax.jit(functools.partial(pk.get_rows_per_token_head, dst_dtype=dst))
    gn, gr = f(q, s, r, jnp.asarray(rloc))
    gq, gs, grs = (np_gather(np.asarray(a), rloc) for a in (q, s, r))
    assert_same(gn, np_cast(gq.astype(F32) * gs, dst))
    assert_same(gr, np_cast(grs.astype(F32) * gs, dst))


@pytest.mark.parametrize("cfg,T", [
    (pk.RowConfig(max_reg_block_tokens=8, target_programs=1, chunks=2), 13),   # 2 x 4, ragged
    (pk.RowConfig(max_reg_block_tokens=12, target_programs=1, chunks=3), 12),  # 3 x 4
    (pk.RowConfig(max_reg_block_tokens=6, target_programs=1, chunks=4), 7),    # 3 x 2 (6 % 4)
])
def test_per_token_head_set_staged(rng, cfg, T):
  """`RowConfig.chunks` on the per_token_head set: stages of a block, each quantized and
  stored while the next lands; hostile slots (negative, >= rows, int32 extremes), tiny,
  huge and subnormal rows (`pth_inputs`)."""
  R, Rr, model = 512, 64, jnp.bfloat16
  nope, rope = pth_inputs(rng, T, R, Rr, jnp.bfloat16)
  bufs = (values(rng, (ROWS, 1, R), E4M3, specials=False),
          np.abs(values(rng, (ROWS, 1, 1), F32, specials=False)),
          values(rng, (ROWS, 1, Rr), model, specials=False))
  loc = hostile_loc(rng, T, ROWS)
  q, s, r = jax.jit(functools.partial(pk.set_rows_per_token_head, config=cfg))(
      *map(jnp.asarray, bufs), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope))
  for got, buf, want in zip((q, s, r), bufs, np_quantize(nope, rope, model)):
    assert_same(got, np_scatter(buf, loc, want))


def test_per_token_head_true_division(rng):
  """f32 rope storage exposes any x * (1/scale) shortcut (it rounds differently)."""
  R, Rr, T = 256, 64, 33
  nope = values(rng, (T, 1, R), F32, scale=5.0, specials=False)
  rope = values(rng, (T, 1, Rr), F32, scale=5.0, specials=False)
  loc = np.arange(T, dtype=np.int32) * 3
  bufs = (np.zeros((ROWS, 1, R), E4M3), np.zeros((ROWS, 1, 1), F32),
          np.zeros((ROWS, 1, Rr), F32))
  q, s, r = jax.jit(pk.set_rows_per_token_head)(
      *map(jnp.asarray, bufs), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope))
  wq, ws, wr = np_quantize(nope, rope, F32)
  recip = np.asarray(rope, F32)[:, 0] * (F32(1) / ws[:, 0])
  assert (recip != wr[:, 0]).any(), "test data should distinguish x/s from x*(1/s)"
  assert_same(np.asarray(r)[loc], wr)
  assert_same(np.asarray(q)[loc], wq)


def test_empty_and_block_choice():
  kv = jnp.zeros((16, 1, 320), jnp.bfloat16)
  loc = jnp.zeros((0,), jnp.int32)
  out = pk.set_rows(kv, loc, jnp.zeros((0, 1, 256)), jnp.zeros((0, 1, 64)))
  assert out is kv
  n, r = pk.get_rows(kv, loc, kv_lora_rank=256, dst_dtype=jnp.float32)
  assert n.shape == (0, 1, 256) and r.shape == (0, 1, 64) and n.dtype == jnp.float32
  bt = rows_mod.block_tokens
  assert bt(1, 32, 132) == 1 and bt(64, 32, 132) == 1 and bt(512, 32, 132) == 4
  assert bt(4096, 32, 132) == 32 and bt(32768, 32, 132) == 32 and bt(5, 32, 1) == 5
  from pallas_kernels import common
  assert all(common.reg_block_rows(b) % 8 == 4 for b in range(1, 65))
  # Defaults: about 4 programs per SM (528); register blocks filled to 4 mod 8 rows.
  cfg, old = pk.RowConfig(), rows_mod.LEGACY_CONFIG
  copy_b = [rows_mod.copy_block_tokens(t, cfg) for t in (1, 64, 512, 4096, 32768)]
  reg_b = [rows_mod.reg_block_tokens(t, cfg) for t in (1, 64, 512, 4096, 32768)]
  assert copy_b == [1, 1, 1, 8, 32] and reg_b == [1, 1, 1, 12, 12]
  assert [rows_mod.reg_block_tokens(t, old) for t in (512, 1000, 4096)] == [4, 8, 28]
  assert rows_mod.reg_block_tokens(9, pk.RowConfig(target_programs=1)) == 9  # <= T
  sc = rows_mod.stage_count
  assert sc(32, 4) == 4 and sc(12, 5) == 4 and sc(7, 4) == 1 and sc(1, 4) == 1


def test_bad_input():
  kv = jnp.zeros((16, 1, 320), jnp.bfloat16)
  with pytest.raises(ValueError, match="rope"):
    pk.set_rows(kv, jnp.zeros(3, jnp.int32), jnp.zeros((3, 1, 256)), jnp.zeros((3, 1, 32)))
  with pytest.raises(TypeError, match="loc"):
    pk.set_rows(kv, jnp.zeros(3), jnp.zeros((3, 1, 256)), jnp.zeros((3, 1, 64)))
  with pytest.raises(TypeError, match="kv"):
    pk.set_rows(kv.astype(jnp.int8), jnp.zeros(3, jnp.int32), jnp.zeros((3, 1, 256)),
                jnp.zeros((3, 1, 64)))
  with pytest.raises(ValueError, match="kv_lora_rank"):
    pk.get_rows(kv, jnp.zeros(3, jnp.int32), kv_lora_rank=320, dst_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="nope_buf"):
    pk.set_rows_per_token_head(
        kv, jnp.zeros((16, 1, 1)), jnp.zeros((16, 1, 64), jnp.bfloat16),
        jnp.zeros(3, jnp.int32), jnp.zeros((3, 1, 320)), jnp.zeros((3, 1, 64)))
  with pytest.raises(ValueError, match="direct_block_tokens"):
    pk.set_rows_per_token_head(
        jnp.zeros((16, 1, 256), jnp.float8_e4m3fn), jnp.zeros((16, 1, 1)),
        jnp.zeros((16, 1, 64), jnp.bfloat16), jnp.zeros(3, jnp.int32),
        jnp.zeros((3, 1, 256)), jnp.zeros((3, 1, 64)), config=pk.RowConfig(direct_block_tokens=2))


# ----------------------------------------------------------------------------------------
# deviceless CUDA lowering (no GPU needed)

S = jax.ShapeDtypeStruct
BIG_ROWS = 2**18 + 64


def lower_cuda(f, *args, donate=()):
  lowered = jax.jit(f, donate_argnums=donate).trace(*args).lower(
      lowering_platforms=("cuda",))
  return lowered.as_text()


def kernel_operand_counts(text):
  """Operands of each Mosaic GPU custom call in lowered text. The gathers take the buffers
  and the slots only: a zero-row constant operand would be materialized by an XLA
  broadcast kernel on every call (0.66 us on the H200)."""
  return [len(args.split(",")) for args in
          re.findall(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text)]


def assert_aliased(text, n_buffers):
  assert "mosaic_gpu" in text
  # The kernel custom call aliases every cache buffer to an output ...
  assert text.count("output_operand_aliases") >= 1
  # ... and the donated jit arguments are aliased to the jit's outputs.
  assert text.count("tf.aliasing_output") == n_buffers


SET_CASES = [
    # (storage, input dtype, config, T)
    (jnp.bfloat16, jnp.bfloat16, None, 1),
    (jnp.bfloat16, jnp.bfloat16, None, 4096),
    (jnp.bfloat16, jnp.bfloat16, pk.RowConfig(set_repack=True), 33),
    (jnp.bfloat16, jnp.bfloat16, pk.RowConfig(chunks=4), 4096),
    (jnp.bfloat16, jnp.bfloat16, rows_mod.LEGACY_CONFIG, 4096),
    (jnp.bfloat16, jnp.float32, None, 4096),
    (jnp.float16, jnp.bfloat16, None, 33),
    (jnp.float32, jnp.bfloat16, None, 1),
    (jnp.float8_e4m3fn, jnp.bfloat16, None, 4096),
    (jnp.float8_e4m3fn, jnp.float8_e4m3fn, None, 33),
    (jnp.float8_e5m2, jnp.float8_e5m2, None, 1),
    (jnp.float8_e5m2, jnp.float32, None, 33),
]


@pytest.mark.parametrize("storage,in_dtype,cfg,T", SET_CASES)
def test_lower_cuda_set_rows(T, storage, in_dtype, cfg):
  R, Rr = 512, 64
  f = functools.partial(pk.set_rows, config=cfg, pdl=T == 33)
  text = lower_cuda(f, S((BIG_ROWS, 1, R + Rr), storage), S((T,), jnp.int32),
                    S((T, 1, R), in_dtype), S((T, 1, Rr), in_dtype), donate=(0,))
  assert_aliased(text, 1)


@pytest.mark.parametrize("storage,dst,cfg,T", [
    (jnp.bfloat16, jnp.bfloat16, None, 1),
    (jnp.bfloat16, jnp.bfloat16, None, 4096),
    (jnp.bfloat16, jnp.bfloat16, pk.RowConfig(get_split=False), 33),
    (jnp.bfloat16, jnp.bfloat16, pk.RowConfig(chunks=2), 4096),
    (jnp.bfloat16, jnp.bfloat16, rows_mod.LEGACY_CONFIG, 4096),
    (jnp.bfloat16, jnp.float32, None, 4096),
    (jnp.float8_e4m3fn, jnp.bfloat16, None, 33),
    (jnp.float8_e4m3fn, jnp.float8_e4m3fn, None, 1),
    (jnp.float8_e5m2, jnp.float16, None, 1),
    (jnp.float32, jnp.float8_e4m3fn, None, 33),
])
def test_lower_cuda_get_rows(T, storage, dst, cfg):
  R, Rr = 512, 64
  f = functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=dst, config=cfg, pdl=T == 1)
  text = lower_cuda(f, S((BIG_ROWS, 1, R + Rr), storage), S((T,), jnp.int32))
  assert "mosaic_gpu" in text
  assert kernel_operand_counts(text) == [2]  # the buffer and the slots
  # The tuned default moves same-dtype bf16 rows without bulk copies (diag_direct.py).
  direct = cfg is None and storage == dst == jnp.bfloat16
  assert ("mla_get_rows_direct" in text) == direct


@pytest.mark.parametrize("R,Rr,model,in_dtype,T", [
    (512, 64, jnp.bfloat16, jnp.bfloat16, 1),
    (512, 64, jnp.bfloat16, jnp.bfloat16, 4096),
    (512, 64, jnp.float16, jnp.float32, 33),
    (512, 64, jnp.float32, jnp.bfloat16, 4096),
    (256, 64, jnp.float32, jnp.float32, 1),
    (256, 64, jnp.bfloat16, jnp.float16, 33),
])
def test_lower_cuda_per_token_head(T, R, Rr, model, in_dtype):
  bufs = (S((BIG_ROWS, 1, R), E4M3), S((BIG_ROWS, 1, 1), jnp.float32),
          S((BIG_ROWS, 1, Rr), model))
  # The tuned choice (one token a program with plain loads and stores up to T = 256), the
  # block kernel, and two stages of four tokens.
  configs = [None, pk.RowConfig()] + (
      [pk.RowConfig(max_reg_block_tokens=8, chunks=2)] if T > 1 else [])
  for cfg in configs:
    text = lower_cuda(functools.partial(pk.set_rows_per_token_head, pdl=T == 1, config=cfg),
                      *bufs, S((T,), jnp.int32), S((T, 1, R), in_dtype),
                      S((T, 1, Rr), in_dtype), donate=(0, 1, 2))
    assert_aliased(text, 3)
    direct = cfg is None and T <= 256 and rows_mod.ONE_TOKEN_SET
    assert ("mla_set_rows_per_token_head_direct" in text) == direct
  text = lower_cuda(functools.partial(pk.get_rows_per_token_head, dst_dtype=model), *bufs,
                    S((T,), jnp.int32))
  assert kernel_operand_counts(text) == [4]  # the three buffers and the slots


# ----------------------------------------------------------------------------------------
# real GPU (DeepSeek-V3 dims); run with `pytest -m gpu`

GPU_TS = [1, 5, 64, 513, 4096, 32768]


def gpu_loc(rng, T, rows):
  """Distinct random rows, then hostile slots: negative, >= rows, and duplicates."""
  loc = rng.choice(rows, size=T, replace=False).astype(np.int32)
  if T >= 4:
    k = max(1, T // 16)
    idx = rng.choice(T, size=3 * k, replace=False)
    loc[idx[:k]] = rng.choice([-1, -100, rows, rows + 1000, 2**31 - 1], size=k)
    loc[idx[k:2 * k]] = loc[idx[2 * k:]]  # duplicates
  return loc


def same_bits(a, b) -> bool:
  """Bit equality with NaN-aware comparison (NaN payloads may differ)."""
  a, b = np.asarray(a), np.asarray(b)
  an, bn = np.isnan(a.astype(F32)), np.isnan(b.astype(F32))
  return bool(np.array_equal(an, bn) and np.array_equal(bits(a)[~an], bits(b)[~bn]))


def check_rows_with_duplicates(out, before, loc, written):
  """The GPU duplicate-slot contract (pallas_kernels/rows.py docstring), strictly.

  Every element of a targeted row equals, bit for bit (NaN: any NaN), that element of one of
  the tokens that target the row: a row with one writer is exactly that writer's row; a row
  with several may mix them element by element. Every other row is bit-identical to `before`.
  Apply it to each buffer separately (per_token_head buffers may each take different writers).
  """
  out, before, written = np.asarray(out), np.asarray(before), np.asarray(written)
  rows = before.shape[0]
  loc = np.asarray(loc)
  ok = np_valid(loc, rows)
  writers = np.nonzero(ok)[0]
  targets, group = np.unique(loc[writers], return_inverse=True)
  got = out[targets].reshape(len(targets), -1)
  want = written[writers].reshape(len(writers), -1)
  got_b, want_b = bits(got), bits(want)
  got_nan, want_nan = np.isnan(got.astype(F32)), np.isnan(want.astype(F32))
  # Rank of each writer among the writers of its row: writers of one rank have distinct rows.
  order = np.argsort(group, kind="stable")
  first = np.searchsorted(group[order], np.arange(len(targets)))
  rank = np.empty_like(group)
  rank[order] = np.arange(len(group)) - first[group[order]]
  provenance = np.zeros(got.shape, bool)
  for k in range(rank.max(initial=-1) + 1):
    sel = np.nonzero(rank == k)[0]
    g = group[sel]
    provenance[g] |= (got_b[g] == want_b[sel]) | (got_nan[g] & want_nan[sel])
  if not provenance.all():
    bad = np.argwhere(~provenance)[:5]
    raise AssertionError(
        f"{(~provenance).sum()} elements of {(~provenance.all(-1)).sum()} targeted rows come "
        f"from no writer, e.g. (row, element) "
        f"{[(int(targets[i]), int(j)) for i, j in bad]}")
  untouched = np.ones(rows, bool)
  untouched[targets] = False
  np.testing.assert_array_equal(bits(out[untouched]), bits(before[untouched]))


def test_duplicate_checker():
  """The GPU duplicate check accepts element-wise mixes of writers and nothing else."""
  rng = np.random.default_rng(3)
  rows, W = 16, 8
  before = values(rng, (rows, 1, W), jnp.bfloat16, specials=False)
  loc = np.array([3, 5, 3, -1, 3, 20, 9], np.int32)
  written = values(rng, (len(loc), 1, W), jnp.bfloat16, specials=False)
  written[1, 0, 2] = np.nan
  out = np.array(before)
  out[5], out[9] = written[1], written[6]
  out[3, 0, :4], out[3, 0, 4:] = written[4, 0, :4], written[0, 0, 4:]  # torn: two writers
  out[3, 0, 6] = written[2, 0, 6]
  check_rows_with_duplicates(out, before, loc, written)
  for mutate in (
      lambda o: o.__setitem__((3, 0, 1), before[3, 0, 1]),  # an element from no writer
      lambda o: o.__setitem__((9, 0, 0), written[0, 0, 0]),  # single writer row not exact
      lambda o: o.__setitem__((5, 0, 2), 0.0),  # NaN lost
      lambda o: o.__setitem__((0, 0, 0), 7.0),  # an untouched row changed
  ):
    bad = np.array(out)
    mutate(bad)
    with pytest.raises(AssertionError):
      check_rows_with_duplicates(bad, before, loc, written)


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TS)
@pytest.mark.parametrize("storage,in_dtype", [(jnp.bfloat16, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.float32),
                                              (jnp.float8_e4m3fn, jnp.bfloat16),
                                              (jnp.float32, jnp.float32)])
def test_gpu_set_get_rows(T, storage, in_dtype):
  rng = np.random.default_rng(T)
  R, Rr, rows = 512, 64, BIG_ROWS
  kv0 = values(rng, (rows, 1, R + Rr), storage, scale=2.0, specials=False)
  loc = gpu_loc(rng, T, rows)
  nope = values(rng, (T, 1, R), in_dtype, scale=300.0, specials=False)
  rope = values(rng, (T, 1, Rr), in_dtype, scale=300.0, specials=False)
  set_fn = jax.jit(pk.set_rows, donate_argnums=0)
  out = np.asarray(set_fn(jnp.asarray(kv0), jnp.asarray(loc), jnp.asarray(nope),
                          jnp.asarray(rope)))
  written = np_cast(np.concatenate([nope, rope], -1).astype(F32), storage)
  check_rows_with_duplicates(out, kv0, loc, written)
  for dst in {jnp.dtype(storage), jnp.dtype(jnp.float32)}:
    get_fn = jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R, dst_dtype=dst))
    gn, gr = get_fn(jnp.asarray(out), jnp.asarray(loc))
    want = np_cast(np_gather(out, loc).astype(F32), dst)
    assert_same(gn, want[..., :R])
    assert_same(gr, want[..., R:])


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TS)
@pytest.mark.parametrize("model", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("chunks", [1, 2])
def test_gpu_per_token_head(T, model, chunks):
  rng = np.random.default_rng(T + 1)
  R, Rr, rows = 512, 64, BIG_ROWS
  nope, rope = pth_inputs(rng, T, R, Rr, model)
  bufs = (np.zeros((rows, 1, R), E4M3), np.ones((rows, 1, 1), F32),
          np.zeros((rows, 1, Rr), model))
  loc = gpu_loc(rng, T, rows)
  config = None if chunks == 1 else pk.RowConfig(max_reg_block_tokens=8, chunks=chunks)
  set_fn = jax.jit(functools.partial(pk.set_rows_per_token_head, config=config),
                   donate_argnums=(0, 1, 2))
  q, s, r = (np.asarray(a) for a in set_fn(*map(jnp.asarray, bufs), jnp.asarray(loc),
                                            jnp.asarray(nope), jnp.asarray(rope)))
  wq, ws, wr = np_quantize(nope, rope, model)
  check_rows_with_duplicates(q, bufs[0], loc, wq)
  check_rows_with_duplicates(s, bufs[1], loc, ws)
  check_rows_with_duplicates(r, bufs[2], loc, wr)
  get_fn = jax.jit(functools.partial(pk.get_rows_per_token_head, dst_dtype=model))
  gn, gr = get_fn(jnp.asarray(q), jnp.asarray(s), jnp.asarray(r), jnp.asarray(loc))
  gq, gs, grs = (np_gather(a, loc) for a in (q, s, r))
  assert_same(gn, np_cast(gq.astype(F32) * gs, model))
  assert_same(gr, np_cast(grs.astype(F32) * gs, model))


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("direct", [0, 1], ids=["block", "direct"])
def test_gpu_per_token_head_rows_at_every_magnitude(in_dtype, direct):
  """bf16/f16 nope quotients come from a reciprocal and a correction
  (`common.scale_divide`), not a division: the fp8 bytes must still be those of IEEE
  division for rows of every magnitude, tiny rows (amax down to bf16 subnormals, below the
  1e-26 floor, where the kernel lifts the row by 2^64) and signed zeros included. Both
  kernels: the block kernel (one reciprocal a row of a 4-row block) and the one-token
  kernel (each thread's reciprocal of its copy of the scale)."""
  rng = np.random.default_rng(11)
  T, R, Rr, rows = 4096, 512, 64, 8192
  lowest = -140 if in_dtype == jnp.bfloat16 else -26
  exps = np.linspace(lowest, 14, T).round()
  nope = rng.standard_normal((T, 1, R)) * 2.0 ** exps[:, None, None]
  nope *= 2.0 ** rng.integers(-20, 1, (T, 1, R))            # spread within the row
  nope[::7, 0, ::5] = -0.0
  rope = rng.standard_normal((T, 1, Rr)) * 2.0 ** exps[:, None, None]
  with np.errstate(over="ignore"):   # f16 rows past 65504 become inf (scale inf), as meant
    nope, rope = nope.astype(in_dtype), rope.astype(in_dtype)
  bufs = (np.zeros((rows, 1, R), E4M3), np.zeros((rows, 1, 1), F32),
          np.zeros((rows, 1, Rr), in_dtype))
  loc = np.arange(T, dtype=np.int32)
  cfg = pk.RowConfig(direct_block_tokens=direct)
  q, s, r = (np.asarray(a)[:T] for a in jax.jit(
      functools.partial(pk.set_rows_per_token_head, config=cfg))(
      *map(jnp.asarray, bufs), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope)))
  with np.errstate(all="ignore"):
    wq, ws, wr = np_quantize(nope, rope, in_dtype)
  assert_same(s, ws)
  assert_same(q, wq)
  assert_same(r, wr)


@pytest.mark.gpu
def test_gpu_per_token_head_matches_torch_seed():
  """The seed's own PyTorch expressions on the same inputs give the same bytes (SPEC §3)."""
  torch = pytest.importorskip("torch")
  if not torch.cuda.is_available():
    pytest.skip("torch without CUDA")
  rng = np.random.default_rng(7)
  T, R, Rr, rows = 4096, 512, 64, 8192
  nope, rope = pth_inputs(rng, T, R, Rr, np.float32)
  nope = nope.astype(ml_dtypes.bfloat16)
  rope = rope.astype(ml_dtypes.bfloat16)
  tn = torch.from_numpy(nope.astype(F32)).cuda().to(torch.bfloat16)
  tr = torch.from_numpy(rope.astype(F32)).cuda().to(torch.bfloat16)
  # The seed: scale = amax.clamp(min=1e-26) / 448.0 ; q = (nope / scale).clamp(+-448).to(fp8)
  amax = tn.float().abs().amax(dim=-1, keepdim=True)
  scale = amax.clamp(min=1e-26) / 448.0
  tq = (tn.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
  trs = (tr.float() / scale).to(torch.bfloat16)
  loc = np.arange(T, dtype=np.int32)
  bufs = (np.zeros((rows, 1, R), E4M3), np.zeros((rows, 1, 1), F32),
          np.zeros((rows, 1, Rr), jnp.bfloat16))
  q, s, r = jax.jit(pk.set_rows_per_token_head)(*map(jnp.asarray, bufs), jnp.asarray(loc),
                                                jnp.asarray(nope), jnp.asarray(rope))
  assert_same(np.asarray(s)[:T], scale.cpu().numpy())
  assert_same(np.asarray(q)[:T], tq.view(torch.uint8).cpu().numpy().view(E4M3))
  assert_same(np.asarray(r)[:T],
              trs.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16))
