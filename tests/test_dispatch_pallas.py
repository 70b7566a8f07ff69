"""implementation="pallas" through the public ops equals the numpy model (CPU: interpret
mode; GPU: the Mosaic GPU kernels), and every op lowers for CUDA without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from tests.numpy_model import NumpyPool
from tests.test_ops import QUANT, cfg_id, fill, slots

CFGS = [mc.SMALL.replace(layer_num=2), QUANT[0].replace(layer_num=2),
        mc.SMALL_256.replace(dtype=jnp.float8_e4m3fn, layer_num=2)]


@pytest.mark.parametrize("cfg", CFGS, ids=cfg_id)
def test_pallas_ops_equal_model(cfg, rng):
  cache, model = mc.init_cache(cfg), NumpyPool(cfg)
  cache = fill(cache, model, rng, "pallas", tokens_list=(1, 6))
  model.assert_equal(cache)
  loc = slots(rng, cfg, 6)
  for dst in (None, jnp.float32):
    got = mc.get_mla_kv_buffer(cache, 1, jnp.asarray(loc), dst, implementation="pallas")
    want = model.get_mla(1, loc, dst)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), w)
  tgt, src = np.array([10, 11, -1, 12], np.int32), np.array([11, 10, 3, 500], np.int32)
  cache = mc.move_kv_cache(cache, jnp.asarray(tgt), jnp.asarray(src), implementation="pallas")
  model.move(tgt, src)
  cache = mc.move_kv_pages(cache, jnp.array([4, 5]), jnp.array([5, 1]), implementation="pallas")
  model.move_pages(np.array([4, 5]), np.array([5, 1]))
  model.assert_equal(cache)


def cuda_lowering(fn, *args):
  """Lower `fn` for CUDA on this host (no GPU needed) and return the StableHLO text."""
  return jax.jit(fn, donate_argnums=0).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("cfg", [mc.DEEPSEEK_V3.replace(layer_num=2),
                                 mc.DEEPSEEK_V3_FP8.replace(layer_num=2)], ids=cfg_id)
def test_every_op_lowers_for_cuda_in_place(cfg):
  cache = mc.cache_spec(cfg)
  loc = jax.ShapeDtypeStruct((64,), jnp.int32)
  nope = jax.ShapeDtypeStruct((64, 1, 512), jnp.bfloat16)
  rope = jax.ShapeDtypeStruct((64, 1, 64), jnp.bfloat16)

  def step(c, loc, nope, rope):
    for layer in range(cfg.layer_num):
      c = mc.set_mla_kv_buffer(c, layer, loc, nope, rope, implementation="pallas")
    out = mc.get_mla_kv_buffer(c, 0, loc, implementation="pallas")
    c = mc.move_kv_cache(c, loc, loc[::-1], implementation="pallas")
    c = mc.move_kv_pages(c, loc[:4], loc[4:8], implementation="pallas")
    return c, out

  text = cuda_lowering(step, cache, loc, nope, rope)
  assert "mosaic_gpu" in text
  # every cache buffer of the donated state is aliased to an output
  n_buffers = len(jax.tree.leaves(cache))
  assert text.count("tf.aliasing_output") >= n_buffers


def test_kernel_fn_is_shared_by_equal_builds():
  """`common.dispatch` jits a kernel once per distinct build: partials of the same function
  with equal static arguments share it (every layer of a model step calls one kernel), any
  other argument gets its own, and builds it cannot key (unhashable arguments, plain
  callables) are used as given."""
  import functools

  from pallas_kernels import common

  def kernel(interpret, *, width, dtype):
    return lambda x: (x * width).astype(dtype)

  build = lambda **kw: functools.partial(kernel, **kw)
  a = common.kernel_fn(build(width=2, dtype=jnp.dtype(jnp.float32)), False)
  assert a is common.kernel_fn(build(dtype=jnp.dtype(jnp.float32), width=2), False)
  assert a is not common.kernel_fn(build(width=3, dtype=jnp.dtype(jnp.float32)), False)
  assert a is not common.kernel_fn(build(width=2, dtype=jnp.dtype(jnp.float32)), True)
  np.testing.assert_array_equal(a(jnp.arange(3.0)), [0.0, 2.0, 4.0])
  unhashable = common.kernel_fn(functools.partial(kernel, width=[2], dtype=jnp.float32), False)
  assert not hasattr(unhashable, "lower")            # not jitted: used as given
  plain = lambda interpret: jnp.negative
  assert common.kernel_fn(plain, False) is jnp.negative
