"""Issue 16, hostile inputs (SPEC §3, §5), on every entry point and both implementations:

* 64-bit / unsigned slots, page ids and token indices outside int32 are skipped (read as
  zeros), never narrowed onto a real row (2**32 + 5 is not row 5);
* per_token_head keeps subnormals as the seed's arithmetic does (XLA:CPU flushes them);
* plain float8_e5m2 with widths that are not multiples of 32 works with the kernels;
* a traced layer_id gets the library's message; vmap and float64 reads have one rule;
* the default implementation falls through from the kernels to XLA for what they do not
  cover, with a warning; an explicit "pallas" raises.

"pallas" on CPU runs the kernels in interpret mode.
"""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mla_cache as mc
import pallas_kernels
from jax_mla_cache import dispatch
from jax_mla_cache import sharding as sh
from tests.numpy_model import NumpyPool
from tests.test_ops import rows_input

IMPLS = ["xla", "pallas"]
QUANT = mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")


# ----------------------------------------------------------------- 64-bit indices
# Each kind holds two indices that wrap onto real rows (5 and 7) when narrowed to int32
# (uint32 cannot wrap onto a row: its large values are still out of range), then valid ones.
WIDE_KINDS = ["numpy_int64", "numpy_uint64", "list", "jax_int64", "jax_uint32", "x64_mode"]


def wrapping(kind: str) -> list[int]:
  if kind == "numpy_uint64":
    return [2**32 + 5, 2**63 + 7]
  if kind == "jax_uint32":
    return [2**32 - 1, 2**31 + 5]
  return [2**32 + 5, -(2**32) + 7]


def as_kind(kind: str, values: list[int]):
  """`values` as the index type `kind` ("x64_mode": an int64 array, used under x64)."""
  if kind in ("numpy_int64", "numpy_uint64"):
    return np.array(values, np.int64 if kind == "numpy_int64" else np.uint64)
  if kind == "list":
    return list(values)
  if kind == "jax_uint32":
    return jnp.array(values, jnp.uint32)
  with jax.enable_x64(True):
    return jnp.array(values, jnp.int64)


def x64_if(kind: str):
  return jax.enable_x64(True) if kind == "x64_mode" else contextlib.nullcontext()


def filled(cfg, rng, rows=(5, 7, 20, 21, 30, 40, 41, 64, 65, 80, 81, 96, 97)):
  """A cache (and its model) with rows written through XLA with int32 slots."""
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  loc = np.array(rows, np.int32)
  nope, rope = rows_input(rng, len(loc), cfg.kv_lora_rank), rows_input(rng, len(loc), cfg.qk_rope_head_dim)
  cache = mc.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation="xla")
  cache = mc.set_mla_kv_buffer(cache, 0, loc, nope[::-1].copy(), rope[::-1].copy(),
                               implementation="xla")
  model.set_mla(1, loc, nope, rope)
  model.set_mla(0, loc, nope[::-1], rope[::-1])
  return cache, model


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", WIDE_KINDS)
def test_wide_indices_never_wrap(kind, impl, rng):
  """set_mla_kv_buffer, set_kv_buffer, get_mla_kv_buffer, move_kv_cache, move_kv_pages."""
  cfg = mc.SMALL
  cache, model = filled(cfg, rng)
  bad = wrapping(kind)
  with x64_if(kind):
    loc = bad + [50, 51]
    nope, rope = rows_input(rng, 4, cfg.kv_lora_rank), rows_input(rng, 4, cfg.qk_rope_head_dim)
    cache = mc.set_mla_kv_buffer(cache, 1, as_kind(kind, loc), nope, rope, implementation=impl)
    model.set_mla(1, np.array(loc, object), nope, rope)
    rows = rows_input(rng, 4, cfg.kv_cache_dim)
    cache = mc.set_kv_buffer(cache, 0, as_kind(kind, loc[::-1]), rows, implementation=impl)
    model.set_mla(0, np.array(loc[::-1], object), rows[..., :512], rows[..., 512:])
    model.assert_equal(cache)

    got = mc.get_mla_kv_buffer(cache, 1, as_kind(kind, bad + [20, 50]), implementation=impl)
    for g, want in zip(got, model.get_mla(1, np.array(bad + [20, 50], object))):
      np.testing.assert_array_equal(np.asarray(g).view(np.uint16), want.view(np.uint16))
    assert not np.asarray(got[0][:2]).astype(np.float32).any()  # not rows 5 and 7

    tgt, src = [bad[0], 30, 31], [40, bad[1], 41]  # the first two pairs are skipped
    cache = mc.move_kv_cache(cache, as_kind(kind, tgt), as_kind(kind, src), implementation=impl)
    model.move(np.array(tgt, object), np.array(src, object))
    model.assert_equal(cache)

    tgt, src = [bad[0], 9, 10], [4, bad[1], 6]  # pages 5 and 7 would be hit by wrapping
    cache = mc.move_kv_pages(cache, as_kind(kind, tgt), as_kind(kind, src), implementation=impl)
    model.move_pages(np.array(tgt, object), np.array(src, object))
    model.assert_equal(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_indices_per_token_head(impl, rng):
  cache, model = filled(QUANT, rng)
  loc = np.array(wrapping("numpy_int64") + [50], np.int64)
  nope, rope = rows_input(rng, 3, 512), rows_input(rng, 3, 64)
  cache = mc.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation=impl)
  model.set_mla(1, loc.astype(object), nope, rope)
  cache = mc.move_kv_cache(cache, loc, np.array([20, 21, 30], np.int64), implementation=impl)
  model.move(loc.astype(object), np.array([20, 21, 30]))
  model.assert_equal(cache)
  got = mc.get_mla_kv_buffer(cache, 1, loc, implementation=impl)
  for g, want in zip(got, model.get_mla(1, loc.astype(object))):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kind", ["numpy_int64", "numpy_uint64", "list", "jax_int64",
                                  "x64_mode"])
