"""mla_decode (SPEC §7): the XLA reference against a float64 numpy model, the Mosaic GPU
kernel (interpret mode on CPU, real on the GPU) against the reference, bad input, and the
kernel's CUDA lowering."""


import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_mla_cache as mc
from pallas_kernels import mla_decode as kernel
from pallas_kernels import mla_decode_parts as parts


# ----------------------------------------------------------------- float64 model
def decode64(buffers, q, page_table, seq_lens, *, sm_scale, page_size, kv_lora_rank):
  """SPEC §7 in float64 numpy, one query at a time."""
  buffers = [np.asarray(b) for b in buffers]
  q = np.asarray(q, np.float64)
  page_table = np.asarray(page_table, np.int64)
  seq_lens = np.asarray(seq_lens, np.int64)
  B, s_q, H, W = q.shape
  R = kv_lora_rank
  rows = buffers[0].shape[0]
  P = page_table.shape[1]
  out = np.zeros((B, s_q, H, R))
  lse = np.full((B, s_q, H), -np.inf)
  for b in range(B):
    n = min(max(int(seq_lens[b]), 0), P * page_size)
    for j in range(s_q):
      keys = []
      for p in range(n - s_q + j + 1):
        page = page_table[b, p // page_size]
        if not 0 <= page < rows // page_size:
          continue
        r = page * page_size + p % page_size
        if len(buffers) == 3:
          nope, scale, rope = (x[r, 0].astype(np.float64) for x in buffers)
          keys.append(np.concatenate([nope, rope]) * scale[0])
        else:
          keys.append(buffers[0][r, 0].astype(np.float64))
      if not keys:
        continue
      k = np.stack(keys)
      s = sm_scale * (k @ q[b, j].T)                       # (n, H)
      m = s.max(0)
      e = np.exp(s - m)
      out[b, j] = (e.T @ k[:, :R]) / e.sum(0)[:, None]
      lse[b, j] = m + np.log(e.sum(0))
  return out, lse


def filled_cache(cfg, rng, spread=2.0):
  """A one-layer cache with random rows of magnitudes 10^[-spread, spread]."""
  cache = mc.init_cache(cfg.replace(layer_num=1))
  rows = cfg.rows
  mag = 10.0 ** rng.uniform(-spread, spread, (rows, 1, 1))
  nope = jnp.asarray(rng.standard_normal((rows, 1, cfg.kv_lora_rank)) * mag, jnp.bfloat16)
  rope = jnp.asarray(rng.standard_normal((rows, 1, cfg.qk_rope_head_dim)) * mag, jnp.bfloat16)
  return mc.set_mla_kv_buffer(cache, 0, jnp.arange(rows), nope, rope, implementation="xla")


def problem(cfg, rng, B, s_q, H, P, *, bad_pages=True, q_dtype=jnp.bfloat16):
  npages = cfg.rows // cfg.page_size
  table = rng.integers(0, npages, (B, P)).astype(np.int32)
  if bad_pages:
    table[0, min(1, P - 1)] = npages + 5       # out of range: masked
    table[-1, 0] = -3
  lens = rng.integers(-2, P * cfg.page_size + 5, (B,)).astype(np.int32)
  lens[0] = P * cfg.page_size
  q = jnp.asarray(rng.standard_normal((B, s_q, H, cfg.kv_cache_dim)) * 0.05, q_dtype)
  return q, table, lens


def assert_close(got, want, *, rtol=1e-2, lse_atol=1e-2):
  out, lse = (np.asarray(x, np.float64) for x in got)
  want_out, want_lse = want
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(lse[finite], want_lse[finite], atol=lse_atol, rtol=0)
  err = np.sqrt(np.sum((out - want_out) ** 2) / max(np.sum(want_out ** 2), 1e-30))
  assert err <= rtol, f"relative RMS error {err:.3g} > {rtol}"
  assert np.all(out[~finite] == 0)


def assert_rows_close(out, want_out, *, rtol=1e-2):
  """Every query row's relative RMS error (over its R values) within rtol."""
  out = np.asarray(out, np.float64)
  rel = np.sqrt(((out - want_out) ** 2).sum(-1) / (want_out ** 2).sum(-1))
  assert rel.max() < rtol, rel.max()


CONFIGS = {
    "bf16": mc.SMALL.replace(size=1024, page_size=16),
    "pth": mc.SMALL.replace(size=1024, page_size=16, dtype=jnp.float8_e4m3fn,
                            quant_method="per_token_head"),
}


# ----------------------------------------------------------------- reference
@pytest.mark.parametrize("mode", ["bf16", "pth"])
@pytest.mark.parametrize("s_q", [1, 3])
def test_reference_matches_float64(mode, s_q, rng):
  cfg = CONFIGS[mode]
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=3, s_q=s_q, H=4, P=5)
  lens[1] = 0
  got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.3, implementation="xla")
  chex.assert_shape(got[0], (3, s_q, 4, 512))
  chex.assert_shape(got[1], (3, s_q, 4))
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
  want = decode64(cache.layer(0), q, table, lens, sm_scale=0.3, page_size=16, kv_lora_rank=512)
  assert_close(got, want)


def test_reference_float32_is_tight(rng):
  cfg = mc.SMALL.replace(size=512, page_size=16, dtype=jnp.float32)
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=2, s_q=2, H=3, P=4, q_dtype=jnp.float32)
  got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.2, implementation="xla")
  want = decode64(cache.layer(0), q, table, lens, sm_scale=0.2, page_size=16, kv_lora_rank=512)
  assert_close(got, want, rtol=1e-5, lse_atol=1e-4)   # lse ~40: 1e-4 is a few f32 ulps


def test_empty_and_masked_queries_give_zeros_and_neg_inf(rng):
  cfg = CONFIGS["bf16"]
  cache = filled_cache(cfg, rng)
  q = jnp.ones((3, 2, 2, 576), jnp.bfloat16)
  npages = cfg.rows // cfg.page_size
  table = np.array([[1, 2], [3, 4], [npages, -1]], np.int32)
  lens = np.array([0, 1, 20], np.int32)   # b=1: query 0 sees nothing; b=2: only bad pages
  out, lse = mc.mla_decode(cache, 0, q, table, lens, sm_scale=1.0, implementation="xla")
  lse = np.asarray(lse)
  assert np.all(np.isneginf(lse[0])) and np.all(np.isneginf(lse[1, 0]))
  assert np.all(np.isfinite(lse[1, 1])) and np.all(np.isneginf(lse[2]))
  assert np.all(np.asarray(out)[np.isneginf(lse)] == 0)


