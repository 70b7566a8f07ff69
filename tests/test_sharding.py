"""Sharded caches (jax_mla_cache.sharding) on 8 virtual CPU devices, against the
numpy model of the unsharded pool; jitted steps keep shardings and copy no buffer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_mla_cache as mc
from jax_mla_cache import sharding as sh
from tests.numpy_model import NumpyPool
from tests.test_inplace import copies_of_cache
from tests.test_ops import rows_input

PLAIN = mc.MLACacheConfig(size=120, page_size=8, kv_lora_rank=64, qk_rope_head_dim=16, layer_num=2)
QUANT = PLAIN.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head", layer_num=1)
TOKENS = 8  # per call; differs from every shard's row count, so the HLO copy check is unambiguous
KINDS = sh.LAYOUT_KINDS


def layout(kind: str, devices=None) -> sh.ShardedLayout:
  """Each kind on the devices: 2-D meshes where the layout axis has a partner axis."""
  devices = np.array(devices or jax.devices())
  n = devices.size
  if kind in ("data_parallel", "pipeline") and n >= 4 and n % 2 == 0:
    axis = "data" if kind == "data_parallel" else "stage"
    return sh.ShardedLayout(kind, Mesh(devices.reshape(n // 2, 2), (axis, "model")), axis)
  axis = {"replicated": "model", "context_parallel": "context"}.get(kind, "x")
  return sh.ShardedLayout(kind, Mesh(devices, (axis,)), axis)


def shardings(cache: sh.ShardedMLAKVCache):
  return [b.sharding for b in cache.cache.flat_buffers()]


def logical_pools(cache: sh.ShardedMLAKVCache) -> list[list[list[np.ndarray]]]:
  """The cache as the unsharded pools it stands for: `pools[pool][layer][buffer]`
  (data_parallel: one pool per rank; the others: one)."""
  lay, cfg = cache.layout, cache.config
  world, rows = lay.world, cfg.rows

  def pools_of(buf: np.ndarray) -> list[np.ndarray]:
    if lay.kind == "data_parallel":
      return [buf[k * rows:(k + 1) * rows] for k in range(world)]
    if lay.kind == "context_parallel":  # global array: rank-major; logical row r on rank r % world
      return [buf.reshape(world, rows // world, *buf.shape[1:]).swapaxes(0, 1).reshape(buf.shape)]
    return [buf]

  per_buffer = [[pools_of(np.asarray(b)) for b in layer] for layer in cache.buffers]
  npools = world if lay.kind == "data_parallel" else 1
  return [[[bufs[p] for bufs in layer] for layer in per_buffer] for p in range(npools)]


class Oracle:
  """NumpyPool(s) fed the same calls: data_parallel splits every batch over ranks."""

  def __init__(self, cache: sh.ShardedMLAKVCache):
    self.dp = cache.layout.kind == "data_parallel"
    self.world = cache.layout.world if self.dp else 1
    self.pools = [NumpyPool(cache.config) for _ in range(self.world)]

  def split(self, *arrays):
    """Each rank's slice of the batch arrays."""
    return zip(self.pools, *(np.split(np.asarray(a), self.world) for a in arrays))

  def set_mla(self, layer_id, loc, nope, rope):
    for pool, *part in self.split(loc, nope, rope):
      pool.set_mla(layer_id, *part)

  def move(self, tgt, src):
    for pool, *part in self.split(tgt, src):
      pool.move(*part)

  def move_pages(self, tgt_pages, src_pages):
    for pool, *part in self.split(tgt_pages, src_pages):
      pool.move_pages(*part)

  def get_mla(self, layer_id, loc):
    outs = [pool.get_mla(layer_id, part) for pool, part in self.split(loc)]
    return tuple(np.concatenate(o) for o in zip(*outs))

  def offload_round_trip(self, src, dst):
    for pool, s, d in self.split(src, dst):
      rows = pool.config.rows
      for layer in pool.buffers:
        for b in layer:
          copied = [b[r].copy() if 0 <= r < rows else np.zeros_like(b[0]) for r in s]
          for r, row in zip(d, copied):
            if 0 <= r < rows:
              b[r] = row

  def assert_equal(self, cache):
    for pool, buffers in zip(self.pools, logical_pools(cache)):
      for layer_id, (mine, theirs) in enumerate(zip(pool.buffers, buffers)):
        for k, (m, t) in enumerate(zip(mine, theirs)):
          np.testing.assert_array_equal(
              t.view(np.uint8), m.view(np.uint8), err_msg=f"layer {layer_id} buffer {k}")