def test_wide_token_indices_offload(kind, rng):
  """get_cpu_copy / load_cpu_copy: wrapping indices copy zeros out and are skipped in."""
  cfg = mc.SMALL
  cache, model = filled(cfg, rng)
  bad = wrapping(kind)
  src, dst = bad + [20, 21], [60, 61] + bad[::-1]
  with x64_if(kind):
    copy = mc.get_cpu_copy(cache, as_kind(kind, src), chunk_size=3)
    for layer_id in range(cfg.layer_num):
      chunk = np.concatenate([c[0] for c in copy[layer_id]])
      assert not chunk[:2].astype(np.float32).any()
    cache = mc.load_cpu_copy(cache, copy, as_kind(kind, dst))
  for layer in model.buffers:
    for b in layer:
      copied = [b[r] if 0 <= r < cfg.rows else np.zeros_like(b[0]) for r in src]
      for r, row in zip(dst, copied):
        if 0 <= r < cfg.rows:
          b[r] = row
  model.assert_equal(cache)


def test_wide_indices_pool_debug_checks_and_skips(rng):
  pool = mc.MLATokenToKVPool(size=192, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                             quant_method=None, kv_lora_rank=512, qk_rope_head_dim=64,
                             layer_num=2, page_size=16, implementation="xla", debug_checks=True)
  loc = np.array([3, 2**32 + 5], np.int64)
  nope, rope = rows_input(rng, 2, 512), rows_input(rng, 2, 64)
  with pytest.raises(IndexError, match=r"loc\[1\]=4294967301"):
    pool.set_mla_kv_buffer(0, loc, nope, rope)
  with pytest.raises(IndexError, match=r"tgt_pages\[0\]=4294967298"):
    pool.move_kv_pages(np.array([2**32 + 2], np.int64), np.array([1], np.int64))
  pool.debug_checks = False
  pool.set_mla_kv_buffer(0, loc, nope, rope)
  written = np.asarray(pool.cache.layer(0)[0]).astype(np.float32).any(axis=(1, 2))
  assert np.flatnonzero(written).tolist() == [3]


SHARDED = [("replicated", "xla"), ("context_parallel", "xla"), ("data_parallel", "xla"),
           ("pipeline", "xla"), ("context_parallel", "pallas")]


@pytest.mark.parametrize("kind,impl", SHARDED, ids=[f"{k}-{i}" for k, i in SHARDED])
def test_wide_indices_sharded(kind, impl, rng):
  from tests.test_sharding import PLAIN, Oracle, layout
  cache = sh.init_sharded_cache(PLAIN, layout(kind))
  oracle = Oracle(cache)
  ranks = oracle.world
  per_rank = wrapping("numpy_int64") + [20, 21]
  loc = np.tile(np.array(per_rank, np.int64), ranks)
  nope, rope = rows_input(rng, len(loc), 64), rows_input(rng, len(loc), 16)
  cache = sh.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation=impl)
  oracle.set_mla(1, loc.astype(object), nope, rope)
  rows = rows_input(rng, len(loc), 80)
  cache = sh.set_kv_buffer(cache, 0, loc[::-1].copy(), rows, implementation=impl)
  oracle.set_mla(0, loc[::-1].astype(object), rows[..., :64], rows[..., 64:])
  oracle.assert_equal(cache)
  got = sh.get_mla_kv_buffer(cache, 1, loc, implementation=impl)
  for g, want in zip(got, oracle.get_mla(1, loc.astype(object))):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), want.view(np.uint16))
  src = np.tile(np.array([30, 31, 2**32 + 20, 33], np.int64), ranks)
  cache = sh.move_kv_cache(cache, loc, src, implementation=impl)
  oracle.move(loc.astype(object), src.astype(object))
  pages = np.tile(np.array([2**32 + 5, 3, 4, 2**32 + 6], np.int64), ranks)
  cache = sh.move_kv_pages(cache, pages, pages[::-1].copy(), implementation=impl)
  oracle.move_pages(pages.astype(object), pages[::-1].astype(object))
  oracle.assert_equal(cache)
  if impl == "xla":
    dst = np.tile(np.array([40, 41, 42, 2**32 + 43], np.int64), ranks)
    cache = sh.load_cpu_copy(cache, sh.get_cpu_copy(cache, loc, chunk_size=3), dst)
    oracle.offload_round_trip(loc.astype(object), dst.astype(object))
    oracle.assert_equal(cache)