def poison(layer, table, lens, page_size):
  """`layer`'s buffers with NaN / inf rows wherever no query may look: page 0 (what a
  masked page id reads), and every row past a sequence's length in its pages (stale rows
  of a reused page, or garbage that padding tokens wrote)."""
  layer = [np.array(x) for x in layer]
  npages = layer[0].shape[0] // page_size
  B, P = table.shape
  lengths = np.clip(lens, 0, P * page_size)
  pos = np.arange(P * page_size)
  pages = table[:, pos // page_size]                            # (B, L)
  rows = pages * page_size + pos % page_size
  ok = (pages >= 0) & (pages < npages)
  seen = ok & (pos[None] < lengths[:, None])
  hidden = ok & ~seen
  bad = np.setdiff1d(np.concatenate([np.arange(page_size), rows[hidden]]), rows[seen])
  for i, x in enumerate(layer):
    x[bad] = np.array(np.nan if i % 2 == 0 else np.inf).astype(x.dtype)
  return tuple(jnp.asarray(x) for x in layer)


def poisoned(cfg, rng, B, s_q, H, P):
  """A problem (`problem`, valid pages 1..npages-1, one partial last page) on a `poison`ed
  cache."""
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B, s_q, H, P)
  table = np.where(table == 0, 1, table).astype(np.int32)
  lens[1 % B] = P * cfg.page_size - 3
  return poison(cache.layer(0), table, lens, cfg.page_size), q, table, lens


@pytest.mark.parametrize("mode", ["bf16", "pth"])
def test_reference_ignores_garbage_rows_it_may_not_see(mode, rng):
  """NaN / inf rows on masked pages and past the lengths do not reach the output."""
  cfg = CONFIGS[mode]
  layer, q, table, lens = poisoned(cfg, rng, B=3, s_q=2, H=4, P=5)
  args = dict(sm_scale=0.3, page_size=16, kv_lora_rank=512)
  got = jax.jit(lambda *a: mc.attention.mla_decode_reference(*a, **args))(
      layer, q, jnp.asarray(table), jnp.asarray(lens))
  assert np.all(np.isfinite(np.asarray(got[0], np.float32)))
  assert_close(got, decode64(layer, q, table, lens, **args))


# ----------------------------------------------------------------- bad input
def test_bad_arguments_raise_clear_errors(rng):
  cfg = CONFIGS["bf16"]
  cache = mc.init_cache(cfg)
  q = jnp.zeros((2, 1, 4, 576), jnp.bfloat16)
  table, lens = np.zeros((2, 3), np.int32), np.ones((2,), np.int32)
  with pytest.raises(ValueError, match="q must have shape"):
    mc.mla_decode(cache, 0, q[..., :512], table, lens, sm_scale=1.0)
  with pytest.raises(TypeError, match="q must be"):
    mc.mla_decode(cache, 0, q.astype(jnp.int32), table, lens, sm_scale=1.0)
  with pytest.raises(ValueError, match="page_table must have shape"):
    mc.mla_decode(cache, 0, q, table[:1], lens, sm_scale=1.0)
  with pytest.raises(ValueError, match="seq_lens must have shape"):
    mc.mla_decode(cache, 0, q, table, lens[:1], sm_scale=1.0)
  with pytest.raises(TypeError, match="page_table must have an integer dtype"):
    mc.mla_decode(cache, 0, q, table.astype(np.float32), lens, sm_scale=1.0)
  with pytest.raises(ValueError, match="layer_id"):
    mc.mla_decode(cache, 5, q, table, lens, sm_scale=1.0)
  with pytest.raises(TypeError, match="layer_id must be a static"):
    jax.jit(lambda c, l: mc.mla_decode(c, l, q, table, lens, sm_scale=1.0))(cache, 0)
  with pytest.raises(TypeError, match="sm_scale must be a Python float"):
    jax.jit(lambda c, s: mc.mla_decode(c, 0, q, table, lens, sm_scale=s))(cache, 1.0)
  with pytest.raises(TypeError, match="cache must be an MLAKVCache"):
    mc.mla_decode(cache.buffers, 0, q, table, lens, sm_scale=1.0)


def test_64_bit_page_ids_and_lengths_do_not_wrap(rng):
  cfg = CONFIGS["bf16"]
  cache = filled_cache(cfg, rng)
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 576)), jnp.bfloat16)
  good = np.array([[2, 3]], np.int64)
  wrapped = good + np.int64(2**32)                    # would be pages 2, 3 if narrowed
  out, lse = mc.mla_decode(cache, 0, q, wrapped, np.array([32], np.int64), sm_scale=1.0,
                           implementation="xla")
  assert np.all(np.isneginf(np.asarray(lse))) and not np.any(np.asarray(out))
  big_len = np.array([2**32 + 5], np.int64)           # clamped to P * page_size, not 5
  got = mc.mla_decode(cache, 0, q, good, big_len, sm_scale=1.0, implementation="xla")
  want = mc.mla_decode(cache, 0, q, good, np.array([32]), sm_scale=1.0, implementation="xla")
  chex.assert_trees_all_equal(got, want)


def test_kernel_page_table_operand():
  """make_meta: safe ids (-1 where out of range, 64-bit ids range-checked before
  narrowing), clamped lengths, and the count of masked pages under each length (pages
  past the length, masked or not, do not count: engines pad tables with -1)."""
  table = np.array([[3, -1, 2**32 + 1, 7], [5, 6, -1, -1], [9, 99, 1, 2]], np.int64)
  lens = np.array([40, 20, 2**33 + 7], np.int64)
  with jax.enable_x64(True):
    meta = np.asarray(kernel.make_meta(jnp.asarray(table), jnp.asarray(lens), n_pages=10,
                                       page_size=16))
  assert meta.dtype == np.int32 and meta.shape == (3, 6)
  np.testing.assert_array_equal(meta[:, :4], [[3, -1, -1, 7], [5, 6, -1, -1], [9, -1, 1, 2]])
  np.testing.assert_array_equal(meta[:, 4], [40, 20, 64])
  np.testing.assert_array_equal(meta[:, 5], [2, 0, 1])


