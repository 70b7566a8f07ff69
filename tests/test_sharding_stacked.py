"""Sharded stacked caches (`init_sharded_cache(..., stacked=True)`) on 8 virtual CPU devices.

For data_parallel, replicated and context_parallel, every op on a sharded stacked cache gives
what it gives on the sharded unstacked cache of the same layout (same ops, same inputs, bit
for bit): writes, reads, moves, `mla_decode`, the host copy. A `lax.scan` over traced layer
ids equals the static calls; a traced layer id outside the cache writes nothing and reads
zeros / lse -inf; hostile slots and page ids stay inside their layer and rank; each rank's
shard is its own stacked cache (rank-major); the compiled, donated scan copies no buffer.
Pipeline layouts refuse a stacked cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from jax_mla_cache import rope
from jax_mla_cache import sharding as sh
from tests.test_inplace import cache_shapes, copies_of_cache
from tests.test_sharding import layout

L = 3
PLAIN = mc.MLACacheConfig(size=120, page_size=8, kv_lora_rank=64, qk_rope_head_dim=16,
                          layer_num=L)
QUANT = PLAIN.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
KINDS = ("data_parallel", "replicated", "context_parallel")
TABLE = jnp.asarray(rope.rope_cos_sin_cache(64, PLAIN.qk_rope_head_dim))
SM_SCALE = 0.3
H = 4  # query heads


@pytest.fixture(autouse=True)
def eight_devices():
  if jax.default_backend() == "cpu":
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 host devices"
  elif len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, this {jax.default_backend()} host has {len(jax.devices())}")


def ranks(cache) -> int:
  """How many pools a batch is split over (data_parallel: one per rank)."""
  return cache.layout.world if cache.layout.kind == "data_parallel" else 1


def leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def bf16(rng, *shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def hostile_slots(rng, cfg, n, per_rank):
  """int64 slots of each rank's batch part: good ones, -1, `rows` (the next layer's row 0
  in a stacked buffer if not checked per layer), far out, a 64-bit one that would wrap onto
  row 3."""
  parts = []
  for _ in range(n):
    loc = rng.choice(cfg.rows, per_rank, replace=False).astype(np.int64)
    loc[:4] = (-1, cfg.rows, cfg.rows + 7, 2**32 + 3)
    parts.append(rng.permutation(loc))
  return np.concatenate(parts)


def decode_problem(rng, cfg, n, B=2, P=3, wide=True):
  """A batch of B >= 2 sequences per pool; page ids past the layer (the next layer's page 0
  in a stacked buffer), -1 and (`wide`: int64, for host calls) one that would wrap onto
  page 1."""
  npages = cfg.rows // cfg.page_size
  table = rng.integers(0, npages, (n * B, P)).astype(np.int64)
  table[0, 1] = npages
  table[1, 0] = -1
  table[-1, -1] = 2**32 + 1 if wide else npages + 5
  lens = rng.integers(1, P * cfg.page_size + 1, n * B)
  lens[0] = 0
  q = bf16(rng, n * B, 1, H, cfg.kv_cache_dim, scale=0.1)
  return q, table, lens


def fill(cache, rng):
  """Every row of every layer written with distinct values (moves and decodes then read
  non-zero rows wherever they go)."""
  cfg, n = cache.config, ranks(cache)
  loc = np.tile(np.arange(cfg.rows, dtype=np.int32), n)
  for layer in range(cfg.layer_num):
    cache = sh.set_kv_buffer(cache, layer, loc, bf16(rng, len(loc), 1, cfg.kv_cache_dim),
                             implementation="xla")
  return cache


def run_ops(cache, rng, impl, per=10):
  """Every sharded op that a stacked cache takes, static layer ids, hostile indices (`per`
  tokens a pool); returns (cache, reads, host copy)."""
  cfg, n = cache.config, ranks(cache)
  reads = []
  cache = fill(cache, rng)
  for layer in range(cfg.layer_num):
    loc = hostile_slots(rng, cfg, n, per)
    cache = sh.set_mla_kv_buffer(cache, layer, loc, bf16(rng, len(loc), 1, cfg.kv_lora_rank),
                                 bf16(rng, len(loc), 1, cfg.qk_rope_head_dim),
                                 implementation=impl)
    loc = hostile_slots(rng, cfg, n, per)
    cache = sh.set_kv_buffer(cache, layer, loc, bf16(rng, len(loc), 1, cfg.kv_cache_dim),
                             implementation=impl)
    loc = hostile_slots(rng, cfg, n, per)
    T = len(loc)
    cache, q_out = sh.rope_set_mla_kv_buffer(
        cache, layer, loc, np.arange(T), bf16(rng, T, H, cfg.kv_lora_rank),
        bf16(rng, T, H, cfg.qk_rope_head_dim), bf16(rng, T, 1, cfg.kv_lora_rank),
        bf16(rng, T, 1, cfg.qk_rope_head_dim), TABLE, implementation=impl)
    reads.append(q_out)
    reads.extend(sh.get_mla_kv_buffer(cache, layer, hostile_slots(rng, cfg, n, per),
                                      implementation=impl))
  src = hostile_slots(rng, cfg, n, per)
  tgt = np.roll(src, 1)               # overlapping: a target is another pair's source
  cache = sh.move_kv_cache(cache, tgt, src, implementation=impl)
  npages = cfg.rows // cfg.page_size
  cache = sh.move_kv_pages(cache, np.tile([2, npages, 4, -1, 7], n),
                           np.tile([5, 1, npages, 3, 2], n), implementation=impl)
  for layer in range(cfg.layer_num):
    q, table, lens = decode_problem(rng, cfg, n)
    reads.extend(sh.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                               implementation=impl))
    reads.extend(sh.get_mla_kv_buffer(cache, layer, np.tile(np.arange(cfg.rows), n),
                                      implementation=impl))
  out = hostile_slots(rng, cfg, n, per)
  back = hostile_slots(rng, cfg, n, per)
  copy = sh.get_cpu_copy(cache, out, chunk_size=3)
  cache = sh.load_cpu_copy(cache, copy, back)
  return cache, reads, copy


CASES = [(kind, PLAIN) for kind in KINDS] + [
    ("data_parallel", QUANT), ("context_parallel", QUANT)]


def case_id(case):
  return f"{case[0]}-{case[1].quant_method or 'plain'}"


@pytest.mark.parametrize("kind,cfg", CASES, ids=map(case_id, CASES))
def test_every_op_gives_what_it_gives_unstacked(kind, cfg):
  """Writes, reads, token and page moves, decode (out and lse), the host copy: bit for bit
  the sharded unstacked cache's, and the buffers keep their sharding."""
  lay = layout(kind)
  stacked = sh.init_sharded_cache(cfg, lay, stacked=True)
  assert isinstance(stacked.cache, mc.StackedMLAKVCache) and stacked.config == cfg
  before = [b.sharding for b in stacked.cache.buffers]
  got, got_reads, got_copy = run_ops(stacked, np.random.default_rng(1), "xla")
  want, want_reads, want_copy = run_ops(sh.init_sharded_cache(cfg, lay),
                                        np.random.default_rng(1), "xla")
  assert got.stacked and [b.sharding for b in got.cache.buffers] == before
  leaves_equal(got.unstack().cache, want.cache)
  leaves_equal(got_reads, want_reads)
  leaves_equal(got_copy.chunks, want_copy.chunks)
  assert [x.sharding for x in jax.tree.leaves(got_copy.chunks)] == [
      x.sharding for x in jax.tree.leaves(want_copy.chunks)]
  # Either copy loads into either cache.
  n = ranks(got)
  back = np.tile(np.arange(10, dtype=np.int32) * 5, n)
  leaves_equal(sh.load_cpu_copy(sh.ShardedMLAKVCache.from_layers(want), got_copy,
                                back).unstack().cache,
               sh.load_cpu_copy(want, want_copy, back).cache)


