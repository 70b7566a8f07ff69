"""StackedMLAKVCache: every layer in one buffer per plane, for layers run under lax.scan.

CPU: each op on a stacked cache gives what it gives on the same contents as an MLAKVCache
(bit for bit: the same kernels and XLA code run, on the stacked view with the indices moved
into the layer), on both implementations (the Mosaic GPU kernels interpreted); a scan over
traced layer ids equals the unrolled static calls; hostile indices stay inside their layer
(a slot `rows`, a page id `rows // page_size` would be the next layer's first row / page in
the stacked buffers); a traced layer id outside the cache writes and reads nothing; the
compiled XLA step is copy-free; the Pallas step lowers for CUDA with the cache aliased.
`@pytest.mark.gpu`: the compiled scanned decode step on the GPU, copy-free, against XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from jax_mla_cache import rope, rope_write

L = 3
CONFIGS = {
    "bf16": mc.SMALL.replace(layer_num=L, page_size=32),
    "pth": mc.SMALL.replace(layer_num=L, page_size=32, dtype=jnp.float8_e4m3fn,
                            quant_method="per_token_head"),
}
TABLE = jnp.asarray(rope.rope_cos_sin_cache(64, 64))
SM_SCALE = 0.1


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def rows_input(rng, cfg, T, scale=1.0):
  f = lambda w: jnp.asarray(rng.standard_normal((T, 1, w)) * scale, jnp.bfloat16)
  return f(cfg.kv_lora_rank), f(cfg.qk_rope_head_dim)


def hostile_loc(cfg, rng, T=12):
  """Slots of one layer: good ones, -1, `rows` (the next layer's row 0 if not checked
  per layer), far out, a 64-bit one that would wrap onto row 3."""
  loc = rng.integers(0, cfg.rows, T).astype(np.int64)
  loc[:4] = (-1, cfg.rows, cfg.rows + 7, 2**32 + 3)
  return loc


def decode_problem(cfg, rng, B=3, s_q=1, H=16):
  npages = cfg.rows // cfg.page_size
  P = 4
  table = rng.integers(1, npages, (B, P)).astype(np.int64)
  table[0, 1] = npages          # the next layer's page 0 in the stacked buffers: masked
  table[1, 0] = -1
  table[2, 2] = 2**32 + 1       # would wrap onto page 1
  lens = np.array([P * cfg.page_size, 20, 37])
  q = jnp.asarray(rng.standard_normal((B, s_q, H, cfg.kv_cache_dim)) * 0.1, jnp.bfloat16)
  return q, table, lens


def run_ops(cache, cfg, rng, impl):
  """A mix of every op that a stacked cache takes, on layers 0..L-1 (static ids); returns
  (final cache, every read)."""
  reads = []
  for layer in range(L):
    loc = hostile_loc(cfg, rng)
    cache = mc.set_mla_kv_buffer(cache, layer, loc, *rows_input(rng, cfg, len(loc), layer + 1),
                                 implementation=impl)
    whole = jnp.asarray(rng.standard_normal((5, 1, cfg.kv_cache_dim)), jnp.bfloat16)
    cache = mc.set_kv_buffer(cache, layer, hostile_loc(cfg, rng, 5), whole,
                             implementation=impl)
    T, H = 4, 2
    q_nope = jnp.asarray(rng.standard_normal((T, H, cfg.kv_lora_rank)), jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((T, H, cfg.qk_rope_head_dim)), jnp.bfloat16)
    cache, q_out = mc.rope_set_mla_kv_buffer(
        cache, layer, hostile_loc(cfg, rng, T), np.arange(T), q_nope, q_rope,
        *rows_input(rng, cfg, T), TABLE, implementation=impl)
    reads.append(q_out)
    reads.extend(mc.get_mla_kv_buffer(cache, layer, hostile_loc(cfg, rng, 20),
                                      implementation=impl))
  cache = mc.move_kv_cache(cache, hostile_loc(cfg, rng, 6), hostile_loc(cfg, rng, 6),
                           implementation=impl)
  npages = cfg.rows // cfg.page_size
  cache = mc.move_kv_pages(cache, np.array([2, npages, 4, -1]), np.array([5, 1, npages, 3]),
                           implementation=impl)
  for layer in range(L):
    q, table, lens = decode_problem(cfg, rng)
    reads.extend(mc.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                               implementation=impl))
    reads.extend(mc.get_mla_kv_buffer(cache, layer, np.arange(cfg.rows), implementation=impl))
  return cache, reads


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["bf16", "pth"])
def test_every_op_gives_what_it_gives_unstacked(mode, impl):
  cfg = CONFIGS[mode]
  got_cache, got = run_ops(mc.init_cache(cfg, stacked=True), cfg, np.random.default_rng(1),
                           impl)
  want_cache, want = run_ops(mc.init_cache(cfg), cfg, np.random.default_rng(1), impl)
  assert isinstance(got_cache, mc.StackedMLAKVCache)
  leaves_equal(got_cache.unstack(), want_cache)
  leaves_equal(got, want)
  # (the contents are not trivial: every layer has rows written and moved)
  assert all(np.asarray(want_cache.layer(layer)[0]).view(np.uint8).any() for layer in range(L))


def test_stack_and_unstack_round_trip(rng):
  cfg = CONFIGS["pth"]
  cache = mc.init_cache(cfg)
  for layer in range(L):
    cache = mc.set_mla_kv_buffer(cache, layer, np.arange(cfg.rows),
                                 *rows_input(rng, cfg, cfg.rows, layer + 1))
  stacked = mc.StackedMLAKVCache.from_layers(cache)
  assert [b.shape for b in stacked.buffers] == [
      (L * shape[0], *shape[1:]) for shape, _ in cfg.buffer_shapes()]
  leaves_equal(stacked.unstack(), cache)
  leaves_equal(stacked.layer(2), cache.layer(2))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_scan_over_traced_layers_equals_static_calls(impl, rng):
  """A decode-like step under lax.scan (layer ids traced, the stacked cache the carry):
  the same cache and reads as the unrolled static calls. Layer id L (outside the cache)
  writes nothing and reads zeros / lse -inf."""
  cfg = CONFIGS["pth"]
  B, H = 3, 16
  loc = np.array([21, 40, 0])
  q, table, lens = decode_problem(cfg, rng, B=B, H=H)
  table, lens = jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)
  # (inputs made outside the step: a product computed inside a jit may skip its bf16
  # rounding, XLA's excess precision, and then quantize differently from the eager one)
  nopes, ropes = zip(*(rows_input(rng, cfg, B, layer + 1) for layer in range(L + 1)))
  nopes, ropes = jnp.stack(nopes), jnp.stack(ropes)
  start = mc.init_cache(cfg, stacked=True)
  start = mc.set_mla_kv_buffer(start, 1, np.arange(cfg.rows),
                               *rows_input(rng, cfg, cfg.rows), implementation="xla")

  def layer_step(cache, layer):
    cache = mc.set_mla_kv_buffer(cache, layer, loc, nopes[layer], ropes[layer],
                                 implementation=impl)
    out, lse = mc.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                             implementation=impl)
    return cache, (out, lse)

  @functools.partial(jax.jit, donate_argnums=0)
  def scanned(cache):
    return jax.lax.scan(layer_step, cache, jnp.arange(L + 1))

  got_cache, (out, lse) = scanned(jax.tree.map(jnp.copy, start))
  want_cache = start
  for layer in range(L):
    want_cache, (w_out, w_lse) = layer_step(want_cache, jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(out[layer], np.float32),
                                  np.asarray(w_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[layer]), np.asarray(w_lse))
  leaves_equal(got_cache, want_cache)
  assert not np.asarray(out[L], np.float32).any() and np.isneginf(np.asarray(lse[L])).all()


def test_traced_layer_outside_the_cache_touches_nothing(rng):
  cfg = CONFIGS["bf16"]
  cache = mc.init_cache(cfg, stacked=True)
  cache = mc.set_mla_kv_buffer(cache, 0, np.arange(cfg.rows), *rows_input(rng, cfg, cfg.rows))
  before = jax.tree.map(np.asarray, cache)

  @jax.jit
  def write_read(cache, layer):
    cache = mc.set_mla_kv_buffer(cache, layer, jnp.arange(cfg.rows),
                                 *rows_input(np.random.default_rng(5), cfg, cfg.rows))
    return cache, mc.get_mla_kv_buffer(cache, layer, jnp.arange(cfg.rows))

  for layer in (-1, L, 2**31 - 1, -(2**31)):
    after, (nope, rope_part) = write_read(cache, jnp.int32(layer))
    leaves_equal(after, before)
    assert not np.asarray(nope, np.float32).any() and not np.asarray(rope_part, np.float32).any()


def test_errors_name_the_stacked_cache(rng):
  cfg = CONFIGS["bf16"]
  stacked = mc.init_cache(cfg, stacked=True)
  from jax_mla_cache import sharding
  with pytest.raises(TypeError, match="ShardedMLAKVCache"):
    sharding.get_mla_kv_buffer(stacked, 0, np.arange(4))
  with pytest.raises(ValueError, match=r"layer_id must be in \[0, 3\)"):
    mc.get_mla_kv_buffer(stacked, 3, np.arange(4))
  with pytest.raises(TypeError, match="integer scalar"):
    jax.jit(lambda c, l: mc.get_mla_kv_buffer(c, l, jnp.arange(4)))(stacked, jnp.float32(1))
  # An MLAKVCache still wants a static layer id, and says where a traced one works.
  with pytest.raises(TypeError, match="stacked=True"):
    jax.jit(lambda c, l: mc.get_mla_kv_buffer(c, l, jnp.arange(4)))(mc.init_cache(cfg),
                                                                     jnp.int32(1))
  with pytest.raises(ValueError, match=r"below 2\*\*31"):
    mc.cache_spec(mc.DEEPSEEK_V3.replace(size=2**26 - 64, layer_num=61), stacked=True)
  with pytest.raises(ValueError, match="not shardable"):
    mc.init_cache(cfg, stacked=True, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))


def test_scanned_xla_step_is_copy_free(rng):
  """XLA:CPU compiles a donated scan over the stacked cache with every buffer updated in
  place: no copy of a buffer's shape in the optimized HLO."""
  cfg = CONFIGS["pth"].replace(size=4096 - 32)
  q, table, lens = decode_problem(cfg, rng)
  nope, rope_part = rows_input(rng, cfg, 3)

  def step(cache, layer):
    cache = mc.set_mla_kv_buffer(cache, layer, jnp.array([21, 40, 7]), nope, rope_part,
                                 implementation="xla")
    return cache, mc.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                                implementation="xla")[0]

  f = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(L)), donate_argnums=0)
  text = f.lower(mc.init_cache(cfg, stacked=True)).compile().as_text()
  shapes = [f"[{L * cfg.rows},1,{w}]" for w in (cfg.kv_lora_rank, 1, cfg.qk_rope_head_dim)]
  copies = [line for line in text.splitlines()
            if " copy(" in line and any(s in line for s in shapes)]
  assert not copies, copies