def test_default_falls_back_to_xla_where_the_kernel_does_not_apply(monkeypatch, rng):
  cfg = mc.SMALL.replace(size=508, page_size=4)     # page_size 4: not a kernel shape
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=2, s_q=1, H=2, P=3)
  monkeypatch.setattr(mc.dispatch, "_default_implementation", lambda: "pallas")
  mc.dispatch._WARNED.clear()
  with pytest.warns(mc.dispatch.FallbackWarning, match="page_size 4"):
    got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.5)
  want = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.5, implementation="xla")
  chex.assert_trees_all_equal(got, want)
  with pytest.raises(NotImplementedError, match="page_size 4"):
    mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.5, implementation="pallas")


def test_kernel_shape_limits_are_named():
  kv = jnp.zeros((80, 1, 576), jnp.bfloat16)
  pth = (jnp.zeros((80, 1, 512), jnp.float8_e4m3fn), jnp.zeros((80, 1, 1), jnp.float32),
         jnp.zeros((80, 1, 64), jnp.bfloat16))
  q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
  assert kernel.check_supported((kv,), q, page_size=16, kv_lora_rank=512) is None
  assert "page_size 16" in kernel.check_supported(pth, q, page_size=16, kv_lora_rank=512)
  assert kernel.check_supported(pth, q, page_size=32, kv_lora_rank=512) is None
  assert "page_size 12" in kernel.check_supported((kv,), q, page_size=12, kv_lora_rank=512)
  assert "R % 128" in kernel.check_supported((kv,), q, page_size=16, kv_lora_rank=448)
  assert "differs" in kernel.check_supported((kv,), q.astype(jnp.float16), page_size=16,
                                             kv_lora_rank=512)


@pytest.mark.parametrize("rows_last", [False, True])
@pytest.mark.parametrize("S", [2, 3, 8, 9])   # unrolled up to UNROLLED_SPLITS, reduced above
def test_combine_merges_splits_by_lse(rows_last, S, rng):
  B, Q, R = 3, 5, 7
  out = rng.standard_normal((B, S, R, Q) if rows_last else (B, S, Q, R)).astype(np.float32)
  lse = (rng.standard_normal((B, S, Q)) * 5).astype(np.float32)
  lse[0] = -np.inf                  # a sequence no split saw anything of
  lse[1, 0] = -np.inf               # one empty split
  got_out, got_lse = kernel.combine(jnp.asarray(out), jnp.asarray(lse), jnp.float32,
                                    rows_last=rows_last)
  o = out.astype(np.float64)
  o = o.swapaxes(2, 3) if rows_last else o
  m = lse.astype(np.float64).max(axis=1, keepdims=True)
  m = np.where(np.isneginf(m), 0.0, m)
  w = np.exp(lse - m)
  den = w.sum(axis=1)
  safe = np.where(den > 0, den, 1.0)
  want_out = np.where(den[..., None] > 0, (w[..., None] * o).sum(axis=1) / safe[..., None], 0.0)
  want_lse = np.where(den > 0, np.log(safe) + m[:, 0], -np.inf)
  np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_lse), want_lse, rtol=1e-6)
  assert np.isneginf(np.asarray(got_lse)[0]).all() and not np.asarray(got_out)[0].any()


def test_split_count():
  assert kernel.split_count(64, 1, 64, 132) == 2
  assert kernel.split_count(128, 1, 64, 132) == 1
  assert kernel.split_count(1, 1, 64, 132) == 64      # capped by the blocks
  assert kernel.split_count(128, 2, 64, 132) == 1


# ----------------------------------------------------------------- the kernel, interpreted
KERNEL_CASES = [
    # mode, page_size, B, s_q, H, P, splits, path
    ("bf16", 16, 3, 1, 16, 10, None, "narrow"),
    ("bf16", 16, 3, 1, 16, 10, None, "wide"),
    ("bf16", 64, 2, 3, 24, 3, 2, "wide"),       # 72 query rows: two M tiles
    ("bf16", 64, 2, 3, 8, 3, 2, "narrow"),      # 24 query rows padded to 32, queries causal
    ("pth", 32, 2, 2, 16, 5, 3, "narrow"),
    ("pth", 32, 2, 2, 16, 5, 3, "wide"),
    ("pth", 64, 2, 1, 8, 3, 1, "wide"),
    ("pth", 64, 2, 1, 5, 3, 1, "narrow"),       # 5 rows padded to 16
    ("pth", 32, 2, 1, 16, 5, 3, "registers"),   # two copies per block, three splits
    ("pth", 64, 2, 1, 5, 3, 1, "registers"),    # 5 rows padded to 16
    ("pth", 64, 3, 2, 8, 4, 2, "registers"),    # 16 rows, queries causal
]


@pytest.mark.parametrize("mode,page_size,B,s_q,H,P,splits,path", KERNEL_CASES)
def test_kernel_interpret_matches_reference(mode, page_size, B, s_q, H, P, splits, path, rng):
  cfg = CONFIGS[mode].replace(page_size=page_size, size=1024 - page_size + 16 * page_size)
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B, s_q, H, P)
  layer = cache.layer(0)
  args = dict(sm_scale=0.2, page_size=page_size, kv_lora_rank=512)
  config = kernel.DecodeConfig(path=path)
  got = jax.jit(lambda *a: kernel.mla_decode(*a, num_splits=splits, config=config, **args))(
      layer, q, jnp.asarray(table), jnp.asarray(lens))
  want = decode64(layer, q, table, lens, **args)
  assert_close(got, want)


@pytest.mark.parametrize("mode", ["bf16", "pth"])
def test_bench_gather_baseline_matches_reference(mode, rng):
  """The benchmark's gather + XLA attention baseline computes SPEC §7 (bf16 products)."""
  from jax_mla_cache import bench
  cfg = CONFIGS[mode]
  cache = filled_cache(cfg, rng, spread=0.5)
  q, table, lens = problem(cfg, rng, B=3, s_q=2, H=4, P=5)
  lens = np.maximum(lens, 24)    # (no lse here: every query sees something past page 0)
  got = jax.jit(lambda *a: bench.gather_attention(*a, sm_scale=0.2, implementation="xla"))(
      cache, q, jnp.asarray(table), jnp.asarray(lens))
  want = decode64(cache.layer(0), q, table, lens, sm_scale=0.2, page_size=16,
                  kv_lora_rank=512)
  assert_close((got, want[1]), want)