def test_each_rank_holds_its_own_stacked_cache(rng):
  """Rank-major: a device's shard of the stacked buffer is that device's unstacked layers,
  stacked (`StackedMLAKVCache.from_layers`); `from_layers` / `unstack` round trip."""
  for kind in KINDS:
    unstacked = fill(sh.init_sharded_cache(QUANT, layout(kind)), rng)
    stacked = sh.ShardedMLAKVCache.from_layers(unstacked)
    shard_rows = stacked.layout.shard_config(stacked.cache.config).rows
    for plane, buf in enumerate(stacked.cache.buffers):
      assert buf.shape[0] == L * stacked.cache.config.rows
      assert buf.sharding == unstacked.cache.buffers[0][plane].sharding
      for shard in buf.addressable_shards:
        assert shard.data.shape[0] == L * shard_rows
        layers = [next(s.data for s in unstacked.cache.buffers[l][plane].addressable_shards
                       if s.device == shard.device) for l in range(L)]
        leaves_equal(shard.data, jnp.concatenate(layers))
    leaves_equal(stacked.unstack().cache, unstacked.cache)


@pytest.mark.parametrize("kind", KINDS)
def test_scan_over_traced_layers_equals_static_calls(kind, rng):
  """A decode-like step under lax.scan (traced layer ids, the sharded stacked cache the
  carry): the cache and reads of the static calls; layer id L (outside the cache) writes
  nothing, reads zeros and lse -inf."""
  cfg = PLAIN
  start = fill(sh.init_sharded_cache(cfg, layout(kind), stacked=True), rng)
  n = ranks(start)
  T = 2 * n
  loc = np.tile(np.array([21, 40], np.int32), n)
  q, table, lens = decode_problem(rng, cfg, n, wide=False)
  table, lens = jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)
  # (inputs made outside the step: a product computed inside a jit may skip its bf16
  # rounding and then quantize differently from the eager one)
  nopes = bf16(rng, L + 1, T, 1, cfg.kv_lora_rank)
  ropes = bf16(rng, L + 1, T, 1, cfg.qk_rope_head_dim)
  q_nope, q_rope = bf16(rng, T, H, cfg.kv_lora_rank), bf16(rng, T, H, cfg.qk_rope_head_dim)

  def layer_step(cache, layer):
    cache = sh.set_mla_kv_buffer(cache, layer, loc, nopes[layer], ropes[layer],
                                 implementation="xla")
    cache, q_out = sh.rope_set_mla_kv_buffer(cache, layer, loc + 1, loc, q_nope, q_rope,
                                             nopes[layer], ropes[layer], TABLE,
                                             implementation="xla")
    out, lse = sh.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                             implementation="xla")
    return cache, (q_out, out, lse, sh.get_mla_kv_buffer(cache, layer, loc + 1,
                                                         implementation="xla")[0])

  scanned = jax.jit(lambda c: jax.lax.scan(layer_step, c, jnp.arange(L + 1)), donate_argnums=0)
  got_cache, got = scanned(jax.tree.map(jnp.copy, start))
  want_cache = start
  for layer in range(L):
    want_cache, want = layer_step(want_cache, layer)
    leaves_equal([x[layer] for x in got], want)
  leaves_equal(got_cache.cache, want_cache.cache)
  _, out, lse, read = (np.asarray(x[L], np.float32) for x in got)
  assert not out.any() and np.isneginf(lse).all() and not read.any()
  leaves_equal(got[0][L], want[0])   # (q_out does not depend on the cache)