def test_scanned_pallas_step_lowers_for_cuda_in_place():
  """The scanned step with the Pallas kernels (set, the fused RoPE write, decode) lowers
  for CUDA, each kernel aliasing the stacked buffers, the donated cache aliased to the
  output."""
  cfg = mc.DEEPSEEK_V3_FP8.replace(size=8192 - 64, layer_num=4)
  spec = mc.cache_spec(cfg, stacked=True)
  shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
  assert shapes(spec) == shapes(jax.eval_shape(lambda: mc.init_cache(cfg, stacked=True)))
  B, H = 8, 16
  S = jax.ShapeDtypeStruct

  def step(cache, layer, q_nope, q_rope, k_nope, k_rope, table, lens):
    cache, q = rope_write.rope_set_mla_kv_buffer(
        cache, layer, lens - 1, lens - 1, q_nope, q_rope, k_nope, k_rope, TABLE,
        implementation="pallas")
    out, _ = mc.mla_decode(cache, layer, q[:, None], table, lens, sm_scale=SM_SCALE,
                           implementation="pallas")
    return cache, out

  def scanned(cache, *args):
    return jax.lax.scan(lambda c, l: step(c, l, *args), cache, jnp.arange(4))

  args = (S((B, H, 512), jnp.bfloat16), S((B, H, 64), jnp.bfloat16),
          S((B, 1, 512), jnp.bfloat16), S((B, 1, 64), jnp.bfloat16), S((B, 16), jnp.int32),
          S((B,), jnp.int32))
  text = jax.jit(scanned, donate_argnums=0).trace(spec, *args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") >= 2
  assert "output_operand_aliases" in text
  assert text.count("tf.aliasing_output") == 3


@pytest.mark.gpu
def test_gpu_scanned_decode_step_in_place_and_equal_to_xla():
  cfg = mc.DEEPSEEK_V3_FP8.replace(size=2**16 - 64, layer_num=4)
  rng = np.random.default_rng(0)
  B, H = 16, 16
  q, table, lens = decode_problem(cfg, rng, B=B, H=H)
  table = jnp.asarray(np.clip(rng.integers(0, 1024, (B, 64)), 1, None), jnp.int32)
  # Distinct lengths: the step writes at rows lens - 1, and a row two tokens of one call
  # target may mix its writers element-wise on the GPU (pallas_kernels/rows.py; seen here
  # with a repeated length), which bit equality with XLA cannot allow.
  lens = jnp.asarray(rng.choice(np.arange(1, 64 * 64), B, replace=False), jnp.int32)
  start = mc.init_cache(cfg, stacked=True)
  for layer in range(4):
    start = mc.set_mla_kv_buffer(start, layer, np.arange(cfg.rows),
                                 *rows_input(rng, cfg, cfg.rows))
  nope, rope_part = rows_input(rng, cfg, B)

  def run(impl):
    def step(cache, layer):
      cache = mc.set_mla_kv_buffer(cache, layer, lens - 1, nope, rope_part,
                                   implementation=impl)
      return cache, mc.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                                  implementation=impl)
    return jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(4)), donate_argnums=0)

  f = run("pallas")
  text = f.lower(start).compile().as_text()
  shapes = [f"[{4 * cfg.rows},1,{w}]" for w in (512, 1, 64)]
  assert not [line for line in text.splitlines()
              if " copy(" in line and any(s in line for s in shapes)]
  got_cache, (out, lse) = f(jax.tree.map(jnp.copy, start))
  want_cache, (w_out, w_lse) = run("xla")(jax.tree.map(jnp.copy, start))
  leaves_equal(got_cache, want_cache)
  err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(w_out, np.float32))
  assert err <= 1e-2 * np.linalg.norm(np.asarray(w_out, np.float32))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(w_lse), atol=1e-2)