def test_interpreting_on_one_cpu_device_warns(monkeypatch):
  common = kernel.common
  monkeypatch.setattr(jax, "devices", lambda backend=None: [object()])
  with pytest.warns(common.InterpretWarning, match="device_count=8"):
    common._warn_single_cpu_device.__wrapped__()
  monkeypatch.setattr(jax, "devices", lambda backend=None: [object()] * 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    common._warn_single_cpu_device.__wrapped__()


@pytest.mark.parametrize("mode,page_size,s_q,H,path", [
    ("bf16", 16, 2, 8, "narrow"), ("bf16", 64, 1, 16, "wide"), ("pth", 32, 2, 8, "narrow"),
    ("pth", 64, 1, 16, "wide"), ("pth", 32, 1, 16, "registers"),
    ("pth", 64, 2, 8, "registers")])
def test_kernel_interpret_ignores_garbage_rows_it_may_not_see(mode, page_size, s_q, H, path,
                                                              rng):
  """NaN / inf rows on page 0 (masked pages read it) and past every length (in the last
  block) do not reach the kernels' outputs."""
  cfg = CONFIGS[mode].replace(page_size=page_size, size=1024 - page_size + 16 * page_size)
  layer, q, table, lens = poisoned(cfg, rng, B=3, s_q=s_q, H=H, P=128 // page_size)
  args = dict(sm_scale=0.2, page_size=page_size, kv_lora_rank=512)
  config = kernel.DecodeConfig(path=path)
  got = jax.jit(lambda *a: kernel.mla_decode(*a, num_splits=2, config=config, **args))(
      layer, q, jnp.asarray(table), jnp.asarray(lens))
  assert np.all(np.isfinite(np.asarray(got[0], np.float32)))
  assert_close(got, decode64(layer, q, table, lens, **args))


def test_kernel_paths_take_what_they_say():
  """registers takes per_token_head with <= 16 query rows, narrow <= 32 query rows, wide
  everything; the default order tries them in that order."""
  geo = lambda s_q, H, quantized=False: kernel.Geometry(
      B=4, s_q=s_q, H=H, R=512, Rr=64, P=8, page_size=64, rows=4096, quantized=quantized,
      dtype=jnp.dtype(jnp.bfloat16))
  registers = kernel._path("registers")
  narrow = kernel._path("narrow")
  wide = kernel._path("wide")
  config = kernel.DecodeConfig()
  assert kernel.PATHS == ("registers", "narrow", "wide")
  for s_q, H in ((1, 16), (2, 8), (1, 1)):
    assert registers.takes(geo(s_q, H, True), config) is None
  assert "plain" in registers.takes(geo(1, 16), config)
  assert "query rows" in registers.takes(geo(2, 16, True), config)
  assert "stages" in registers.takes(geo(1, 16, True), kernel.DecodeConfig(stages=9))
  for s_q, H in ((1, 16), (2, 16), (1, 1), (4, 8)):
    assert narrow.takes(geo(s_q, H), config) is None
    assert narrow.takes(geo(s_q, H, True), config) is None
  assert "query rows" in narrow.takes(geo(1, 64), config)
  assert "query rows" in narrow.takes(geo(4, 16), config)
  assert wide.takes(geo(2, 128), config) is None
  assert narrow.padded_rows(5) == 16 and narrow.padded_rows(17) == 32
  with pytest.raises(ValueError, match="path"):
    kernel._path("fast")
  q = jnp.zeros((1, 1, 64, 576), jnp.bfloat16)
  kv = jnp.zeros((64, 1, 576), jnp.bfloat16)
  with pytest.raises(kernel.common.Unsupported, match="narrow"):
    kernel.mla_decode((kv,), q, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                      sm_scale=0.1, page_size=64, kv_lora_rank=512,
                      config=kernel.DecodeConfig(path="narrow"))


def test_public_op_runs_the_kernel_on_pallas(rng):
  cfg = CONFIGS["bf16"]
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=2, s_q=1, H=16, P=4)
  got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.25, implementation="pallas")
  want = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.25, implementation="xla")
  assert_close(got, tuple(np.asarray(x, np.float64) for x in want), rtol=1e-2)


@pytest.mark.parametrize("mode", ["bf16", "pth"])
@pytest.mark.parametrize("page_size,B,s_q,H,path", [
    (64, 64, 1, 16, "narrow"), (64, 64, 1, 16, "wide"), (32, 8, 2, 16, "narrow"),
    (32, 8, 4, 128, None), (128, 1, 2, 64, None), (64, 64, 1, 16, None), (32, 8, 2, 8, None),
    (64, 64, 2, 16, None)])