@pytest.mark.parametrize("kind", KINDS)
def test_traced_layer_outside_the_cache_touches_nothing(kind, rng):
  cfg = QUANT
  cache = fill(sh.init_sharded_cache(cfg, layout(kind), stacked=True), rng)
  before = jax.tree.map(np.asarray, cache.cache)
  n = ranks(cache)
  loc = jnp.tile(jnp.arange(cfg.rows, dtype=jnp.int32), n)
  nope, rope_part = bf16(rng, len(loc), 1, cfg.kv_lora_rank), bf16(rng, len(loc), 1, 16)
  q, table, lens = decode_problem(rng, cfg, n, wide=False)
  table, lens = jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)

  @jax.jit
  def write_read(cache, layer):
    cache = sh.set_mla_kv_buffer(cache, layer, loc, nope, rope_part, implementation="xla")
    cache = sh.set_kv_buffer(cache, layer, loc, jnp.concatenate([nope, rope_part], -1),
                             implementation="xla")
    cache, _ = sh.rope_set_mla_kv_buffer(cache, layer, loc, loc % 64, nope[:, :2],
                                         rope_part[:, :2], nope, rope_part, TABLE,
                                         implementation="xla")
    return cache, (sh.get_mla_kv_buffer(cache, layer, loc, implementation="xla"),
                   sh.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                                 implementation="xla"))

  for layer in (-1, L, 2**31 - 1, -(2**31)):
    after, ((got_nope, got_rope), (out, lse)) = write_read(cache, jnp.int32(layer))
    leaves_equal(after.cache, before)
    assert not np.asarray(got_nope, np.float32).any()
    assert not np.asarray(got_rope, np.float32).any()
    assert not np.asarray(out, np.float32).any() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("kind", ["data_parallel", "replicated", "context_parallel"])