def token_slots(rng, cache, tokens):
  """Distinct slots per rank, with padding (-1), page 0 and a stale slot (rows)."""
  cfg, world = cache.config, cache.layout.world
  ranks = world if cache.layout.kind == "data_parallel" else 1
  parts = []
  for _ in range(ranks):
    loc = rng.choice(cfg.rows, size=tokens // ranks, replace=False).astype(np.int32)
    loc[0] = 0
    loc[-1] = rng.choice([-1, cfg.rows])
    parts.append(loc)
  return np.concatenate(parts)


def run_ops(cache, oracle, rng, implementation, tokens=TOKENS):
  """set (last layer) / get / set_kv (layer 0) / move / move_pages, each checked
  against the oracle. (One compile per op: a call per layer would only add time.)"""
  cfg = cache.config
  before = shardings(cache)
  layer_id = cfg.layer_num - 1
  loc = token_slots(rng, cache, tokens)
  nope = rows_input(rng, tokens, cfg.kv_lora_rank)
  rope = rows_input(rng, tokens, cfg.qk_rope_head_dim)
  cache = sh.set_mla_kv_buffer(cache, layer_id, loc, nope, rope, implementation=implementation)
  oracle.set_mla(layer_id, loc, nope, rope)
  oracle.assert_equal(cache)
  got = sh.get_mla_kv_buffer(cache, layer_id, loc, implementation=implementation)
  for g, want in zip(got, oracle.get_mla(layer_id, loc)):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), want.view(np.uint8))

  loc = token_slots(rng, cache, tokens)
  rows = rows_input(rng, tokens, cfg.kv_cache_dim)
  cache = sh.set_kv_buffer(cache, 0, loc, rows, implementation=implementation)
  oracle.set_mla(0, loc, rows[..., :cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:])
  oracle.assert_equal(cache)

  # Overlapping source and target sets (a target is another pair's source); one bad pair.
  src = token_slots(rng, cache, tokens)
  tgt = np.roll(src, 1)
  tgt[1] = -1
  cache = sh.move_kv_cache(cache, tgt, src, implementation=implementation)
  oracle.move(tgt, src)
  oracle.assert_equal(cache)

  pages = cfg.rows // cfg.page_size
  ranks = oracle.world
  src_pages = np.tile(np.array([1, 2, 3, pages], np.int32), ranks)
  tgt_pages = np.tile(np.array([2, 5, -1, 4], np.int32), ranks)
  cache = sh.move_kv_pages(cache, tgt_pages, src_pages, implementation=implementation)
  oracle.move_pages(tgt_pages, src_pages)
  oracle.assert_equal(cache)
  assert shardings(cache) == before
  return cache


@pytest.fixture(autouse=True)
def eight_devices(request):
  if "gpu" in request.keywords:  # the GPU tests build 1-device meshes
    return
  if jax.default_backend() == "cpu":
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 host devices"
  elif len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, this {jax.default_backend()} host has {len(jax.devices())}")


# Every layout in plain mode; per_token_head (three buffers: fp8, f32, bf16) where the
# layout itself handles raw bits (context_parallel's combine) or splits rows (data_parallel).
# Pipeline and replicated run the unsharded ops per shard unchanged.
CASES = [(kind, PLAIN) for kind in KINDS] + [
    ("data_parallel", QUANT), ("context_parallel", QUANT)]


def case_id(case):
  return f"{case[0]}-{case[1].quant_method or 'plain'}"