# ----------------------------------------------------------------- subnormals
TINY = float(np.finfo(np.float32).tiny)


def subnormal_rows(rng, tokens: int, nope_width: int = 512, rope_width: int = 64):
  """(T, 1, R) and (T, 1, Rr) float32 rows, exact in bf16, whose quantization meets
  subnormals: as inputs, as rope / scale quotients and as dequantized products. The first
  8 rows are crafted (rows 0 and 1: the issue's cases); the others draw nope and rope
  magnitudes independently from 1e-44 to 1."""
  nope = np.ones((8, 1, nope_width), np.float32)
  rope = np.full((8, 1, rope_width), 1e-40, np.float32)             # row 0: bf16(1e-40)
  nope[1], rope[1] = 1e-40, 1e-40                                   # both subnormal
  nope[2] = rng.choice([-1, 1], nope_width) * rng.uniform(1e-45, TINY, nope_width)
  rope[2] = rng.choice([-1, 1], rope_width) * rng.uniform(1e-45, TINY, rope_width)
  nope[3] = 1e-3
  rope[3] = rng.standard_normal(rope_width) * 10.0 ** rng.uniform(-45, -36, rope_width)
  nope[4], rope[4] = 448.0, rng.uniform(-2, 2, rope_width) * 1e-39  # scale 1: kept as is
  nope[5], rope[5] = 1e30, rng.standard_normal(rope_width) * 1e-12  # quotients ~4e-40
  nope[6], rope[6] = 0.0, -1e-41                                    # amax floor
  nope[7] = rng.standard_normal(nope_width) * 1e-38
  rope[7] = rng.standard_normal(rope_width) * 1e-38
  n = tokens - 8
  more_nope = rng.standard_normal((n, 1, nope_width)) * 10.0 ** rng.uniform(-44, 0, (n, 1, 1))
  more_rope = rng.standard_normal((n, 1, rope_width)) * 10.0 ** rng.uniform(-44, 0, (n, 1, 1))
  bf16 = ml_dtypes.bfloat16
  return tuple(np.concatenate([a, b.astype(np.float32)]).astype(bf16).astype(np.float32)
               for a, b in ((nope, more_nope), (rope, more_rope)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_per_token_head_subnormals_equal_model(model_dtype, impl, rng):
  cfg = QUANT.replace(model_dtype=model_dtype)
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  nope, rope = subnormal_rows(rng, 64)
  loc = np.arange(10, 74, dtype=np.int32)
  cache = mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation=impl)
  model.set_mla(0, loc, nope, rope)
  model.assert_equal(cache)
  # The issue's two cases, as it gives them (float32 inputs): nope = 1 with rope =
  # bf16(1e-40) stores 4.114e-38; nope = rope = 1e-40 stores 4.49e-12 (not 0).
  issue_nope = np.array([1.0, 1e-40], np.float32)[:, None, None] * np.ones((1, 1, 512), np.float32)
  issue_rope = np.array([np.float32(ml_dtypes.bfloat16(1e-40)), 1e-40], np.float32)[:, None, None]
  issue_rope = issue_rope * np.ones((1, 1, 64), np.float32)
  cache = mc.set_mla_kv_buffer(cache, 0, np.array([100, 101]), issue_nope, issue_rope,
                               implementation=impl)
  model.set_mla(0, np.array([100, 101]), issue_nope, issue_rope)
  model.assert_equal(cache)
  stored = np.asarray(cache.layer(0)[2])[100:102, 0, 0].astype(np.float32)
  inv = np.float32(1) / np.float32(448)
  want = (issue_rope[:, 0, 0] / np.array([inv, np.float32(1e-26) * inv], np.float32))
  np.testing.assert_array_equal(stored, want.astype(model_dtype).astype(np.float32))
  np.testing.assert_allclose(want, [4.114e-38, 4.49e-12], rtol=5e-3)  # the issue rounds
  loc = np.concatenate([loc, [100, 101]]).astype(np.int32)
  for dst in (jnp.float32, jnp.bfloat16):
    got = mc.get_mla_kv_buffer(cache, 0, loc, dst, implementation=impl)
    for g, want in zip(got, model.get_mla(0, loc, dst)):
      g = np.asarray(g)
      np.testing.assert_array_equal(g.view(f"u{g.itemsize}"), want.view(f"u{want.itemsize}"))


# ----------------------------------------------------------------- e5m2 widths
@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn])
def test_fp8_widths_without_register_layout_use_copy_kernel(dtype, rng):
  """R=32, Rr=16: no register layout for 16 columns. Casting through XLA then the copy
  kernel used to recurse forever for e5m2 (its copy path is never "same dtype")."""
  cfg = mc.MLACacheConfig(size=48, page_size=16, kv_lora_rank=32, qk_rope_head_dim=16,
                          layer_num=1, dtype=dtype)
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  loc = np.array([3, 17, -1, 40], np.int32)
  nope, rope = rows_input(rng, 4, 32), rows_input(rng, 4, 16)
  nope[0, 0, :3] = [np.inf, -np.inf, 1e6]  # saturate
  for inputs in ((nope, rope), (nope.astype(dtype), rope.astype(dtype))):
    cache = mc.set_mla_kv_buffer(cache, 0, loc, *inputs, implementation="pallas")
    model.set_mla(0, loc, *inputs)
    model.assert_equal(cache)
  for dst in (None, jnp.float32, jnp.bfloat16):
    got = mc.get_mla_kv_buffer(cache, 0, loc, dst, implementation="pallas")
    for g, want in zip(got, model.get_mla(0, loc, dst)):
      g = np.asarray(g)
      np.testing.assert_array_equal(g.view(f"u{g.itemsize}"), want.view(f"u{want.itemsize}"))


