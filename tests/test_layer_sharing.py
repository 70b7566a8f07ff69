"""Per-layer ops share one trace across layers (`MLAKVCache.layer_view`), in place.

A model step calls each per-layer op once per layer with a static `layer_id`. The public
ops run their jitted cores on the layer alone (a one-layer cache), so a 61-layer step
traces and lowers each core once, not 61 times (the GPU demo: trace + lower of its two
61-layer steps 7.2-8.1 -> 4.4 s on a 2-core CPU host, lowered module 4.5 -> 2.5 MB), while a
top-level call still donates and updates only the layer's buffers.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from jax_mla_cache import rope

L = 3
CFG = mc.SMALL.replace(layer_num=L)
QUANT = CFG.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
T, H = 4, 2
TABLE = rope.rope_cos_sin_cache(64, CFG.qk_rope_head_dim)


def _rows(width, dtype=jnp.bfloat16, n=T, heads=1):
  return jnp.asarray(np.random.default_rng(width).standard_normal((n, heads, width)), dtype)


def _step(op):
  """A jitted L-layer step calling `op` on every layer, and its arguments."""
  cfg = QUANT if op == "set_quantized" else CFG
  R, Rr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  loc = jnp.arange(T, dtype=jnp.int32) + 5
  q = jnp.zeros((2, 1, H, R + Rr), jnp.bfloat16)
  table = jnp.array([[1, 2], [3, -1]], jnp.int32)
  lens = jnp.array([9, 17], jnp.int32)

  def step(cache):
    outs = []
    for layer in range(L):
      if op in ("set", "set_quantized"):
        cache = mc.set_mla_kv_buffer(cache, layer, loc, _rows(R), _rows(Rr))
      elif op == "set_kv":
        cache = mc.set_kv_buffer(cache, layer, loc, _rows(R + Rr))
      elif op == "get":
        outs.append(mc.get_mla_kv_buffer(cache, layer, loc))
      elif op == "rope_set":
        cache, q_out = mc.rope_set_mla_kv_buffer(
            cache, layer, loc, loc, _rows(R, heads=H), _rows(Rr, heads=H), _rows(R),
            _rows(Rr), TABLE)
        outs.append(q_out)
      elif op == "mla_decode":
        outs.append(mc.mla_decode(cache, layer, q, table, lens, sm_scale=0.1))
    return cache, outs

  return step, mc.init_cache(cfg)


CORES = {"set": "_set_mla_kv_buffer", "set_quantized": "_set_mla_kv_buffer",
         "set_kv": "_set_kv_buffer", "get": "_get_mla_kv_buffer", "rope_set": "_rope_set",
         "mla_decode": "_mla_decode"}


@pytest.mark.parametrize("op", list(CORES))
def test_every_layer_calls_one_lowered_core(op):
  step, cache = _step(op)
  text = jax.jit(step, donate_argnums=0).lower(cache).as_text()
  core = CORES[op]
  defined = re.findall(rf"func\.func private @({core}(?:_\d+)?)\(", text)
  assert defined == [core], f"one lowered {core} expected, got {defined}"
  assert len(re.findall(rf"call @{core}\(", text)) == L


@pytest.mark.parametrize("cfg", [CFG, QUANT], ids=["plain", "per_token_head"])
def test_top_level_write_donates_only_its_layer(cfg):
  cache = mc.init_cache(cfg)
  before = [layer for layer in cache.buffers]
  loc = jnp.arange(T, dtype=jnp.int32) + 5
  new = mc.set_mla_kv_buffer(cache, 1, loc, _rows(cfg.kv_lora_rank), _rows(cfg.qk_rope_head_dim))
  # The other layers are the same arrays (nothing copied, nothing donated) ...
  for layer in (0, 2):
    assert all(a is b for a, b in zip(new.layer(layer), before[layer]))
    assert not any(b.is_deleted() for b in before[layer])
  # ... and layer 1 was donated to the write (updated in place where the backend can).
  assert all(b.is_deleted() for b in before[1])
  got = mc.get_mla_kv_buffer(new, 1, loc, jnp.float32)
  want = np.asarray(_rows(cfg.kv_lora_rank), np.float32)
  np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0.07 if cfg.quantized else 0)
  assert not np.asarray(mc.get_mla_kv_buffer(new, 0, loc, jnp.float32)[0]).any()


def test_layer_view_round_trip():
  cache = mc.init_cache(CFG)
  view = cache.layer_view(2)
  assert view.config == CFG.replace(layer_num=1) and view.layer_num == 1
  assert view.layer(0) is cache.layer(2)
  new = cache.with_layer(2, view)
  assert all(new.layer(i) is cache.layer(i) for i in range(L))


@pytest.mark.parametrize("bad", [L, -1, 1.5])
def test_layer_id_is_still_checked_against_the_whole_cache(bad):
  cache = mc.init_cache(CFG)
  loc = jnp.arange(T, dtype=jnp.int32)
  with pytest.raises((ValueError, TypeError), match="layer_id"):
    mc.set_mla_kv_buffer(cache, bad, loc, _rows(512), _rows(64))
  with pytest.raises((ValueError, TypeError), match="layer_id"):
    mc.rope_set_mla_kv_buffer(cache, bad, loc, loc, _rows(512, heads=H), _rows(64, heads=H),
                              _rows(512), _rows(64), TABLE)
  with pytest.raises((ValueError, TypeError), match="layer_id"):
    mc.mla_decode(cache, bad, jnp.zeros((1, 1, H, 576), jnp.bfloat16),
                  jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), sm_scale=0.1)


def test_eager_calls_compile_once_for_all_layers():
  """The stateful pool's way (per-layer calls outside any jit): the first write and read of
  each layer reuse one executable of each op (61-layer pool on a 2-core CPU host: first pass
  8.6 -> 0.13 s plain, 31.3 -> 0.56 s per_token_head, `logs/2026-12-05c_eager_layers.log`)."""
  import logging

  messages = []

  class Record(logging.Handler):
    def emit(self, record):
      messages.append(record.getMessage())

  handler = Record()
  jax.clear_caches()   # an earlier test of the session may have compiled the same shapes
  logging.getLogger("jax").addHandler(handler)
  try:
    pool = mc.MLATokenToKVPool(size=CFG.size, page_size=CFG.page_size, model_dtype=jnp.bfloat16,
                               dtype=jnp.bfloat16, quant_method=None, kv_lora_rank=512,
                               qk_rope_head_dim=64, layer_num=L)
    n = T + 3                                    # a shape no other test here compiles
    loc = np.arange(n, dtype=np.int32) + 7
    nope, rope = _rows(512, n=n), _rows(64, n=n)
    with jax.log_compiles(True):
      for layer in range(L):
        pool.set_mla_kv_buffer(layer, loc, nope * (layer + 1), rope)
        got = pool.get_mla_kv_buffer(layer, loc, jnp.float32)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(nope * (layer + 1), np.float32))
  finally:
    logging.getLogger("jax").removeHandler(handler)
  for core in ("_set_mla_kv_buffer", "_get_mla_kv_buffer"):
    compiled = [m for m in messages if m.startswith(f"Compiling jit({core})")]
    assert len(compiled) == 1, (core, len(compiled))