@pytest.mark.parametrize("kind,cfg", CASES, ids=map(case_id, CASES))
def test_layout_matches_unsharded_pool(kind, cfg):
  rng = np.random.default_rng(1)
  cache = sh.init_sharded_cache(cfg, layout(kind))
  assert cache.config == cfg
  oracle = Oracle(cache)
  cache = run_ops(cache, oracle, rng, "xla")

  before = shardings(cache)
  src = token_slots(rng, cache, TOKENS)
  dst = token_slots(rng, cache, TOKENS)
  copy = sh.get_cpu_copy(cache, src, chunk_size=3)
  leaf = jax.tree.leaves(copy.chunks)[0]
  assert leaf.sharding.memory_kind == "pinned_host"
  cache = sh.load_cpu_copy(cache, copy, dst)
  oracle.offload_round_trip(src, dst)
  oracle.assert_equal(cache)
  assert shardings(cache) == before


def test_buffer_placement():
  cfg = PLAIN
  world = 4
  dp = sh.init_sharded_cache(cfg, layout("data_parallel"))
  assert dp.cache.config.rows == world * cfg.rows
  assert {s.data.shape[0] for s in dp.buffers[0][0].addressable_shards} == {cfg.rows}
  cp = sh.init_sharded_cache(cfg, layout("context_parallel"))
  assert {s.data.shape[0] for s in cp.buffers[0][0].addressable_shards} == {cfg.rows // 8}
  rep = sh.init_sharded_cache(cfg, layout("replicated"))
  assert rep.buffers[0][0].sharding.is_fully_replicated
  pp = sh.init_sharded_cache(cfg, layout("pipeline"))  # 2 layers on stages 1 and 3 of 4
  stage_devices = [{d.id for d in b[0].devices()} for b in pp.buffers]
  assert stage_devices == [{2, 3}, {6, 7}]


def test_context_parallel_write_touches_only_the_owner():
  cache = sh.init_sharded_cache(PLAIN, layout("context_parallel"))
  loc = np.array([13], np.int32)  # rank 13 % 8 = 5, local row 1
  cache = sh.set_kv_buffer(cache, 0, loc, np.ones((1, 1, PLAIN.kv_cache_dim)), implementation="xla")
  per_rank = [np.asarray(s.data)[:, 0, 0] for s in cache.buffers[0][0].addressable_shards]
  assert [np.flatnonzero(r).tolist() for r in per_rank] == [[]] * 5 + [[1]] + [[]] * 2


def model_step(cache, loc, nope, rope, tgt, src, pages, implementation):
  for layer_id in range(cache.cache.config.layer_num):
    cache = sh.set_mla_kv_buffer(cache, layer_id, loc, nope, rope, implementation=implementation)
    nope, rope = sh.get_mla_kv_buffer(cache, layer_id, loc, implementation=implementation)
    # Orders the read before the later in-place move of this layer; without it XLA
    # cannot prove that order and copies the buffer (unsharded ops alike).
    cache, nope, rope = jax.lax.optimization_barrier((cache, nope, rope))
  cache = sh.move_kv_cache(cache, tgt, src, implementation=implementation)
  return sh.move_kv_pages(cache, pages, pages[::-1], implementation=implementation), nope


def step_args(cache):
  cfg, ranks = cache.config, cache.layout.world if cache.layout.kind == "data_parallel" else 1
  loc = jnp.arange(TOKENS, dtype=jnp.int32)
  return (loc, jnp.ones((TOKENS, 1, cfg.kv_lora_rank), jnp.bfloat16),
          jnp.ones((TOKENS, 1, cfg.qk_rope_head_dim), jnp.bfloat16), loc + 20, loc + 1,
          jnp.tile(jnp.array([3, 4], jnp.int32), ranks))


@pytest.mark.parametrize("kind,cfg", CASES, ids=map(case_id, CASES))
def test_jitted_step_in_place_keeps_sharding(kind, cfg):
  cache = sh.init_sharded_cache(cfg, layout(kind))
  if kind == "pipeline":  # one program per stage, on its stage view
    cache = sh.stage_view(cache, 1)
  before = shardings(cache)
  step = jax.jit(functools.partial(model_step, implementation="xla"), donate_argnums=0)
  args = step_args(cache)
  compiled = step.lower(cache, *args).compile()
  hlo = compiled.as_text()
  shard = cache.layout.shard_config(cache.cache.config)
  assert copies_of_cache(hlo, shard) == []
  assert "input_output_alias" in hlo
  cache, _ = compiled(cache, *args)
  assert shardings(cache) == before


def test_pipeline_stage_view_round_trip():
  rng = np.random.default_rng(2)
  cache = sh.init_sharded_cache(PLAIN, layout("pipeline"))
  oracle = Oracle(cache)
  view = sh.stage_view(cache, 3)  # layer 1
  assert view.cache.config.layer_num == 1
  loc = token_slots(rng, cache, TOKENS)
  nope = rows_input(rng, TOKENS, PLAIN.kv_lora_rank)
  rope = rows_input(rng, TOKENS, PLAIN.qk_rope_head_dim)
  view = jax.jit(functools.partial(sh.set_mla_kv_buffer, implementation="xla"),
                 static_argnums=1, donate_argnums=0)(view, 0, loc, nope, rope)
  cache = sh.with_stage(cache, 3, view)
  oracle.set_mla(1, loc, nope, rope)
  oracle.assert_equal(cache)
  with pytest.raises(ValueError, match="stage 0 holds no layers"):
    sh.stage_view(cache, 0)


def test_bad_input():
  dp = sh.init_sharded_cache(PLAIN, layout("data_parallel"))
  nope, rope = np.ones((6, 1, 64)), np.ones((6, 1, 16))
  with pytest.raises(ValueError, match="multiple of 4, got 6"):
    sh.set_mla_kv_buffer(dp, 0, np.arange(6), nope, rope)
  with pytest.raises(ValueError, match="cache_k_rope"):
    sh.set_mla_kv_buffer(dp, 0, np.arange(4), np.ones((4, 1, 64)), np.ones((4, 1, 8)))
  with pytest.raises(ValueError, match="layer_id"):
    sh.get_mla_kv_buffer(dp, 2, np.arange(4))
  with pytest.raises(TypeError, match="ShardedMLAKVCache"):
    sh.move_kv_cache(mc.init_cache(PLAIN), np.arange(4), np.arange(4))
  with pytest.raises(TypeError, match="must be an MLAKVCache"):
    mc.move_kv_cache(dp, np.arange(4), np.arange(4))
  with pytest.raises(ValueError, match="page_size and rows"):
    sh.init_sharded_cache(PLAIN.replace(page_size=4), layout("context_parallel"))
  with pytest.raises(ValueError, match="kind must be one of"):
    sh.ShardedLayout("expert_parallel", layout("replicated").mesh, "model")
  with pytest.raises(ValueError, match="axis must be one of"):
    sh.ShardedLayout("replicated", layout("replicated").mesh, "data")
  with pytest.raises(ValueError, match="needs a pipeline layout"):
    sh.stage_view(dp, 0)


def pallas_missing() -> str | None:
  try:
    import pallas_kernels
  except ImportError as e:
    return f"pallas_kernels is not importable yet ({e})"
  names = ("set_rows", "set_rows_per_token_head", "get_rows", "get_rows_per_token_head",
           "move_rows", "move_pages")
  missing = [n for n in names if not hasattr(pallas_kernels, n)]
  return f"pallas_kernels does not expose {missing} yet" if missing else None


SMALL_PALLAS = mc.MLACacheConfig(size=56, page_size=8, kv_lora_rank=512, qk_rope_head_dim=64,
                                 layer_num=1)


# Interpret mode costs seconds per op, so on CPU the kernels run in the two layouts that
# change the shard geometry and indices; pipeline and replicated shards run the unsharded
# op unchanged (both run with the kernels in the GPU test below).
@pytest.mark.parametrize("kind", ["data_parallel", "context_parallel"])
def test_pallas_per_shard_matches_unsharded_pool(kind):
  """The kernels (interpret mode on CPU) on every shard: a small case on 2 devices."""
  if reason := pallas_missing():
    pytest.skip(reason)
  cache = sh.init_sharded_cache(SMALL_PALLAS, layout(kind, jax.devices()[:2]))
  run_ops(cache, Oracle(cache), np.random.default_rng(3), "pallas", tokens=4)


def one_device_mesh_case(kind, cfg, device, implementation):
  """A layout on a 1-device mesh: the numpy model, then a move checked against the
  unsharded ops from the same state."""
  cache = sh.init_sharded_cache(cfg, layout(kind, [device]))
  oracle = Oracle(cache)
  cache = run_ops(cache, oracle, np.random.default_rng(4), implementation)
  plain = mc.init_cache(cfg, device=device)
  for layer_id, layer in enumerate(oracle.pools[0].buffers):
    plain = plain.replace_layer(layer_id, tuple(jax.device_put(b, device) for b in layer))
  loc = np.array([0, 5, 17, 63, 1, 2, 3, 4], np.int32)
  plain = mc.move_kv_cache(plain, loc[::-1], loc, implementation=implementation)
  cache = sh.move_kv_cache(cache, loc[::-1], loc, implementation=implementation)
  for layer_id in range(cfg.layer_num):
    want = mc.get_mla_kv_buffer(plain, layer_id, loc, implementation=implementation)
    got = sh.get_mla_kv_buffer(cache, layer_id, loc, implementation=implementation)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_mesh_matches_unsharded(kind):
  one_device_mesh_case(kind, SMALL_PALLAS, jax.devices()[0], "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SMALL_PALLAS, SMALL_PALLAS.replace(
    dtype=jnp.float8_e4m3fn, quant_method="per_token_head")], ids=["plain", "per_token_head"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_one_device_mesh_matches_unsharded(kind, cfg):
  """Every layout on a 1-device mesh of the GPU with the Pallas kernels."""
  one_device_mesh_case(kind, cfg, jax.devices("gpu")[0], "pallas")


@pytest.mark.parametrize("kind,implementation", [
    ("data_parallel", "xla"), ("data_parallel", "pallas"),   # the kernel interpreted per shard
    ("replicated", "xla"), ("pipeline", "xla")])
def test_mla_decode_per_shard_matches_unsharded(kind, implementation, rng):
  """Each rank attends its own sequences (data_parallel) or all (replicated, pipeline),
  equal to the unsharded op on that rank's pool."""
  cfg = mc.MLACacheConfig(size=240, page_size=16, kv_lora_rank=128, qk_rope_head_dim=64,
                          layer_num=2)
  lay = layout(kind, jax.devices()[:4])
  cache = sh.init_sharded_cache(cfg, lay)
  world = lay.world if kind == "data_parallel" else 1
  B = 2 * world
  loc = np.concatenate([rng.permutation(cfg.rows)[:16] for _ in range(world)]).astype(np.int32)
  nope, rope = rows_input(rng, len(loc), 128), rows_input(rng, len(loc), 64)
  cache = sh.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation="xla")
  npages = cfg.rows // cfg.page_size
  table = rng.integers(-1, npages + 1, (B, 3)).astype(np.int32)
  lens = rng.integers(0, 49, (B,)).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((B, 1, 16, 192)) * 0.1, jnp.bfloat16)
  out, lse = sh.mla_decode(cache, 1, q, table, lens, sm_scale=0.3, implementation=implementation)
  assert out.shape == (B, 1, 16, 128) and lse.shape == (B, 1, 16)
  pools = logical_pools(cache)
  per = B // world
  for k in range(world):
    local = mc.MLAKVCache(
        buffers=tuple(tuple(jnp.asarray(b) for b in layer) for layer in pools[k]), config=cfg)
    want = mc.mla_decode(local, 1, q[k * per:(k + 1) * per], table[k * per:(k + 1) * per],
                         lens[k * per:(k + 1) * per], sm_scale=0.3, implementation=implementation)
    np.testing.assert_array_equal(np.asarray(out)[k * per:(k + 1) * per], np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(lse)[k * per:(k + 1) * per], np.asarray(want[1]))