def test_readme_stacked_example_runs(rng):
  """The README's lax.scan example runs as written, and equals the unrolled static calls."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "stacked=True" in block)
  cfg = CONFIGS["pth"]
  scope = dict(mc=mc, jax=jax, jnp=jnp, functools=functools, cfg=cfg)
  exec(compile(example, "README.md", "exec"), scope)
  q, table, lens = decode_problem(cfg, rng)
  loc = jnp.array([70, 71, 72])
  latents, ropes = (jnp.stack(x) for x in zip(*(rows_input(rng, cfg, 3) for _ in range(L))))
  cache, (out, lse) = scope["decode_layers"](scope["cache"], q, table, lens, loc, latents,
                                            ropes)
  want = mc.init_cache(cfg)
  for layer in range(L):
    want = mc.set_mla_kv_buffer(want, layer, loc, latents[layer], ropes[layer])
    w_out, w_lse = mc.mla_decode(want, layer, q, table, lens, sm_scale=0.1)
    np.testing.assert_array_equal(np.asarray(out[layer], np.float32),
                                  np.asarray(w_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[layer]), np.asarray(w_lse))
  leaves_equal(cache.unstack(), want)


@pytest.mark.parametrize("mode", ["bf16", "pth"])
def test_host_tier_round_trip_matches_unstacked(mode, rng):
  """get_cpu_copy of a stacked cache is the unstacked cache's copy (same layout, same
  bytes); load_cpu_copy into a stacked cache (from either copy) gives the unstacked result.
  Slots outside a layer copy zeros and are skipped on the way back."""
  cfg = CONFIGS[mode]
  cache = mc.init_cache(cfg)
  for layer in range(L):
    cache = mc.set_mla_kv_buffer(cache, layer, np.arange(cfg.rows),
                                 *rows_input(rng, cfg, cfg.rows, layer + 1))
  stacked = mc.StackedMLAKVCache.from_layers(cache)
  out = np.array([3, cfg.rows, 40, -1, 100, 2**32 + 3, 7], np.int64)
  back = np.array([50, 60, cfg.rows + 1, 70, 5, 6, 9], np.int64)
  want_copy = mc.get_cpu_copy(cache, out, chunk_size=3)
  got_copy = mc.get_cpu_copy(stacked, out, chunk_size=3)
  leaves_equal(got_copy, want_copy)
  want = mc.load_cpu_copy(cache, want_copy, back)
  leaves_equal(mc.load_cpu_copy(stacked, got_copy, back).unstack(), want)
  stacked = mc.StackedMLAKVCache.from_layers(want)   # (a copy: `want` stays usable)
  leaves_equal(mc.load_cpu_copy(stacked, want_copy, back).unstack(),
               mc.load_cpu_copy(want, want_copy, back))


def test_endangered_per_period_equals_each_layers_flags(rng):
  """`move_common.endangered` with `period`: for pairs repeated in every layer (a stacked
  move), the flags are each layer's own, tiled; for other pairs they never miss one."""
  from pallas_kernels import move_common
  rows, layers, T = 97, 4, 300
  tgt = rng.integers(-3, rows + 3, T).astype(np.int32)
  src = rng.integers(0, rows, T).astype(np.int32)
  tgt, src = move_common.sanitize(jnp.asarray(tgt), jnp.asarray(src), rows)
  one = np.asarray(move_common.endangered(tgt, src, rows))
  assert one.any() and not one.all()
  cache = mc.init_cache(mc.SMALL.replace(layer_num=layers, size=rows - 1, page_size=1),
                        stacked=True)
  assert cache.config.rows == rows
  all_tgt, all_src = cache.every_layer(tgt, rows), cache.every_layer(src, rows)
  all_tgt, all_src = move_common.sanitize(all_tgt, all_src, layers * rows)
  exact = np.asarray(move_common.endangered(all_tgt, all_src, layers * rows))
  folded = np.asarray(move_common.endangered(all_tgt, all_src, layers * rows, period=rows))
  np.testing.assert_array_equal(exact, np.tile(one, layers))
  np.testing.assert_array_equal(folded, exact)
  # Arbitrary pairs: the folded flags include every exact one (a save too many is harmless).
  t = jnp.asarray(rng.integers(-1, layers * rows, 500), jnp.int32)
  s = jnp.asarray(rng.integers(0, layers * rows, 500), jnp.int32)
  t, s = move_common.sanitize(t, s, layers * rows)
  exact = np.asarray(move_common.endangered(t, s, layers * rows))
  folded = np.asarray(move_common.endangered(t, s, layers * rows, period=rows))
  assert exact.any() and np.all(folded >= exact)