def test_kernel_lowers_for_cuda(mode, page_size, B, s_q, H, path):
  base = mc.DEEPSEEK_V3 if mode == "bf16" else mc.DEEPSEEK_V3_FP8
  cfg = base.replace(size=65536 - page_size, page_size=page_size, layer_num=1)
  spec = mc.cache_spec(cfg)
  P = 4096 // page_size
  args = (spec.layer(0), jax.ShapeDtypeStruct((B, s_q, H, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((B, P), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
  f = lambda *a: kernel.mla_decode(*a, sm_scale=0.1, page_size=page_size, kv_lora_rank=512,
                                   config=kernel.DecodeConfig(path=path))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text.lower()


@pytest.mark.parametrize("path", ["registers", "narrow"])
def test_kernel_interpret_empty_and_one_token_sequences(path, rng):
  """Lengths 0, negative, 1 and one past a block: zeros and -inf lse where nothing is
  visible, the reference elsewhere (per_token_head, 16 rows: the registers path's shape)."""
  cfg = CONFIGS["pth"].replace(page_size=64, size=1024)
  cache = filled_cache(cfg, rng)
  q, table, _ = problem(cfg, rng, B=4, s_q=1, H=16, P=3)
  lens = np.asarray([0, -7, 1, 65], np.int32)
  args = dict(sm_scale=0.2, page_size=64, kv_lora_rank=512)
  got = jax.jit(lambda *a: kernel.mla_decode(*a, num_splits=2, config=kernel.DecodeConfig(
      path=path), **args))(cache.layer(0), q, jnp.asarray(table), jnp.asarray(lens))
  want = decode64(cache.layer(0), q, table, lens, **args)
  assert np.all(np.isneginf(np.asarray(got[1])[:2]))
  assert_close(got, want)


@pytest.mark.parametrize("R", [256, 1024])
def test_register_path_other_latent_widths_interpret_and_lowering(R, rng):
  """The registers path at kv_lora_rank 256 (two 128-column chunks: half of the output
  product's 64 rows are padding) and 1024 (eight chunks: two products, the second reusing
  the staging after the first's stores read it), interpret mode against the float64 model,
  and lowered for CUDA (`store_out_rows`)."""
  cfg = CONFIGS["pth"].replace(page_size=64, size=1024, kv_lora_rank=R)
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=2, s_q=1, H=16, P=3)
  args = dict(sm_scale=0.2, page_size=64, kv_lora_rank=R)
  f = lambda *a: kernel.mla_decode(*a, num_splits=2, config=kernel.DecodeConfig(
      path="registers"), **args)
  operands = (cache.layer(0), q, jnp.asarray(table), jnp.asarray(lens))
  assert_close(jax.jit(f)(*operands), decode64(*operands, **args))
  text = jax.jit(f).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text.lower()


def test_register_path_puts_q_in_its_score_order():
  """The registers path's score product takes each 128 nope columns' even column pairs,
  then the odd ones; warpgroup 0 puts q's columns in that order in shared memory by
  products with 0/1 matrices (`order_source`), exactly (here in interpret mode, whose
  matrices go through shared memory; on the GPU from registers:
  `test_gpu_register_path_orders_q_rows`)."""
  registers = kernel._path("registers")
  cols = registers.score_columns(512)
  assert sorted(cols) == list(range(512))
  # A register of the key block holds columns 4j .. 4j+3; its halves (pairs 2j and 2j+1)
  # sit at K positions 2j and 64 + 2j of the chunk.
  for j in (0, 5, 31):
    assert list(cols[[2 * j, 2 * j + 1, 64 + 2 * j, 65 + 2 * j]]) == list(range(4 * j, 4 * j + 4))
  assert cols[128] == 128
  i, k = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
  x = np.arange(16 * 128).reshape(16, 128)
  for h in (0, 1):
    got = sum(registers.order_source(i, k, h, part).astype(np.int64) @ x[:, 64 * part:][:, :64].T
              for part in (0, 1))
    np.testing.assert_array_equal(got.T, x[:, cols[64 * h:64 * (h + 1)]])
  rng = np.random.default_rng(5)
  for dtype in ("bfloat16", "float16"):
    q = jnp.asarray(rng.standard_normal((16, 576)) * 3.0, dtype)
    f = registers.scale_q_kernel(16, 576, 512, jnp.dtype(dtype), interpret=True, order=True)
    rope, nope, factor = jax.jit(f)(q)
    scaled = np.asarray(q, np.float64) / np.asarray(factor, np.float64)[:, None]
    np.testing.assert_array_equal(np.asarray(nope[:, :512], np.float64), scaled[:, cols])
    np.testing.assert_array_equal(np.asarray(rope[:, 512:], np.float64), scaled[:, 512:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_register_path_orders_q_rows(dtype):
  """On the GPU (0/1 matrices from registers): `scale_q_rows` with the order leaves each
  row's nope columns in `score_columns` order, scaled as the float64 model says, exactly; a
  row holding inf gets NaN in the rest of that 128-column chunk (`_ordered_nope`) and
  nowhere else."""
  registers = kernel._path("registers")
  cols = registers.score_columns(512)
  rng = np.random.default_rng(6)
  mags = np.asarray([1e-3, 1.0, 3e4 if dtype == "bfloat16" else 1e3, 1e-4, 7.0, 1.0, 0.5,
                     2.0] * 2)
  q = rng.standard_normal((16, 576)) * mags[:, None]
  q[5, 130] = np.inf
  q = jnp.asarray(q, dtype)
  f = registers.scale_q_kernel(16, 576, 512, jnp.dtype(dtype), interpret=False, order=True)
  rope, nope, factor = jax.jit(f)(q)
  want, e, _ = _q_rows_reference(q)
  if dtype == "float16":
    want, e = np.asarray(q, np.float64), np.ones(16)
  np.testing.assert_array_equal(np.asarray(factor, np.float64), e)
  got = np.asarray(nope[:, :512], np.float64)
  want_nope = want[:, :512].astype(np.float16).astype(np.float64)[:, cols]
  rows = [r for r in range(16) if r != 5]
  np.testing.assert_array_equal(got[rows], want_nope[rows])
  assert not np.isfinite(got[5, 128:256]).any()
  np.testing.assert_array_equal(np.delete(got[5], np.s_[128:256]),
                                np.delete(want_nope[5], np.s_[128:256]))
  np.testing.assert_array_equal(np.asarray(rope[:, 512:], np.float64),
                                want[:, 512:].astype(jnp.dtype(dtype)).astype(np.float64))


def _q_rows_reference(q):
  """float64 model of `scale_q_rows`: each row divided by the power of two 2^(k - 15) with
  its largest finite magnitude < 2^k (frexp), k - 15 clipped to [-126, 127]; 1 for rows
  with nothing finite and nonzero. Returns (the rows divided, the powers, the rows'
  largest finite magnitudes)."""
  q64 = np.asarray(q, np.float64)
  amax = np.where(np.isfinite(q64), np.abs(q64), 0).max(-1)
  _, k = np.frexp(amax)
  e = np.where(amax > 0, 2.0 ** np.clip(k - 15, -126, 127), 1.0)
  return q64 / e[..., None], e, amax


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_register_path_scales_q_rows_in_kernel(dtype):
  """`scale_q_rows` (interpret mode; lowered for CUDA): bf16 rows divided by a power of two
  that puts their largest finite magnitude in [2^14, 2^15), nope columns then in float16
  -- exactly the bf16 values within 2^-28 of the row's largest --, rope columns divided by
  the same power in bf16 (exact), the power in the row's factor; inf / NaN pass; float16 q
  unchanged with factor 1."""
  registers = kernel._path("registers")
  rng = np.random.default_rng(3)
  mags = [1e-30, 1e-3, 1.0, 3e4, 1e30, 0.0, 1.0, 1.0, 1e-40, 2.0 ** -126, 1e37, 5.0,
          1e-2, 1e2, 1e-5, 7.0]
  if dtype == "float16":
    mags = [min(max(m, 1e-4), 1e4) if m else 0.0 for m in mags]
  q = rng.standard_normal((16, 576)) * np.asarray(mags)[:, None]
  q[6, 7] = np.inf
  q[7, 600 - 64] = np.nan
  q[2, 3] = 1e-12                       # below 2^-28 of its row's largest: rounded
  q = jnp.asarray(q, dtype)
  f = registers.scale_q_kernel(16, 576, 512, jnp.dtype(dtype), interpret=True)
  rope, nope, factor = jax.jit(f)(q)
  chex.assert_shape((rope, nope, factor), ((16, 576), (16, 576), (16,)))
  rope, nope = rope[:, 512:], nope[:, :512]
  assert nope.dtype == jnp.float16 and rope.dtype == jnp.dtype(dtype)
  text = jax.jit(registers.scale_q_kernel(16, 576, 512, jnp.dtype(dtype))).trace(q).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "scale_q_rows" in text
  q64 = np.asarray(q, np.float64)
  if dtype == "float16":
    np.testing.assert_array_equal(np.asarray(nope), np.asarray(q)[:, :512])
    np.testing.assert_array_equal(np.asarray(rope), np.asarray(q)[:, 512:])
    assert np.all(np.asarray(factor) == 1.0)
    return
  want, e, finite = _q_rows_reference(q)
  got_e = np.asarray(factor, np.float64)
  # A row of only subnormal values (row 8): XLA:CPU, like the GPU's flush-to-zero, may read
  # them as zeros (factor 1, f16 zeros); its scores are ~0 either way.
  normal = finite >= 2.0 ** -126
  assert not normal[8] and normal.sum() == 14 and got_e[8] in (1.0, 2.0 ** -126)
  np.testing.assert_array_equal(got_e[normal], e[normal])
  assert np.all((finite / e < 2.0 ** 15)
                & ((finite / e >= 2.0 ** 14) | ~normal | (e == 2.0 ** -126)))   # (clipped)
  # (subnormal elements themselves may be read as zeros, as above)
  exact = normal[:, None] & ~((np.abs(q64) < 2.0 ** -126) & (q64 != 0))
  np.testing.assert_array_equal(
      np.asarray(nope, np.float64)[exact[:, :512]],
      np.asarray(jnp.asarray(want[:, :512], jnp.float16), np.float64)[exact[:, :512]])
  np.testing.assert_array_equal(
      np.asarray(rope, np.float64)[exact[:, 512:]],
      np.asarray(jnp.asarray(want[:, 512:], jnp.bfloat16), np.float64)[exact[:, 512:]])
  back = np.concatenate([np.asarray(nope, np.float64), np.asarray(rope, np.float64)], -1)
  back = back * e[:, None]
  near = (np.abs(q64) >= finite[:, None] * 2.0 ** -28) & exact
  np.testing.assert_array_equal(back[near], q64[near])
  assert np.isposinf(back[6, 7]) and np.isnan(back[7, 536])


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_register_path_wide_magnitudes_interpret(rng, model_dtype):
  """Query rows of magnitudes 10^-3 .. 10^3 (f16 score products over bf16 q rescaled per
  row in the kernel; f16 q as it is) and cache rows of 10^-4 .. 10^4 against the float64
  model."""
  cfg = CONFIGS["pth"].replace(page_size=64, size=1024, model_dtype=model_dtype)
  cache = filled_cache(cfg, rng, spread=4.0)
  q, table, lens = problem(cfg, rng, B=2, s_q=1, H=16, P=4, bad_pages=False)
  q = (np.asarray(q, np.float32) / 0.05 * 10.0 ** np.linspace(-3, 3, 16)[None, None, :, None])
  q = jnp.asarray(q, model_dtype)
  lens = np.asarray([200, 256], np.int32)
  args = dict(sm_scale=0.01, page_size=64, kv_lora_rank=512)
  got = jax.jit(lambda *a: kernel.mla_decode(*a, num_splits=2, config=kernel.DecodeConfig(
      path="registers"), **args))(cache.layer(0), q, jnp.asarray(table), jnp.asarray(lens))
  want = decode64(cache.layer(0), q, table, lens, **args)
  assert_close(got, want, lse_atol=1e-2 + 1e-6 * np.abs(want[1]).max())   # lse up to ~1e6
  assert_rows_close(got[0], want[0])   # (the value product's float16 weights)


def _registers_on_scaled_rows(x, q, *, sm_scale, num_splits):
  """The registers path and the float64 model over a one-layer per_token_head cache holding
  rows x (1024, 576) (bf16, then quantized), two sequences of 256 and 200 tokens over its
  four 64-token pages (the second in reverse order)."""
  cfg = CONFIGS["pth"].replace(page_size=64, size=1024)
  cache = mc.set_mla_kv_buffer(mc.init_cache(cfg.replace(layer_num=1)), 0,
                               jnp.arange(x.shape[0]),
                               jnp.asarray(x[:, None, :512], jnp.bfloat16),
                               jnp.asarray(x[:, None, 512:], jnp.bfloat16), implementation="xla")
  table = np.asarray([[0, 1, 2, 3], [3, 2, 1, 0]], np.int32)
  lens = np.asarray([256, 200], np.int32)
  args = dict(sm_scale=sm_scale, page_size=64, kv_lora_rank=512)
  got = jax.jit(lambda *a: kernel.mla_decode(*a, num_splits=num_splits, config=kernel.DecodeConfig(
      path="registers"), **args))(cache.layer(0), q, jnp.asarray(table), jnp.asarray(lens))
  return got, decode64(cache.layer(0), q, table, lens, **args)


def _unit_vector(rng):
  u = rng.standard_normal(576)
  return u / np.linalg.norm(u)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_register_path_blocks_of_very_different_scales_interpret(rng, num_splits):
  """The registers path's float16 weights are divided by a power of two per 64-token block
  and its accumulators change units between blocks: blocks of rows of magnitude 1e6 (scored
  far below the others: weight ~0) alternate with blocks of 1e-6 rows (which make the
  output), a ratio of ~2^40 between consecutive blocks -- every query row within 1% of the
  float64 model. (Fails if the unit change is left out of alpha.)"""
  u = _unit_vector(rng)
  big = (np.arange(1024) // 64) % 2 == 1
  mag = np.where(big, 1e6, 1e-6)[:, None]
  x = (np.where(big, -40.0, 0.5)[:, None] * u + rng.standard_normal((1024, 576)) * 0.3) * mag
  q = jnp.asarray(u + rng.standard_normal((2, 1, 16, 576)) * 0.01, jnp.bfloat16)   # big: ~-40
  got, want = _registers_on_scaled_rows(x, q, sm_scale=1e-6, num_splits=num_splits)
  assert np.abs(want[0]).max() < 1e-4          # (the 1e-6 rows make the output)
  assert_rows_close(got[0], want[0])
  np.testing.assert_allclose(np.asarray(got[1]), want[1], atol=1e-2, rtol=1e-5)


def test_register_path_rows_of_different_scales_in_one_block_interpret(rng):
  """One row in 8 of every block ~3e4 times the others' scale, scored far below them
  (weight ~e^-40), the small rows making the output: their float16 weights are then just
  above 2^-15 of the block's power of two -- every query row within 1% of the float64
  model. (At ~3e6 they are subnormal: the registers module's stated limit.)"""
  u = _unit_vector(rng)
  big = np.arange(1024) % 8 == 0
  noise = rng.standard_normal((1024, 576))
  noise -= np.outer(noise @ u, u)               # orthogonal to u, the queries' direction
  x = np.where(big[:, None], -40.0 * u + noise * 10.0, (0.5 * u + noise * 0.3) * 1e-3)
  q = jnp.asarray(np.broadcast_to(u, (2, 1, 16, 576)), jnp.bfloat16)
  got, want = _registers_on_scaled_rows(x, q, sm_scale=1.0, num_splits=1)
  assert np.abs(want[0]).max() < 1e-2          # (the small rows make the output)
  assert_rows_close(got[0], want[0])


E4M3_CODES = np.arange(64 * 512, dtype=np.int64) * 7 % 256  # every code, in a mixed order


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["WGMMA_UPCAST_2X", "WGMMA"])
def test_fp8_tile_conversion_interpret_and_lowering(layout, dtype):
  x = jnp.asarray(E4M3_CODES[:64 * 64].astype(np.uint8).view(jnp.float8_e4m3fn).reshape(64, 64))
  lay = getattr(plgpu.Layout, layout)
  got = jax.jit(parts.convert_tile_kernel(64, layout=lay, interpret=True, dtype=dtype))(x)
  assert got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))
  text = jax.jit(parts.convert_tile_kernel(64, layout=lay, dtype=dtype)).trace(x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "convert_tile" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["WGMMA_UPCAST_2X", "WGMMA"])
def test_gpu_fp8_tile_conversion_is_exact_for_every_code(layout, dtype):
  """The decode kernels' block conversion on the GPU: every e4m3 code (zeros, subnormals, both
  NaNs, +-448) to the same bfloat16 / float16 value as ml_dtypes, sign of zero and NaN
  included."""
  x = E4M3_CODES.astype(np.uint8).view(jnp.float8_e4m3fn).reshape(64, 512)
  lay = getattr(plgpu.Layout, layout)
  got = np.asarray(jax.jit(parts.convert_tile_kernel(512, layout=lay, dtype=dtype))(
      jnp.asarray(x)))
  want = x.astype(dtype)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 4), H=st.sampled_from([1, 2, 8, 16]),
       P=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_reference_properties(B, s_q, H, P, seed):
  """Ragged lengths, bad page ids, any s_q x H: the reference equals the float64 model."""
  rng = np.random.default_rng(seed)
  cfg = CONFIGS["pth" if seed % 2 else "bf16"]
  cache = filled_cache(cfg, rng, spread=1.0)
  q, table, lens = problem(cfg, rng, B, s_q, H, P)
  got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.3, implementation="xla")
  want = decode64(cache.layer(0), q, table, lens, sm_scale=0.3, page_size=16, kv_lora_rank=512)
  assert_close(got, want)


# ----------------------------------------------------------------- on the GPU
def _gpu_case(mode, B, s_q, H, max_len, page_size, rng, hostile=False):
  base = mc.DEEPSEEK_V3 if mode == "bf16" else mc.DEEPSEEK_V3_FP8
  P = -(-max_len // page_size)
  cfg = base.replace(size=B * P * page_size, page_size=page_size, layer_num=1)
  cache = mc.MLAKVCache(buffers=(_random_layer(cfg, rng),), config=cfg)
  npages = cfg.rows // page_size
  table = (rng.permutation(npages - 1)[: B * P] + 1).reshape(B, P).astype(np.int32)
  lens = rng.integers(1, max_len + 1, (B,)).astype(np.int32)
  lens[0] = max_len
  if hostile:
    table[:, ::7] = npages + 1000
    table[:, 3::11] = -5
    lens[1::5] = -4
    lens[2::5] = 10**9
  q = jnp.asarray(rng.standard_normal((B, s_q, H, 576)) * 0.05, jnp.bfloat16)
  return cache, q, table, lens


def _random_layer(cfg, rng):
  from jax_mla_cache import bench
  return bench.decode_cache(cfg, seed=int(rng.integers(2**16))).layer(0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "pth"])
@pytest.mark.parametrize("B,s_q,H,max_len", [
    (8, 1, 16, 32768), (16, 2, 64, 4096), (4, 4, 128, 2048), (33, 1, 16, 1000), (2, 1, 128, 70)])
def test_gpu_kernel_matches_reference(mode, B, s_q, H, max_len):
  rng = np.random.default_rng(B * 100 + s_q * 10 + H)
  cache, q, table, lens = _gpu_case(mode, B, s_q, H, max_len, 64, rng)
  want = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.07, implementation="xla")
  want = tuple(np.asarray(x, np.float64) for x in want)
  got = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.07, implementation="pallas")
  assert_close(got, want)
  for path in _paths_taking(cache, q, table)[1:]:  # the default ran the first: the others too
    assert_close(_kernel_path(cache, q, table, lens, path), want)


