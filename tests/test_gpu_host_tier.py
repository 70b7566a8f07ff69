"""GPU (`pytest -m gpu`): the host tier through `pinned_host` and the memory saver.

On the H200 the device offers the memory kinds `device` and `pinned_host` (no
`unpinned_host`): host copies must land in `pinned_host`, be bit-exact, recycle host
buffers when asked, and the memory saver must measurably free device memory.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc

pytestmark = pytest.mark.gpu


def _bytes_in_use(device) -> int:
  stats = device.memory_stats()
  assert stats is not None and "bytes_in_use" in stats
  return int(stats["bytes_in_use"])


def _filled_cache(cfg, rng, tokens):
  cache = mc.init_cache(cfg)
  loc = jnp.asarray(rng.permutation(cfg.rows)[:tokens].astype(np.int32))
  for layer in range(cfg.layer_num):
    nope = jnp.asarray(rng.standard_normal((tokens, 1, cfg.kv_lora_rank)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((tokens, 1, cfg.qk_rope_head_dim)), jnp.bfloat16)
    cache = mc.set_mla_kv_buffer(cache, layer, loc, nope, rope)
  return cache, loc


@pytest.mark.parametrize("cfg", [
    mc.DEEPSEEK_V3.replace(size=2**16 - 64, layer_num=8),
    mc.DEEPSEEK_V3_FP8.replace(size=2**16 - 64, layer_num=4)], ids=["bf16", "per_token_head"])
def test_gpu_offload_round_trip_pinned_host(cfg):
  rng = np.random.default_rng(5)
  assert mc.offload.host_memory_kind() == "pinned_host"
  cache, loc = _filled_cache(cfg, rng, 3000)           # 3 chunks: 1024, 1024, 952
  before = [np.asarray(b) for b in cache.flat_buffers()]
  host = mc.get_cpu_copy(cache, loc)
  leaves = jax.tree.leaves(host)
  assert host.memory_kind == "pinned_host"
  assert all(x.sharding.memory_kind == "pinned_host" for x in leaves)
  assert len(leaves) == 3 * len(cfg.buffer_shapes())       # one array per chunk and kind
  assert [c[0].shape[0] for c in host[0]] == [1024, 1024, 952]
  for got, full in zip(host[0][1], before[:len(host[0][1])]):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  full[np.asarray(loc)[1024:2048]].view(np.uint8))
  # Recycling: the old copy's host buffers are consumed (donated) and the bytes match.
  again = mc.get_cpu_copy(cache, loc, reuse=host)
  assert all(x.is_deleted() for x in leaves)
  # Back into other rows: bit-exact; every other row untouched.
  dst = jnp.asarray((np.asarray(loc) + 7) % cfg.rows)
  keep = np.setdiff1d(np.arange(cfg.rows), np.asarray(dst))
  cache = mc.load_cpu_copy(cache, again, dst)
  for b, full in zip(cache.flat_buffers(), before):
    b = np.asarray(b)
    np.testing.assert_array_equal(b[np.asarray(dst)].view(np.uint8),
                                  full[np.asarray(loc)].view(np.uint8))
    np.testing.assert_array_equal(b[keep].view(np.uint8), full[keep].view(np.uint8))


def test_gpu_offload_returns_before_the_copy_finishes():
  # 61 layers x 4096 tokens (288 MB): the call must hand back arrays while the transfer
  # runs; blocking on them takes the copy's time.
  cfg = mc.DEEPSEEK_V3.replace(size=2**16 - 64)
  cache = mc.init_cache(cfg)
  idx = jnp.arange(4096, dtype=jnp.int32)
  host = mc.get_cpu_copy(cache, idx).block_until_ready()   # compile + allocate
  host = mc.get_cpu_copy(cache, idx, reuse=host).block_until_ready()
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    host = mc.get_cpu_copy(cache, idx, reuse=host)
    issued = time.perf_counter() - t0
    host.block_until_ready()
    times.append((issued, time.perf_counter() - t0))
  issued, total = min(times, key=lambda t: t[0] / t[1])
  assert issued < 0.5 * total, times


def test_gpu_memory_saver_frees_device_memory():
  device = jax.devices()[0]
  pool = mc.MLATokenToKVPool(2**18 - 64, jnp.bfloat16, jnp.bfloat16, None, 512, 64, 8,
                             page_size=64, enable_memory_saver=True)
  nbytes = pool.get_kv_size_bytes()                         # 8 x 2^18 x 1152 B = 2.4 GB
  pool.set_mla_kv_buffer(0, jnp.array([70]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  jax.block_until_ready(pool.cache)
  held = _bytes_in_use(device)
  pool.release_memory_occupation()
  freed = held - _bytes_in_use(device)
  assert freed >= 0.99 * nbytes, (freed, nbytes)
  with pytest.raises(RuntimeError, match="resume_memory_occupation"):
    pool.get_mla_kv_buffer(0, jnp.array([70]))
  pool.resume_memory_occupation()
  assert _bytes_in_use(device) - (held - freed) >= 0.99 * nbytes
  assert not np.asarray(pool.get_key_buffer(0)[70].astype(jnp.float32)).any()  # zeroed
  pool.set_mla_kv_buffer(0, jnp.array([70]), jnp.ones((1, 1, 512)), jnp.ones((1, 1, 64)))
  assert float(pool.get_mla_kv_buffer(0, jnp.array([70]))[0][0, 0, 0]) == 1.0
