"""SPEC §6: a jitted, donating step that updates every layer copies no cache buffer."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jax_mla_cache as mc



def cache_shapes(cfg):
  names = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn",
           jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.float16): "f16"}
  return {f"{names[jnp.dtype(d)]}[{','.join(map(str, s))}]" for s, d in cfg.buffer_shapes()}


def copies_of_cache(hlo: str, cfg) -> list[str]:
  """Lines of compiled HLO that copy a whole cache buffer."""
  shapes = cache_shapes(cfg)
  return [line for line in hlo.splitlines()
          if re.search(r"\bcopy(-start)?\(", line) and any(s in line for s in shapes)]


def model_step(cache, loc, nope, rope, tgt, src, implementation):
  for layer_id in range(cache.config.layer_num):
    cache = mc.set_mla_kv_buffer(cache, layer_id, loc, nope, rope, implementation=implementation)
    _ = mc.get_mla_kv_buffer(cache, layer_id, loc, implementation=implementation)
  cache = mc.move_kv_cache(cache, tgt, src, implementation=implementation)
  return cache


def compiled_step_hlo(cfg, implementation):
  step = jax.jit(functools.partial(model_step, implementation=implementation), donate_argnums=0)
  cache = mc.init_cache(cfg)
  args = (jnp.arange(4, dtype=jnp.int32), jnp.ones((4, 1, cfg.kv_lora_rank), jnp.bfloat16),
          jnp.ones((4, 1, cfg.qk_rope_head_dim), jnp.bfloat16),
          jnp.array([10, 11], jnp.int32), jnp.array([1, 2], jnp.int32))
  return step.lower(cache, *args).compile().as_text()


CFGS = [mc.SMALL, mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: str(c.quant_method))
def test_xla_step_copies_no_cache_buffer(cfg):
  hlo = compiled_step_hlo(cfg, "xla")
  assert copies_of_cache(hlo, cfg) == []
  # every cache buffer is aliased input -> output
  assert "input_output_alias" in hlo
  # No whole-buffer dtype round trip (XLA:CPU would do one around an fp8 scatter).
  from tests.test_mla_demo import converts_of_cache
  assert converts_of_cache(hlo, cfg) == []


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: str(c.quant_method))
def test_step_copies_no_cache_buffer_on_gpu(cfg, implementation):
  hlo = compiled_step_hlo(cfg, implementation)
  assert copies_of_cache(hlo, cfg) == []
  # No whole-buffer dtype round trip either.
  from tests.test_mla_demo import converts_of_cache
  assert converts_of_cache(hlo, cfg) == []


def test_copy_detector_sees_a_copy():
  """Touching the old cache after an update forces a copy: the detector must see it."""
  cfg = mc.SMALL

  def step(cache, loc, nope, rope):
    new = mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation="xla")
    return new, cache.layer(0)[0]  # keeps the *old* buffer alive past the update

  hlo = jax.jit(step, donate_argnums=0).lower(
      mc.init_cache(cfg), jnp.arange(2, dtype=jnp.int32), jnp.ones((2, 1, 512)),
      jnp.ones((2, 1, 64))).compile().as_text()
  assert copies_of_cache(hlo, cfg)


def test_read_then_update_same_layer_needs_the_documented_barrier():
  """README rule 5: a read followed by an in-place update of the same layer is ordered
  only through a data dependency; tying the read to the cache with an optimization
  barrier removes the copy XLA would otherwise insert."""
  from jax import lax
  cfg = mc.SMALL

  def step(cache, loc, nope, rope, tie):
    out = mc.get_mla_kv_buffer(cache, 0, loc, implementation="xla")
    if tie:
      cache, out = lax.optimization_barrier((cache, out))
    cache = mc.set_mla_kv_buffer(cache, 0, loc, nope, rope, implementation="xla")
    cache = mc.move_kv_cache(cache, loc, loc[::-1], implementation="xla")
    return cache, out[0].sum() + out[1].sum()

  args = (jnp.arange(4, dtype=jnp.int32), jnp.ones((4, 1, 512)), jnp.ones((4, 1, 64)))
  hlo = {tie: jax.jit(functools.partial(step, tie=tie), donate_argnums=0)
         .lower(mc.init_cache(cfg), *args).compile().as_text() for tie in (False, True)}
  assert copies_of_cache(hlo[True], cfg) == []
  assert copies_of_cache(hlo[False], cfg)  # the detector sees the copy the rule avoids