def _paths_taking(cache, q, table):
  """The kernel paths that take this call, in the default order."""
  cfg = cache.config
  B, s_q, H, W = q.shape
  geo = kernel.Geometry(B=B, s_q=s_q, H=H, R=cfg.kv_lora_rank, Rr=W - cfg.kv_lora_rank,
                        P=table.shape[1], page_size=cfg.page_size, rows=cfg.rows,
                        quantized=len(cache.layer(0)) == 3, dtype=jnp.dtype(q.dtype))
  return [p for p in kernel.PATHS if kernel._path(p).takes(geo, kernel.DecodeConfig()) is None]


def _kernel_path(cache, q, table, lens, path, sm_scale=0.07):
  cfg = cache.config
  return jax.jit(lambda *a: kernel.mla_decode(
      *a, sm_scale=sm_scale, page_size=cfg.page_size, kv_lora_rank=cfg.kv_lora_rank,
      config=kernel.DecodeConfig(path=path)))(cache.layer(0), q, jnp.asarray(table),
                                             jnp.asarray(lens))


@pytest.mark.gpu
@pytest.mark.parametrize("mode,page_size,s_q,H", [
    ("bf16", 16, 2, 16), ("pth", 32, 2, 16), ("bf16", 128, 2, 16), ("pth", 128, 2, 16),
    ("pth", 32, 1, 16), ("pth", 64, 1, 16),
    # several 64-row M tiles
    ("bf16", 16, 2, 64), ("bf16", 64, 2, 128), ("pth", 32, 4, 64), ("pth", 64, 2, 128)])
