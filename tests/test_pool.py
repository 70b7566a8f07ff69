"""The stateful seed-compatible pool, host offload and the memory saver."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from tests.numpy_model import NumpyPool
from tests.test_ops import rows_input


@dataclasses.dataclass
class Layer:
  layer_id: int


def make_pool(quant=None, **kw):
  dtype = jnp.float8_e4m3fn if quant else jnp.bfloat16
  return mc.MLATokenToKVPool(
      size=192, model_dtype=jnp.bfloat16, dtype=dtype, quant_method=quant, kv_lora_rank=512,
      qk_rope_head_dim=64, layer_num=3, device="cpu", enable_memory_saver=True,
      max_batch_size=8, max_context_len=128, page_size=16, rank=0, implementation="xla", **kw)


@pytest.mark.parametrize("quant", [None, "per_token_head"])
def test_pool_matches_model(quant, rng):
  pool = make_pool(quant)
  model = NumpyPool(pool.config)
  for layer_id in range(3):
    loc = np.array([0, 5, 17, -1, 300, 40], np.int32)
    nope, rope = rows_input(rng, 6, 512), rows_input(rng, 6, 64)
    pool.set_mla_kv_buffer(Layer(layer_id), jnp.asarray(loc), jnp.asarray(nope), jnp.asarray(rope))
    model.set_mla(layer_id, loc, nope, rope)
  row = rows_input(rng, 2, 576)
  pool.set_kv_buffer(2, jnp.array([60, 61]), jnp.asarray(row), cache_v=None, k_scale=1.0)
  model.set_mla(2, np.array([60, 61]), row[..., :512], row[..., 512:])
  model.assert_equal(pool.cache)
  pool.move_kv_cache(jnp.array([100, 5]), jnp.array([5, 17]))
  model.move(np.array([100, 5]), np.array([5, 17]))
  pool.move_kv_pages(jnp.array([9]), jnp.array([1]))
  model.move_pages(np.array([9]), np.array([1]))
  model.assert_equal(pool.cache)
  nope, rope = pool.get_mla_kv_buffer(Layer(1), jnp.array([100, 5, -1]))
  want = model.get_mla(1, np.array([100, 5, -1]))
  np.testing.assert_array_equal(np.asarray(nope), want[0])
  np.testing.assert_array_equal(np.asarray(rope), want[1])
  assert nope.dtype == jnp.bfloat16  # per_token_head reads default to model_dtype


def test_buffer_getters_and_transfer_counter():
  pool = make_pool("per_token_head")
  waited = []

  class Counter:
    def wait_until(self, layer_id):
      waited.append(layer_id)

  pool.register_layer_transfer_counter(Counter())
  key = pool.get_key_buffer(1)
  value = pool.get_value_buffer(Layer(2))
  assert [b.shape for b in key] == [(208, 1, 512), (208, 1, 1), (208, 1, 64)]
  assert len(value) == 2
  pool.get_kv_buffer(0)
  assert waited == [1, 2, 0, 0]
  plain = make_pool()
  assert plain.get_key_buffer(0).shape == (208, 1, 576)
  assert plain.get_value_buffer(0).shape == (208, 1, 512)
  with pytest.raises(ValueError, match="layer_id"):
    plain.get_key_buffer(3)


@pytest.mark.parametrize("quant", [None, "per_token_head"])
def test_sizes_and_buffer_infos(quant):
  pool = make_pool(quant)
  if quant:
    row_bytes = 512 + 64 * 2 + 4
    assert pool.get_kv_size_bytes() == 3 * 208 * row_bytes
  else:
    row_bytes = 576 * 2
    assert pool.get_kv_size_bytes() == 3 * 208 * 1152
  assert pool.page_size_bytes == 16 * 3 * row_bytes
  ptrs, lens, items = pool.get_contiguous_buf_infos()
  comps = 3 if quant else 1
  assert len(ptrs) == len(lens) == len(items) == 3 * comps
  assert len(set(ptrs)) == len(ptrs) and all(p > 0 for p in ptrs)
  if quant:  # component-major: all nope, then all scales, then all ropes
    assert lens == [208 * 512] * 3 + [208 * 4] * 3 + [208 * 128] * 3
    assert items == [16 * 512] * 3 + [16 * 4] * 3 + [16 * 128] * 3
  else:
    assert lens == [208 * 1152] * 3 and items == [16 * 1152] * 3
  offsets = pool.get_layerwise_buf_info_offsets(start_idx=10)
  assert offsets == ([[10 + i * 3 + layer for i in range(3)] for layer in range(3)] if quant
                     else [[10], [11], [12]])


@pytest.mark.parametrize("quant", [None, "per_token_head"])
def test_offload_round_trip_bit_exact(quant, rng):
  pool = make_pool(quant, offload_chunk_page_num=4)   # 10 tokens -> chunks 4, 4, 2
  for layer_id in range(3):
    loc = np.arange(20, 40, dtype=np.int32)
    pool.set_mla_kv_buffer(layer_id, jnp.asarray(loc), jnp.asarray(rows_input(rng, 20, 512)),
                           jnp.asarray(rows_input(rng, 20, 64)))
  before = jax.tree.map(np.asarray, pool.cache)
  src = list(range(20, 30))
  host = pool.get_cpu_copy(src)
  assert len(host) == 3 and [len(host[layer]) for layer in range(3)] == [3, 3, 3]
  assert [c[0].shape[0] for c in host[0]] == [4, 4, 2]
  # one array per chunk and buffer kind, holding every layer
  assert [x.shape for x in host.stacked[0]] == [
      (3, 4, *shape[1:]) for shape, _ in pool.config.buffer_shapes()]
  for layer in range(3):   # the seed's view: copy[layer][chunk][buffer]
    for b, full in zip(host[layer][1], (np.asarray(x) for x in pool.cache.layer(layer))):
      np.testing.assert_array_equal(b.view(np.uint8), full[24:28].view(np.uint8))
  if mc.offload.host_memory_kind() is not None:
    assert host.memory_kind == "pinned_host"
  dst = list(range(100, 110))
  pool.load_cpu_copy(host, dst)
  after = jax.tree.map(np.asarray, pool.cache)
  for b0, b1 in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(b1[100:110].view(np.uint8), b0[20:30].view(np.uint8))
    np.testing.assert_array_equal(b1[:100].view(np.uint8), b0[:100].view(np.uint8))
  # the functional API: a HostCopy pytree
  copy = mc.get_cpu_copy(pool.cache, jnp.arange(20, 30), chunk_size=4)
  assert jax.tree.structure(copy) == jax.tree.structure(host)
  # recycling a previous copy's host buffers gives the same bytes and consumes it
  old = pool.get_cpu_copy(src)
  again = pool.get_cpu_copy(src, reuse=old)
  assert all(x.is_deleted() for x in jax.tree.leaves(old))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  with pytest.raises(ValueError, match="reuse must be a HostCopy of 3 tokens"):
    pool.get_cpu_copy([1, 2, 3], reuse=host)
  with pytest.raises(ValueError, match="holds 10 tokens"):
    pool.load_cpu_copy(host, list(range(5)))


def test_memory_saver_release_and_resume(rng):
  pool = make_pool()
  pool.set_mla_kv_buffer(0, jnp.array([3]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  old = pool.cache.layer(0)[0]
  pool.release_memory_occupation()
  assert pool.memory_released and old.is_deleted()
  with pytest.raises(RuntimeError, match="released"):
    pool.set_mla_kv_buffer(0, jnp.array([3]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  with pytest.raises(RuntimeError, match="resume_memory_occupation"):
    pool.get_key_buffer(0)
  pool.resume_memory_occupation()
  assert not np.asarray(pool.get_key_buffer(0).astype(jnp.float32)).any()  # zeroed
  pool.set_mla_kv_buffer(0, jnp.array([3]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  assert float(pool.get_mla_kv_buffer(0, jnp.array([3]))[0][0, 0, 0]) == 1.0
  with pytest.raises(RuntimeError, match="enable_memory_saver"):
    mc.MLATokenToKVPool(64, jnp.bfloat16, jnp.bfloat16, None, 512, 64, 1,
                        page_size=16).release_memory_occupation()


def test_debug_checks_report_positions():
  pool = make_pool(debug_checks=True)
  with pytest.raises(IndexError, match=r"loc\[1\]=-1, loc\[2\]=208"):
    pool.set_mla_kv_buffer(0, jnp.array([4, -1, 208]), jnp.ones((3, 1, 512)), jnp.ones((3, 1, 64)))
  assert not np.asarray(pool.get_key_buffer(0).astype(jnp.float32)).any()  # nothing written
  with pytest.raises(IndexError, match="src_loc"):
    pool.move_kv_cache(jnp.array([1]), jnp.array([500]))


def test_pool_rejects_bad_device_and_mode():
  with pytest.raises(ValueError, match="quant_method"):
    mc.MLATokenToKVPool(64, jnp.bfloat16, jnp.bfloat16, "fp8_ds_mla", 512, 64, 1)
  with pytest.raises(ValueError, match="device must name"):
    mc.MLATokenToKVPool(64, jnp.bfloat16, jnp.bfloat16, None, 512, 64, 1, device="tpu-ish")


def test_pool_mla_decode_reads_the_layer_in_place(rng):
  pool = mc.MLATokenToKVPool(size=240, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                             quant_method=None, kv_lora_rank=128, qk_rope_head_dim=64,
                             layer_num=2, page_size=16, implementation="xla")
  waited = []
  pool.register_layer_transfer_counter(type("C", (), {"wait_until": lambda _, l: waited.append(l)})())
  loc = np.arange(16, 64, dtype=np.int32)
  pool.set_mla_kv_buffer(1, loc, jnp.asarray(rng.standard_normal((48, 1, 128)), jnp.bfloat16),
                         jnp.asarray(rng.standard_normal((48, 1, 64)), jnp.bfloat16))
  q = jnp.asarray(rng.standard_normal((2, 1, 4, 192)), jnp.bfloat16)
  table, lens = np.array([[1, 2, 3], [3, 2, 1]], np.int32), np.array([48, 20], np.int32)
  out, lse = pool.mla_decode(type("L", (), {"layer_id": 1})(), q, table, lens, sm_scale=0.1)
  want = mc.mla_decode(pool.cache, 1, q, table, lens, sm_scale=0.1, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want[1]))
  assert waited == [1]