@pytest.mark.parametrize("world,s_q,quant,implementation", [
    (4, 1, None, "xla"), (4, 3, None, "xla"), (8, 2, "per_token_head", "xla"),
    (2, 1, None, "pallas"), (2, 2, "per_token_head", "pallas")])  # kernels interpreted per shard
def test_mla_decode_context_parallel_matches_the_logical_cache(world, s_q, quant,
                                                                implementation, rng):
  """Interleaved rows: each rank attends the positions it holds, the lse merge equals the
  unsharded op on the logical cache (hostile page ids and lengths included)."""
  cfg = mc.MLACacheConfig(size=448, page_size=64, kv_lora_rank=128, qk_rope_head_dim=64,
                          layer_num=2)
  if quant:
    cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method=quant)
  lay = layout("context_parallel", jax.devices()[:world])
  cache = sh.init_sharded_cache(cfg, lay)
  loc = rng.permutation(cfg.rows)[:400].astype(np.int32)
  nope, rope = rows_input(rng, len(loc), 128), rows_input(rng, len(loc), 64)
  cache = sh.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation="xla")
  npages = cfg.rows // cfg.page_size
  B = 5
  table = rng.integers(0, npages, (B, 3)).astype(np.int32)
  table[1, 1], table[2, 0] = npages + 3, -1                        # masked pages
  lens = np.array([192, 150, 70, 2, -5], np.int64)
  lens[3] = 2**33 + 7                                              # clamped, never wrapped
  q = jnp.asarray(rng.standard_normal((B, s_q, 16, 192)) * 0.1, jnp.bfloat16)
  out, lse = sh.mla_decode(cache, 1, q, table, lens, sm_scale=0.3, implementation=implementation)
  chex_shapes = (out.shape, lse.shape)
  assert chex_shapes == ((B, s_q, 16, 128), (B, s_q, 16))
  logical = mc.MLAKVCache(
      buffers=tuple(tuple(jnp.asarray(b) for b in layer) for layer in logical_pools(cache)[0]),
      config=cfg)
  want_out, want_lse = mc.mla_decode(logical, 1, q, table, lens, sm_scale=0.3,
                                     implementation="xla")
  want_out, want_lse = np.asarray(want_out, np.float64), np.asarray(want_lse)
  got_out, got_lse = np.asarray(out, np.float64), np.asarray(lse)
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
  assert np.isneginf(got_lse[4]).all() and (got_out[4] == 0).all()
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-4)
  err = np.sqrt(np.sum((got_out - want_out) ** 2) / np.sum(want_out ** 2))
  assert err < 1e-2, err