# ----------------------------------------------------------------- layer_id
def test_traced_layer_id_gets_the_library_message():
  cache = mc.init_cache(mc.SMALL)
  loc, nope, rope = jnp.array([1]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64))
  calls = {
      "set_mla_kv_buffer": lambda c, l: mc.set_mla_kv_buffer(c, l, loc, nope, rope),
      "set_kv_buffer": lambda c, l: mc.set_kv_buffer(c, l, loc, jnp.ones((1, 1, 576))),
      "get_mla_kv_buffer": lambda c, l: mc.get_mla_kv_buffer(c, layer_id=l, loc=loc),
  }
  for name, call in calls.items():
    with pytest.raises(TypeError, match=f"{name}: layer_id must be a static Python int"):
      jax.jit(call)(cache, 1)


def test_traced_layer_id_sharded():
  from tests.test_sharding import PLAIN, layout
  for kind in ("replicated", "pipeline"):
    cache = sh.init_sharded_cache(PLAIN, layout(kind))
    with pytest.raises(TypeError, match="layer_id must be a static Python int"):
      jax.jit(lambda c, l: sh.get_mla_kv_buffer(c, l, np.array([1])))(cache, 1)


def test_concrete_integer_layer_id_is_taken_as_its_int():
  cache, model = mc.init_cache(mc.SMALL), NumpyPool(mc.SMALL)
  nope, rope = np.ones((1, 1, 512), np.float32), np.ones((1, 1, 64), np.float32)
  for layer_id in (jnp.int32(1), np.int64(0)):
    cache = mc.set_mla_kv_buffer(cache, layer_id, np.array([4]), nope, rope)
    model.set_mla(int(layer_id), np.array([4]), nope, rope)
  model.assert_equal(cache)
  with pytest.raises(ValueError, match=r"layer_id must be in \[0, 2\), got 2"):
    mc.get_mla_kv_buffer(cache, jnp.int32(2), np.array([4]))
  with pytest.raises(TypeError, match="layer_id must be an int, got ArrayImpl"):
    mc.get_mla_kv_buffer(cache, jnp.array([0, 1]), np.array([4]))


# ----------------------------------------------------------------- vmap
def force_default_pallas(monkeypatch):
  """On CPU the default is "xla": make it the Pallas kernels (interpret mode) falling
  through to XLA, as on sm_90, with a fresh warn-once registry."""
  monkeypatch.setattr(dispatch, "_default_implementation", lambda: "pallas")
  monkeypatch.setattr(dispatch, "_WARNED", set())