@pytest.mark.parametrize("op", ["move_kv_cache", "move_kv_pages"])
def test_many_pair_moves_equal_unstacked(op, rng):
  """Moves of more than 1024 pairs over the stacked buffers (writer counts per layer, not per
  stacked row: `MoveTiling.writer_period`), overlapping sets, hostile pairs: the kernels
  (interpreted) give what they give on the unstacked cache, and what XLA gives."""
  cfg = CONFIGS["bf16"].replace(layer_num=4, page_size=1 if op == "move_kv_cache" else 8)
  units = cfg.rows // cfg.page_size
  T = 300 if op == "move_kv_cache" else 270
  tgt = rng.permutation(units)[:T].astype(np.int64)
  src = rng.permutation(units)[:T].astype(np.int64)   # overlaps tgt: sources endangered
  tgt[:3], src[3:5] = (-1, units, 2**32 + 1), (units + 2, -5)
  base = mc.init_cache(cfg)
  for layer in range(cfg.layer_num):
    base = mc.set_mla_kv_buffer(base, layer, np.arange(cfg.rows), *rows_input(rng, cfg, cfg.rows))
  move = getattr(mc, op)
  stacked = move(mc.StackedMLAKVCache.from_layers(base), tgt, src, implementation="pallas")
  want = move(jax.tree.map(jnp.copy, base), tgt, src, implementation="xla")
  leaves_equal(stacked.unstack().buffers, want.buffers)
  leaves_equal(move(base, tgt, src, implementation="pallas").buffers, want.buffers)


def test_moves_keep_their_public_signature():
  import inspect
  for op in (mc.move_kv_cache, mc.move_kv_pages):
    assert not [p for p in inspect.signature(op).parameters if p.startswith("_")]


def test_layers_that_are_not_whole_pages_are_refused(rng):
  """`size` not a multiple of `page_size`: a layer's rows are not whole pages, so its page
  ids are no page ids of the stacked buffers. Before 2026-12-06 such a stacked cache was
  accepted, and `mla_decode` and `move_kv_pages` used the wrong rows in every layer but the
  first (both implementations); now it is refused with the sizes that work."""
  cfg = CONFIGS["bf16"].replace(size=100, page_size=16)
  assert cfg.rows % cfg.page_size   # 116 rows: 7 whole pages, 4 rows of an eighth
  with pytest.raises(ValueError, match=r"multiple of page_size = 16.*size=112 \(or 96\)"):
    mc.init_cache(cfg, stacked=True)
  with pytest.raises(ValueError, match="multiple of page_size"):
    mc.StackedMLAKVCache.from_layers(mc.init_cache(cfg))