def test_layers_that_are_not_whole_pages_are_refused(kind):
  # As on one device (test_stacked): every shard's layers must start on a page.
  cfg = PLAIN.replace(size=PLAIN.size + 4)   # rows 132, pages of 8
  if kind == "context_parallel":   # shards of 136 / 8 = 17 rows, pages of 16 / 8 = 2
    cfg = PLAIN.replace(size=120, page_size=16)
  with pytest.raises(ValueError, match="multiple of page_size"):
    sh.init_sharded_cache(cfg, layout(kind), stacked=True)


def test_pipeline_and_bad_layer_ids_are_refused(rng):
  with pytest.raises(ValueError, match="pipeline layout takes no stacked cache"):
    sh.init_sharded_cache(PLAIN, layout("pipeline"), stacked=True)
  with pytest.raises(ValueError, match="pipeline layout takes no stacked cache"):
    sh.ShardedMLAKVCache.from_layers(sh.init_sharded_cache(PLAIN, layout("pipeline")))
  # What the error suggests: a replicated stacked cache of a stage's layers on its devices.
  pipe = layout("pipeline")
  stage = sh.init_sharded_cache(PLAIN.replace(layer_num=2), sh.ShardedLayout(
      "replicated", pipe.stage_mesh(1), pipe.axis), stacked=True)
  stage = sh.set_kv_buffer(stage, 1, np.arange(4), np.ones((4, 1, PLAIN.kv_cache_dim)))
  assert {d.id for d in stage.cache.buffers[0].devices()} == {2, 3}
  assert (np.asarray(stage.unstack().cache.buffers[1][0][:4], np.float32) == 1).all()
  cache = sh.init_sharded_cache(PLAIN, layout("replicated"), stacked=True)
  with pytest.raises(ValueError, match=r"layer_id must be in \[0, 3\)"):
    sh.get_mla_kv_buffer(cache, L, np.arange(4))
  with pytest.raises(TypeError, match="integer scalar"):
    jax.jit(lambda c, l: sh.get_mla_kv_buffer(c, l, jnp.arange(4)))(cache, jnp.float32(1))
  with pytest.raises(TypeError, match="no one-layer view"):
    cache.layer_view(0)
  with pytest.raises(TypeError, match="not stacked"):
    sh.init_sharded_cache(PLAIN, layout("replicated")).unstack()
  # An unstacked sharded cache still wants a static layer id.
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(lambda c, l: sh.get_mla_kv_buffer(c, l, jnp.arange(4)))(
        sh.init_sharded_cache(PLAIN, layout("replicated")), jnp.int32(1))


def stacked_shapes(cache) -> mc.MLACacheConfig:
  """A one-layer config whose buffer shapes are a shard's stacked buffers (for
  `copies_of_cache`)."""
  shard = cache.layout.shard_config(cache.cache.config)
  return shard.replace(size=L * shard.rows - shard.page_size, layer_num=1)