def test_vmap_with_explicit_pallas_is_refused_clearly():
  cache, _ = filled(mc.SMALL, np.random.default_rng(0))
  locs = jnp.array([[5, 7], [20, 21]])

  def get(loc):
    return mc.get_mla_kv_buffer(cache, 1, loc, implementation="pallas")

  for batched in (jax.vmap(get), jax.vmap(jax.jit(get))):
    with pytest.raises(NotImplementedError, match=r"get_mla_kv_buffer: .*jax\.vmap.*flat batch"):
      batched(locs)
  flat = get(locs.reshape(-1))  # what the message asks for works
  want = mc.get_mla_kv_buffer(cache, 1, locs.reshape(-1), implementation="xla")
  np.testing.assert_array_equal(np.asarray(flat[0]), np.asarray(want[0]))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_vmap_with_default_implementation_falls_back_to_xla(monkeypatch):
  force_default_pallas(monkeypatch)
  cache, _ = filled(mc.SMALL, np.random.default_rng(0))
  locs = jnp.array([[5, 7], [20, 21], [-1, 300]])
  want = jax.vmap(lambda l: mc.get_mla_kv_buffer(cache, 1, l, implementation="xla"))(locs)
  with pytest.warns(dispatch.FallbackWarning, match="jax.vmap"):
    got = jax.vmap(jax.jit(lambda l: mc.get_mla_kv_buffer(cache, 1, l)))(locs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Writes too: a batch of caches, as XLA's vmap gives (the unbatched cache is donated and
  # cannot hold the batched result: JAX warns that it was not usable).
  nope = jnp.ones((3, 2, 1, 512))
  rope = jnp.ones((3, 2, 1, 64))
  copy = jax.tree.map(jnp.copy, cache)
  with pytest.warns(dispatch.FallbackWarning, match="set_mla_kv_buffer: .*jax.vmap"):
    got = jax.vmap(lambda l, n, r: mc.set_mla_kv_buffer(copy, 1, l, n, r))(locs, nope, rope)
  want = jax.vmap(lambda l, n, r: mc.set_mla_kv_buffer(cache, 1, l, n, r,
                                                       implementation="xla"))(locs, nope, rope)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------- dst_dtype
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", [mc.SMALL, QUANT], ids=["plain", "per_token_head"])
def test_unsupported_dst_dtype_is_one_type_error(cfg, impl):
  cache = mc.init_cache(cfg)
  for dst, x64 in ((jnp.float64, False), (jnp.float64, True), (jnp.float8_e4m3fnuz, False),
                   (np.int8, False)):
    with jax.enable_x64(x64), pytest.raises(
        TypeError, match=r"get_mla_kv_buffer: dst_dtype must be a float dtype of bfloat16, "
                         r"float16, float32, float8_e4m3fn, float8_e5m2, got"):
      mc.get_mla_kv_buffer(cache, 0, np.array([1]), dst, implementation=impl)


def test_kernels_refuse_float64_dst():
  kv = jnp.zeros((32, 1, 576), jnp.bfloat16)
  with pytest.raises(TypeError, match="dst_dtype must be one of .* got float64"):
    pallas_kernels.get_rows(kv, jnp.array([1]), kv_lora_rank=512, dst_dtype=np.float64)


# ----------------------------------------------------------------- default fall-through
UNCOVERED = [
    # rows of 164 bf16 = 328 bytes: no bulk copy (rows, moves)
    mc.MLACacheConfig(size=48, page_size=16, kv_lora_rank=100, qk_rope_head_dim=64, layer_num=2),
    # per_token_head with R = 48: no register layout (set, get); moves are covered
    mc.MLACacheConfig(size=48, page_size=16, kv_lora_rank=48, qk_rope_head_dim=32, layer_num=2,
                      dtype=jnp.float8_e4m3fn, quant_method="per_token_head"),
]


def run_all_ops(cache, implementation, rng):
  cfg = cache.config
  loc = np.array([16, 17, -1, 40], np.int32)
  nope, rope = rows_input(rng, 4, cfg.kv_lora_rank), rows_input(rng, 4, cfg.qk_rope_head_dim)
  cache = mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation=implementation)
  cache = mc.set_kv_buffer(cache, 1, loc, rows_input(rng, 4, cfg.kv_cache_dim),
                           implementation=implementation)
  read = mc.get_mla_kv_buffer(cache, 0, loc, jnp.float32, implementation=implementation)
  cache = mc.move_kv_cache(cache, np.array([20, 16]), np.array([16, 17]),
                           implementation=implementation)
  cache = mc.move_kv_pages(cache, np.array([3]), np.array([1]), implementation=implementation)
  return cache, read


@pytest.mark.parametrize("cfg", UNCOVERED, ids=["plain_R100", "per_token_head_R48"])
def test_default_falls_through_to_xla_with_one_warning(cfg, monkeypatch):
  want_cache, want_read = run_all_ops(mc.init_cache(cfg), "xla", np.random.default_rng(3))
  force_default_pallas(monkeypatch)
  with pytest.warns(dispatch.FallbackWarning) as record:
    cache, read = run_all_ops(mc.init_cache(cfg), None, np.random.default_rng(3))
    run_all_ops(jax.tree.map(jnp.copy, cache), None, np.random.default_rng(4))  # no new warning
  for g, w in zip(jax.tree.leaves((cache, read)), jax.tree.leaves((want_cache, want_read))):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
  messages = [str(w.message) for w in record if w.category is dispatch.FallbackWarning]
  fell = sorted(m.split(":")[0] for m in messages)
  if cfg.quantized:
    assert fell == ["get_mla_kv_buffer", "set_kv_buffer", "set_mla_kv_buffer"]
  else:
    assert fell == ["get_mla_kv_buffer", "move_kv_cache", "move_kv_pages", "set_kv_buffer",
                    "set_mla_kv_buffer"]
  assert all("implementation='xla'" in m for m in messages)