@pytest.mark.parametrize("kind", KINDS)
def test_moves_of_a_full_cache_match_unsharded_pool(kind):
  """Every row holds distinct values, so a move in the wrong direction or to the wrong rank
  shows (the batches of `run_ops` leave most rows zero). Overlapping pairs, one bad pair."""
  rng = np.random.default_rng(5)
  cache = sh.init_sharded_cache(PLAIN, layout(kind))
  oracle = Oracle(cache)
  cfg, ranks = cache.config, oracle.world
  loc = np.tile(np.arange(cfg.rows, dtype=np.int32), ranks)
  rows = rows_input(rng, len(loc), cfg.kv_cache_dim)
  for layer_id in range(cfg.layer_num):
    cache = sh.set_kv_buffer(cache, layer_id, loc, rows, implementation="xla")
    oracle.set_mla(layer_id, loc, rows[..., :cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:])
  src = np.concatenate([rng.choice(cfg.rows, 6, replace=False) for _ in range(ranks)])
  tgt = np.roll(src, 1).astype(np.int32)
  tgt[2] = cfg.rows
  cache = sh.move_kv_cache(cache, tgt, src.astype(np.int32), implementation="xla")
  oracle.move(tgt, src)
  oracle.assert_equal(cache)
  pages = cfg.rows // cfg.page_size
  src_pages = np.tile(np.array([1, 2, pages - 1], np.int32), ranks)
  tgt_pages = np.tile(np.array([2, 3, 0], np.int32), ranks)
  cache = sh.move_kv_pages(cache, tgt_pages, src_pages, implementation="xla")
  oracle.move_pages(tgt_pages, src_pages)
  oracle.assert_equal(cache)