@pytest.mark.parametrize("kind,cfg", CASES, ids=map(case_id, CASES))
def test_scanned_step_is_copy_free(kind, cfg, rng):
  """A jitted, donated step: a scan over the layers (set, the fused RoPE write, a read
  tied to the cache, decode), then token and page moves; XLA:CPU updates every shard in
  place (no copy of a shard's or a global buffer's shape) and keeps the shardings."""
  cache = sh.init_sharded_cache(cfg, layout(kind), stacked=True)
  n = ranks(cache)
  T = 2 * n
  loc = jnp.tile(jnp.array([21, 40], jnp.int32), n)
  q, table, lens = decode_problem(rng, cfg, n, wide=False)
  nope, rope_part = bf16(rng, T, 1, cfg.kv_lora_rank), bf16(rng, T, 1, cfg.qk_rope_head_dim)
  q_nope, q_rope = bf16(rng, T, H, cfg.kv_lora_rank), bf16(rng, T, H, cfg.qk_rope_head_dim)
  pages = jnp.tile(jnp.array([3, 4], jnp.int32), n)

  def step(cache, table, lens):
    def layer_step(cache, layer):
      cache = sh.set_mla_kv_buffer(cache, layer, loc, nope, rope_part, implementation="xla")
      cache, q_out = sh.rope_set_mla_kv_buffer(cache, layer, loc + 1, loc, q_nope, q_rope,
                                               nope, rope_part, TABLE, implementation="xla")
      read, _ = sh.get_mla_kv_buffer(cache, layer, loc, implementation="xla")
      cache, read = jax.lax.optimization_barrier((cache, read))
      out, _ = sh.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                             implementation="xla")
      return cache, (q_out, read, out)
    cache, ys = jax.lax.scan(layer_step, cache, jnp.arange(L))
    cache = sh.move_kv_cache(cache, loc + 20, loc + 1, implementation="xla")
    return sh.move_kv_pages(cache, pages, pages[::-1], implementation="xla"), ys

  args = (jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32))
  compiled = jax.jit(step, donate_argnums=0).lower(cache, *args).compile()
  hlo = compiled.as_text()
  shard = stacked_shapes(cache)
  whole = cache.cache.config.replace(size=L * cache.cache.config.rows - cfg.page_size,
                                     layer_num=1)
  assert all(shape in hlo for shape in cache_shapes(shard))   # (the check is not vacuous)
  assert copies_of_cache(hlo, shard) == [] and copies_of_cache(hlo, whole) == []
  assert "input_output_alias" in hlo
  before = [b.sharding for b in cache.cache.buffers]
  cache, _ = compiled(cache, *args)
  assert [b.sharding for b in cache.cache.buffers] == before


SMALL_PALLAS = mc.MLACacheConfig(size=48, page_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                 layer_num=2)