@pytest.mark.parametrize("cfg", UNCOVERED, ids=["plain_R100", "per_token_head_R48"])
def test_explicit_pallas_raises_for_uncovered_widths(cfg):
  cache = mc.init_cache(cfg)
  loc = np.array([16], np.int32)
  nope, rope = np.ones((1, 1, cfg.kv_lora_rank)), np.ones((1, 1, cfg.qk_rope_head_dim))
  reason = "multiple of 16 bytes" if not cfg.quantized else "multiples of 32"
  with pytest.raises(pallas_kernels.Unsupported,
                     match=f"set_mla_kv_buffer: implementation='pallas' does not cover .*{reason}"):
    mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation="pallas")
  with pytest.raises(NotImplementedError, match=f"get_mla_kv_buffer: .*{reason}"):
    mc.get_mla_kv_buffer(cache, 0, loc, implementation="pallas")


def test_pool_and_sharded_ops_keep_the_fall_through(monkeypatch, rng):
  """The wrapper keeps implementation=None per call (it used to resolve it to "pallas" at
  construction), and the sharded ops run the same fall-through in every shard."""
  from tests.test_sharding import layout
  cfg = UNCOVERED[0]
  force_default_pallas(monkeypatch)
  pool = mc.MLATokenToKVPool(size=cfg.size, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                             quant_method=None, kv_lora_rank=100, qk_rope_head_dim=64,
                             layer_num=2, page_size=16)
  assert pool.implementation is None
  nope, rope = rows_input(rng, 2, 100), rows_input(rng, 2, 64)
  with pytest.warns(dispatch.FallbackWarning):
    pool.set_mla_kv_buffer(1, np.array([3, 4]), nope, rope)
  model = NumpyPool(cfg)
  model.set_mla(1, np.array([3, 4]), nope, rope)
  model.assert_equal(pool.cache)
  cache = sh.init_sharded_cache(cfg, layout("replicated"))
  cache = sh.set_mla_kv_buffer(cache, 1, np.array([3, 4]), nope, rope)
  for mine, theirs in zip(model.buffers[1], cache.buffers[1]):
    np.testing.assert_array_equal(np.asarray(theirs).view(np.uint8), mine.view(np.uint8))


# ----------------------------------------------------------------- excess precision
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["set_per_token_head", "set_plain_fp8", "rope_set_per_token_head"])
def test_jitted_producer_values_are_the_arrays_values(op, impl, rng):
  """A jitted step that computes its bf16 rows and writes them: XLA may hand the write the
  producer's unrounded float32 values (excess precision; XLA:CPU does). The write quantizes
  the bf16 arrays' own values: the same bytes as the step run eagerly, on both
  implementations (`exact.as_stored`; before, 655 of the fp8 bytes differed here)."""
  cfg = (mc.SMALL.replace(dtype=jnp.float8_e4m3fn) if op == "set_plain_fp8" else QUANT)
  T, H = 16, 2
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  a, b, ra, rb = f(T, 1, 512), f(T, 1, 512), f(T, 1, 64), f(T, 1, 64)
  qa, qb, qra = f(T, H, 512), f(T, H, 512), f(T, H, 64)
  loc = jnp.arange(T) + cfg.page_size
  table = jnp.asarray(mc.rope.rope_cos_sin_cache(64, 64))

  def step(cache, a, b, ra, rb, qa, qb, qra):
    nope, rope = a * b + a, ra * rb + ra          # bf16 products: rounded in the arrays
    if op.startswith("rope_set"):
      return mc.rope_set_mla_kv_buffer(cache, 0, loc, loc, qa * qb + qa, qra * rb[:, :1] + qra,
                                       nope, rope, table, implementation=impl)
    return mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation=impl)

  args = (a, b, ra, rb, qa, qb, qra)
  eager = step(mc.init_cache(cfg), *args)
  jitted = jax.jit(step)(mc.init_cache(cfg), *args)
  for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("impl", IMPLS)