@pytest.mark.parametrize("kind", ["data_parallel", "replicated", "context_parallel"])
def test_per_layer_sharded_ops_trace_once_for_all_layers(kind):
  """A 3-layer step of sharded writes and reads lowers one program per op, called by every
  layer (the layer alone is passed: `MLAKVCache.layer_view`), and the writes land in
  their own layers."""
  import re
  cfg = PLAIN.replace(layer_num=3)
  cache = sh.init_sharded_cache(cfg, layout(kind))
  loc = jnp.arange(TOKENS, dtype=jnp.int32) * 3
  rng = np.random.default_rng(0)
  nope = jnp.asarray(rng.standard_normal((TOKENS, 1, cfg.kv_lora_rank)), jnp.float32)
  rope = jnp.asarray(rng.standard_normal((TOKENS, 1, cfg.qk_rope_head_dim)), jnp.float32)

  def step(cache):
    reads = []
    for layer in range(cfg.layer_num):
      cache = sh.set_mla_kv_buffer(cache, layer, loc, nope * (layer + 1), rope)
      reads.append(sh.get_mla_kv_buffer(cache, layer, loc)[0])
    return cache, reads

  text = jax.jit(step, donate_argnums=0).lower(cache).as_text()
  programs = re.findall(r"func\.func private @(_program(?:_\d+)?)\(", text)
  assert len(programs) == 2, programs          # one set, one get
  assert sum(len(re.findall(rf"call @{p}\(", text)) for p in programs) == 2 * cfg.layer_num
  _, reads = jax.jit(step, donate_argnums=0)(cache)
  for layer, got in enumerate(reads):
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(nope * (layer + 1), np.float32), rtol=1e-2)