def test_gpu_kernel_hostile_page_tables_and_page_sizes(mode, page_size, s_q, H):
  rng = np.random.default_rng(page_size)
  cache, q, table, lens = _gpu_case(mode, 12, s_q, H, 3000, page_size, rng, hostile=True)
  want = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.07, implementation="xla")
  want = tuple(np.asarray(x, np.float64) for x in want)
  for path in _paths_taking(cache, q, table):
    assert_close(_kernel_path(cache, q, table, lens, path), want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,page_size,s_q,H", [
    ("bf16", 16, 2, 16), ("pth", 32, 1, 16), ("pth", 64, 2, 16), ("bf16", 64, 1, 128),
    ("pth", 64, 2, 128)])
def test_gpu_kernel_ignores_garbage_rows_it_may_not_see(mode, page_size, s_q, H):
  """Hostile page tables on a cache with NaN / inf on page 0 and past every length: every
  path that takes the call gives finite outputs equal to the reference's."""
  rng = np.random.default_rng(page_size + H)
  cache, q, table, lens = _gpu_case(mode, 12, s_q, H, 3000, page_size, rng, hostile=True)
  table = np.where(table == 0, 1, table).astype(np.int32)
  cache = mc.MLAKVCache(buffers=(poison(cache.layer(0), table, lens, page_size),),
                        config=cache.config)
  want = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.07, implementation="xla")
  want = tuple(np.asarray(x, np.float64) for x in want)
  assert np.all(np.isfinite(want[0]))
  for path in _paths_taking(cache, q, table):
    got = _kernel_path(cache, q, table, lens, path)
    assert np.all(np.isfinite(np.asarray(got[0], np.float32))), path
    assert_close(got, want)