def test_jitted_query_producer_is_the_arrays_values(impl, rng):
  """As above for `mla_decode`'s q: a jitted step that computes q and attends gives what
  the step gives eagerly (XLA path: 8388 of 16384 outputs differed without the barrier)."""
  cfg = mc.SMALL.replace(layer_num=1)
  cache = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, np.arange(cfg.rows),
                               rows_input(rng, cfg.rows, 512), rows_input(rng, cfg.rows, 64),
                               implementation="xla")
  table = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
  lens = jnp.asarray([60, 33], jnp.int32)
  a, b = (jnp.asarray(rng.standard_normal((2, 1, 16, 576)), jnp.bfloat16) for _ in range(2))
  step = lambda cache, a, b: mc.mla_decode(cache, 0, a * b + a, table, lens, sm_scale=0.05,
                                           implementation=impl)
  for x, y in zip(step(cache, a, b), jax.jit(step)(cache, a, b)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ----------------------------------------------------------------- second pass (2026-12-07c)
# The entry points added since the first pass: the sharded fused write's positions, the
# model steps' token slots and host indices, the decode op's static scale, the pool's
# decode debug checks.
def _rope_args(rng, T: int, H: int = 2):
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  return (f(T, H, 64), f(T, H, 16), f(T, 1, 64), f(T, 1, 16))


@pytest.mark.parametrize("kind", ["replicated", "data_parallel", "context_parallel"])
def test_sharded_rope_set_clamps_wide_host_positions(kind, rng):
  """A numpy int64 position past the table is clamped to its last row, as the unsharded
  op does -- not truncated by the jit (2**32 + 3 was rotated as position 3)."""
  from jax_mla_cache import rope
  from tests.test_sharding import PLAIN, layout
  table = rope.rope_cos_sin_cache(40, 16)
  world = 2 if kind != "data_parallel" else len(jax.devices()[:2])
  args = _rope_args(rng, 2 * world)
  loc = np.tile(np.array([7, 9], np.int64), world)
  wide = np.tile(np.array([2**32 + 3, 5], np.int64), world)
  clamped = np.tile(np.array([39, 5], np.int32), world)
  cache, q = sh.rope_set_mla_kv_buffer(sh.init_sharded_cache(PLAIN, layout(kind)), 0, loc,
                                       wide, *args, table, implementation="xla")
  want_cache, want_q = sh.rope_set_mla_kv_buffer(sh.init_sharded_cache(PLAIN, layout(kind)),
                                                 0, loc, clamped, *args, table,
                                                 implementation="xla")
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
  for got, want in zip(sh.get_mla_kv_buffer(cache, 0, loc), sh.get_mla_kv_buffer(want_cache, 0, loc)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_rope_set_takes_a_list_table(rng):
  from jax_mla_cache import rope
  table = rope.rope_cos_sin_cache(40, 16)
  args = _rope_args(rng, 2)
  loc, pos = np.array([3, 4]), np.array([1, 2**32 + 1], np.int64)
  cfg = mc.SMALL.replace(size=120, page_size=8, kv_lora_rank=64, qk_rope_head_dim=16)
  got = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, pos, *args, table.tolist(),
                                  implementation="xla")[1]
  want = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, loc, np.array([1, 39], np.int32),
                                   *args, table, implementation="xla")[1]
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_token_slots_never_wrap():
  """Model write slots: a negative position, a position past the table, a page id outside
  the cache or one whose rows overflow int32 map to -1 (skipped), never onto a real row
  (page 2**28 + 3 x 16 wrapped to row 48; position -1 wrapped to the table's last page)."""
  from jax_mla_cache.models.mla_demo import token_slots
  table = jnp.array([[5, 2**28 + 3, 9], [2**31 - 1, -1, 20]], jnp.int32)
  positions = jnp.array([[0, 17, 40, 48, -1, -49], [3, 16, 33, 40, -16, 2**31 - 1]], jnp.int32)
  want_cached = [[80, -1, 152, -1, -1, -1], [-1, -1, -1, -1, -1, -1]]
  np.testing.assert_array_equal(token_slots(table, positions, 16, n_pages=16), want_cached)
  want_any = [[80, -1, 152, -1, -1, -1], [-1, -1, 321, 328, -1, -1]]
  np.testing.assert_array_equal(token_slots(table, positions, 16), want_any)


def _demo_model():
  from jax_mla_cache.models import mla_demo
  cache_cfg = mc.MLACacheConfig(size=256, page_size=16, kv_lora_rank=128, qk_rope_head_dim=64,
                                layer_num=1)
  cfg = mla_demo.MLADemoConfig(cache=cache_cfg, hidden_size=64, num_heads=2,
                               qk_nope_head_dim=32, v_head_dim=32, mlp_size=64, vocab_size=32)
  return mla_demo, cache_cfg, mla_demo.init_params(cfg, seed=0)


def _rows_written(cache_cfg, step) -> list[int]:
  cache = mc.init_cache(cache_cfg)
  before = np.asarray(cache.layer(0)[0], np.float32)
  after = np.asarray(step(cache).layer(0)[0], np.float32)
  return np.flatnonzero((before != after).any(axis=(1, 2))).tolist()