def test_host_copies_load_only_into_their_own_layout(rng):
  """A sharded host copy's chunks are laid out for its cache's layout: loaded into another
  layout (or another device order) its rows landed permuted, silently, and a pipeline load
  that failed on a later stage had already donated the earlier stages. Now refused before
  anything runs; the cache stays intact."""
  devices = jax.devices()[:4]
  a = sh.init_sharded_cache(PLAIN, layout("replicated", devices))
  src = np.arange(8, dtype=np.int32) + 10
  nope, rope = rows_input(rng, 8, 64), rows_input(rng, 8, 16)
  a = sh.set_mla_kv_buffer(a, 0, src, nope, rope, implementation="xla")
  want = [np.asarray(x) for x in sh.get_mla_kv_buffer(a, 0, src)]
  dp = sh.init_sharded_cache(PLAIN, layout("data_parallel", devices))
  dp_copy = sh.get_cpu_copy(dp, np.arange(8, dtype=np.int32), chunk_size=1)
  with pytest.raises(ValueError, match="came from a data_parallel cache"):
    sh.load_cpu_copy(a, dp_copy, src)
  with pytest.raises(ValueError, match="came from a sharded cache"):
    mc.load_cpu_copy(mc.init_cache(PLAIN), dp_copy, np.arange(8))
  # pipeline: the same kind over another device order
  stages = [devices[0], devices[1], devices[3], devices[2]]
  p1 = sh.init_sharded_cache(PLAIN, sh.ShardedLayout("pipeline", Mesh(np.array(devices), ("x",)), "x"))
  p2 = sh.init_sharded_cache(PLAIN, sh.ShardedLayout("pipeline", Mesh(np.array(stages), ("x",)), "x"))
  p1 = sh.set_mla_kv_buffer(p1, 0, src, nope, rope, implementation="xla")
  with pytest.raises(ValueError, match="came from a pipeline cache"):
    sh.load_cpu_copy(p1, sh.get_cpu_copy(p2, src), src)
  for layer in range(PLAIN.layer_num):
    sh.get_mla_kv_buffer(p1, layer, src)                         # not donated
  got = [np.asarray(x) for x in sh.get_mla_kv_buffer(p1, 0, src)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))
  # the same layout still loads
  a = sh.load_cpu_copy(a, sh.get_cpu_copy(a, src), src + 20)
  for g, w in zip(sh.get_mla_kv_buffer(a, 0, src + 20), want):
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16))


def test_arguments_on_other_devices_get_the_ops_message():
  """A `loc` committed to a device outside the cache's mesh: JAX's ~1,300-character error
  about a functools.partial became one line naming the op, the mesh and the argument."""
  devices = jax.devices()
  cache = sh.init_sharded_cache(PLAIN, layout("data_parallel", devices[:4]))
  loc = jax.device_put(np.array([3, 9, 17, 25], np.int32), devices[7])
  with pytest.raises(ValueError, match=r"get_mla_kv_buffer: array arguments must be on the "
                                       r"cache's mesh devices \[0, 1, 2, 3\].*'loc': \[7\]"):
    sh.get_mla_kv_buffer(cache, 0, loc, implementation="xla")
  sh.get_mla_kv_buffer(cache, 0, np.asarray(loc), implementation="xla")   # intact