@pytest.mark.gpu
def test_gpu_kernel_against_float64_small(rng):
  for mode in ("bf16", "pth"):
    cfg = CONFIGS[mode].replace(page_size=32, size=1024)
    cache = filled_cache(cfg, rng)
    for s_q in (1, 2):
      q, table, lens = problem(cfg, rng, B=3, s_q=s_q, H=16, P=5)
      want = decode64(cache.layer(0), q, table, lens, sm_scale=0.3, page_size=32,
                      kv_lora_rank=512)
      for path in _paths_taking(cache, q, table):
        assert_close(_kernel_path(cache, q, table, lens, path, sm_scale=0.3), want)


# ------------------------------------------------------- the in-kernel profile (diagnosis)
def _trace_decode_module():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "trace_decode.py"
  spec = importlib.util.spec_from_file_location("trace_decode", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_profile_setting_reaches_the_compiler_params(monkeypatch, tmp_path):
  common = kernel.common
  assert common.PROFILE is None
  assert common.compiler_params(approx_math=True).profile_space == 0
  monkeypatch.setattr(common, "PROFILE", (32, str(tmp_path)))
  params = common.compiler_params(approx_math=True)
  assert (params.profile_space, params.profile_dir) == (32, str(tmp_path))
  assert params.profile_bounds_check and params.approx_math


def test_trace_summary_medians_and_period():
  trace_decode = _trace_decode_module()
  events = []
  for program in range(2):
    for wg in range(2):
      tid = 1 + wg + 2 * program
      # The profiler's own first region (not a block: the period must not be its own).
      events += [{"name": "Init", "ph": "B", "ts": 100.0 * program - 1.0, "tid": tid},
                 {"name": "Init", "ph": "E", "ts": 100.0 * program - 0.6, "tid": tid}]
      for block in range(5):       # one block every 2 us: "wait" 0.5 us, then "work" 1 us
        t0 = 100.0 * program + 2.0 * block
        events += [{"name": "wait", "ph": "B", "ts": t0, "tid": tid},
                   {"name": "wait", "ph": "E", "ts": t0 + 0.5, "tid": tid},
                   {"name": "work", "ph": "B", "ts": t0 + 0.5, "tid": tid},
                   {"name": "inner", "ph": "B", "ts": t0 + 0.6, "tid": tid},
                   {"name": "inner", "ph": "E", "ts": t0 + 0.8 + 0.1 * wg, "tid": tid},
                   {"name": "work", "ph": "E", "ts": t0 + 1.5, "tid": tid}]
  summary = trace_decode.summarize({"traceEvents": events}, warpgroups=2, skip=2)
  assert set(summary) == {0, 1}
  for wg in (0, 1):
    regions = summary[wg]["regions"]
    assert regions["wait"][0] == 6 and regions["wait"][1] == pytest.approx(500)
    assert regions["work"][1] == pytest.approx(1000)
    assert regions["inner"][1] == pytest.approx(200 + 100 * wg)
    assert summary[wg]["period"] == ("wait", pytest.approx(2000))
  line = trace_decode.timeline({"traceEvents": events}, warpgroups=2, program=1)
  assert sorted(line) == [0, 1] and len(line[1]) == 16
  assert line[1][:4] == [("Init", 0.0, pytest.approx(400)),
                         ("wait", pytest.approx(1000), pytest.approx(1500)),
                         ("inner", pytest.approx(1600), pytest.approx(1900)),
                         ("work", pytest.approx(1500), pytest.approx(2500))]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "pth"])
def test_gpu_profiled_narrow_kernel_writes_a_trace(mode, monkeypatch, tmp_path, rng):
  """benchmarks/trace_decode.py's mechanism: a kernel built with PROFILE set records its
  named regions, and its results do not change."""
  import json
  cfg = CONFIGS[mode].replace(page_size=64, size=4096)
  cache = filled_cache(cfg, rng)
  q, table, lens = problem(cfg, rng, B=2, s_q=2, H=16, P=8)
  want = _kernel_path(cache, q, table, lens, "narrow")
  monkeypatch.setattr(kernel.common, "PROFILE", (64, str(tmp_path)))
  kernel.common._cached_kernel_fn.cache_clear()
  try:
    got = _kernel_path(cache, q, table, lens, "narrow")
    jax.block_until_ready(got)
    jax.effects_barrier()
  finally:
    kernel.common._cached_kernel_fn.cache_clear()
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  traces = list(tmp_path.glob("*-trace.json"))
  assert traces, "no trace written"
  names = {ev["name"] for ev in json.loads(traces[0].read_text())["traceEvents"]}
  assert {"wait_kv", "values", "scores"} <= names, names
  summary = _trace_decode_module().summarize(json.loads(traces[0].read_text()), 2, skip=0)
  assert summary[0]["regions"]["scores"][1] > 0