@pytest.mark.parametrize("case", ["int64_page", "int64_position", "huge_page", "negative"])
def test_model_decode_step_writes_no_wrapped_row(case):
  """mla_demo.decode with hostile host indices writes nothing (its row does not exist),
  where it used to write row 48 (page 2**32 + 3 narrowed by the jit, or 2**28 + 3 x 16
  overflowing int32) or row 85 / 127 (position 2**32 + 5 narrowed; -1 wrapping)."""
  mla_demo, cache_cfg, params = _demo_model()
  table = {"int64_page": np.array([[2**32 + 3, 4]], np.int64),
           "huge_page": np.array([[2**28 + 3, 4]], np.int32)}.get(
               case, np.array([[5, 6, 7]], np.int32))
  pos = {"int64_position": np.array([2**32 + 5], np.int64),
         "negative": np.array([-1], np.int32)}.get(case, np.array([0], np.int32))
  written = _rows_written(cache_cfg, lambda cache: mla_demo.decode(
      params, cache, jnp.array([1]), pos, table, implementation="xla")[1])
  assert written == []
  # the same step with a good page id writes exactly its row
  good = _rows_written(cache_cfg, lambda cache: mla_demo.decode(
      params, cache, jnp.array([1]), np.array([3]), np.array([[5, 6]]),
      implementation="xla")[1])
  assert good == [5 * 16 + 3]


def test_model_prefill_with_no_tokens_reads_no_wrapped_position():
  """A prompt length of 0 gives the logits at position 0 (clamped), not at the last padded
  position (lengths - 1 = -1 wrapped): they do not depend on the tokens after position 0.
  Nothing but the padding row is written."""
  mla_demo, cache_cfg, params = _demo_model()
  table = np.array([[5]], np.int32)
  results = [mla_demo.prefill(params, mc.init_cache(cache_cfg), jnp.array([tokens], jnp.int32),
                              np.array([0]), table, implementation="xla")
             for tokens in ([3, 4, 5, 6], [3, 9, 10, 11])]
  (logits_a, cache), (logits_b, _) = results
  np.testing.assert_array_equal(np.asarray(logits_a), np.asarray(logits_b))
  rows = np.asarray(cache.layer(0)[0], np.float32)
  assert set(np.flatnonzero(rows.any(axis=(1, 2))).tolist()) <= {0}


@pytest.mark.parametrize("sm_scale,error", [("abc", TypeError), ([0.1], TypeError),
                                            (np.array([0.1, 0.2]), TypeError),
                                            (float("nan"), ValueError),
                                            (float("inf"), ValueError)])
def test_decode_sm_scale_errors_name_it(sm_scale, error):
  cache = mc.init_cache(mc.SMALL)
  q = jnp.ones((1, 1, 2, mc.SMALL.kv_cache_dim), jnp.bfloat16)
  with pytest.raises(error, match="sm_scale"):
    mc.mla_decode(cache, 0, q, np.ones((1, 2), np.int32), np.ones(1, np.int32),
                  sm_scale=sm_scale, implementation="xla")


@pytest.mark.parametrize("layer_id", [True, np.bool_(False)])
def test_bool_layer_id_is_refused(layer_id):
  cache = mc.init_cache(mc.SMALL)
  with pytest.raises(TypeError, match="layer_id must be an int, got a bool"):
    mc.get_mla_kv_buffer(cache, layer_id, np.array([1]), implementation="xla")


def test_pool_decode_debug_checks_name_the_page():
  """debug_checks reads only the pages the lengths reach (-1 padding past a length is the
  documented way to pad a page table) and names a bad one as page_table[b, p]."""
  pool = mc.MLATokenToKVPool(size=256, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                             quant_method=None, kv_lora_rank=128, qk_rope_head_dim=64,
                             layer_num=1, page_size=16, implementation="xla",
                             debug_checks=True)
  q = jnp.ones((2, 1, 2, 192), jnp.bfloat16)
  table = np.array([[1, 2, -1], [3, -1, -1]], np.int32)
  out, lse = pool.mla_decode(0, q, table, np.array([20, 16]), sm_scale=0.1)
  assert out.shape == (2, 1, 2, 128) and np.isfinite(np.asarray(lse)).all()
  with pytest.raises(IndexError, match=r"page_table\[1, 1\]=-1"):
    pool.mla_decode(0, q, table, np.array([20, 17]), sm_scale=0.1)
  with pytest.raises(IndexError, match=r"page_table\[0, 0\]=99"):
    pool.mla_decode(0, q, np.array([[99, 2, -1], [3, -1, -1]]), np.array([1, 1]),
                    sm_scale=0.1)