@pytest.mark.parametrize("kind", ["data_parallel", "context_parallel"])
def test_pallas_per_shard_matches_unstacked(kind, rng):
  """The kernels (interpret mode on CPU) on every shard's stacked cache, 2 devices: set,
  get, a token move and decode under a scan with traced layer ids, bit for bit the sharded
  unstacked cache's static calls."""
  from tests.test_sharding import pallas_missing
  if reason := pallas_missing():
    pytest.skip(reason)
  cfg, impl = SMALL_PALLAS, "pallas"
  lay = layout(kind, jax.devices()[:2])
  unstacked = fill(sh.init_sharded_cache(cfg, lay), rng)
  stacked = sh.ShardedMLAKVCache.from_layers(unstacked)
  n = ranks(stacked)
  loc = jnp.asarray(np.tile(np.array([5, 17, -1, cfg.rows], np.int32), n))
  nopes = bf16(rng, cfg.layer_num, len(loc), 1, cfg.kv_lora_rank)
  ropes = bf16(rng, cfg.layer_num, len(loc), 1, cfg.qk_rope_head_dim)
  q, table, lens = decode_problem(rng, cfg, n, P=2, wide=False)
  table, lens = jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)

  def layer_step(cache, layer):
    cache = sh.set_mla_kv_buffer(cache, layer, loc, nopes[layer], ropes[layer],
                                 implementation=impl)
    read = sh.get_mla_kv_buffer(cache, layer, loc[::-1], implementation=impl)
    return cache, (read, sh.mla_decode(cache, layer, q, table, lens, sm_scale=SM_SCALE,
                                       implementation=impl))

  got_cache, got = jax.jit(lambda c: jax.lax.scan(layer_step, c, jnp.arange(cfg.layer_num)),
                           donate_argnums=0)(stacked)
  for layer in range(cfg.layer_num):
    unstacked, want = layer_step(unstacked, layer)
    leaves_equal(jax.tree.map(lambda x: x[layer], got), want)
  src = jnp.asarray(np.tile(np.array([5, 17, 40, 2], np.int32), n))
  got_cache = sh.move_kv_cache(got_cache, src[::-1], src, implementation=impl)
  unstacked = sh.move_kv_cache(unstacked, src[::-1], src, implementation=impl)
  leaves_equal(got_cache.unstack().cache, unstacked.cache)


def test_readme_sharded_stacked_example_runs(rng):
  """The README's sharded lax.scan example runs as written and equals the static calls on
  the sharded unstacked cache."""
  import pathlib
  import re
  from jax.sharding import Mesh
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "init_sharded_cache" in block and "stacked=True" in block)
  scope = dict(mc=mc, jax=jax, jnp=jnp, np=np, functools=functools, Mesh=Mesh, sh=sh)
  exec(compile(example, "README.md", "exec"), scope)
  cache, cfg = scope["cache"], scope["cfg"]
  B = 8
  loc = np.tile(np.array([3, 9], np.int32), 4)
  latents = bf16(rng, cfg.layer_num, B, 1, cfg.kv_lora_rank)
  ropes = bf16(rng, cfg.layer_num, B, 1, cfg.qk_rope_head_dim)
  q = bf16(rng, B, 1, 16, cfg.kv_cache_dim, scale=0.1)
  table = jnp.asarray(rng.integers(0, cfg.rows // cfg.page_size, (B, 4)), jnp.int32)
  lens = jnp.full((B,), 40, jnp.int32)
  want = sh.init_sharded_cache(cfg, cache.layout)
  cache, (out, lse) = scope["decode_layers"](cache, q, table, lens, loc, latents, ropes)
  for layer in range(cfg.layer_num):
    want = sh.set_mla_kv_buffer(want, layer, loc, latents[layer], ropes[layer])
    leaves_equal((out[layer], lse[layer]),
                 sh.mla_decode(want, layer, q, table, lens, sm_scale=0.1))
  leaves_equal(cache.unstack().cache, want.cache)


def test_static_layer_ids_share_one_trace():
  """Static layer ids on a stacked cache enter the program as an array: a 3-layer unrolled
  step lowers one program per op, and the writes land in their own layers."""
  import re
  cache = sh.init_sharded_cache(PLAIN, layout("context_parallel"), stacked=True)
  loc = jnp.arange(8, dtype=jnp.int32) * 3
  rows = jnp.ones((8, 1, PLAIN.kv_cache_dim), jnp.bfloat16)

  def step(cache):
    reads = []
    for layer in range(L):
      cache = sh.set_kv_buffer(cache, layer, loc, rows * (layer + 1), implementation="xla")
      reads.append(sh.get_mla_kv_buffer(cache, layer, loc, implementation="xla")[0])
    return cache, reads

  text = jax.jit(step, donate_argnums=0).lower(cache).as_text()
  programs = re.findall(r"func\.func private @(_program(?:_\d+)?)\(", text)
  assert len(programs) == 2, programs          # one set, one get
  _, reads = jax.jit(step, donate_argnums=0)(cache)
  for layer, got in enumerate(reads):
    assert (np.asarray(got, np.float32) == layer + 1).all()
