"""SPEC §5: clear errors at trace time, nothing written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc


@pytest.fixture
def cache():
  return mc.init_cache(mc.SMALL)


def nope(t=2, w=512, dtype=jnp.float32):
  return jnp.ones((t, 1, w), dtype)


def rope(t=2, w=64, dtype=jnp.float32):
  return jnp.ones((t, 1, w), dtype)


LOC = jnp.array([1, 2])


@pytest.mark.parametrize("call, exc, match", [
    (lambda c: mc.set_mla_kv_buffer(c, 2, LOC, nope(), rope()), ValueError, r"layer_id must be in \[0, 2\), got 2"),
    (lambda c: mc.set_mla_kv_buffer(c, -1, LOC, nope(), rope()), ValueError, "layer_id"),
    (lambda c: mc.set_mla_kv_buffer(c, 0.5, LOC, nope(), rope()), TypeError, "layer_id must be an int"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope(w=256), rope()), ValueError, r"cache_k_nope must have shape \(T, 1, 512\)"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope(t=3), rope()), ValueError, "T = len\\(loc\\) = 2"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope(), rope(w=32)), ValueError, "cache_k_rope"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope().reshape(2, 512), rope()), ValueError, "cache_k_nope"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope(dtype=jnp.int32), rope()), TypeError, "float dtype"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, jnp.array([1.0, 2.0]), nope(), rope()), TypeError, "loc must have an integer dtype"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, jnp.ones((2, 2), jnp.int32), nope(), rope()), ValueError, r"loc must have shape \(T,\)"),
    (lambda c: mc.set_kv_buffer(c, 0, LOC, nope(w=512)), ValueError, r"cache_k must have shape \(T, 1, 576\)"),
    (lambda c: mc.get_mla_kv_buffer(c, 0, LOC, jnp.int8), TypeError, "dst_dtype must be a float dtype"),
    (lambda c: mc.move_kv_cache(c, LOC, jnp.array([1])), ValueError, "same length"),
    (lambda c: mc.move_kv_pages(c, LOC, jnp.array([1.0, 2.0])), TypeError, "src_pages"),
    (lambda c: mc.set_mla_kv_buffer(c, 0, LOC, nope(), rope(), implementation="triton"), ValueError, "implementation must be"),
    (lambda c: mc.set_mla_kv_buffer("cache", 0, LOC, nope(), rope()), TypeError, "must be an MLAKVCache"),
])
def test_errors_name_the_argument(cache, call, exc, match):
  before = jax.tree.map(np.asarray, cache)
  with pytest.raises(exc, match=match):
    call(cache)
  # Nothing was written (and on error the donated buffers were not consumed).
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_traced_layer_id_is_rejected(cache):
  @jax.jit
  def f(c, layer):
    return mc.dispatch.check_layer_id(c, layer, "op")

  with pytest.raises(TypeError, match="static Python int"):
    f(cache, 0)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(quant_method="fp8_ds_mla"), ValueError, "quant_method must be one of"),
    (dict(quant_method="per_token_head"), ValueError, "needs dtype=float8_e4m3fn"),
    (dict(dtype=jnp.int8), ValueError, "dtype must be one of"),
    (dict(model_dtype=jnp.float8_e4m3fn), ValueError, "model_dtype"),
    (dict(layer_num=0), ValueError, "layer_num must be positive"),
    (dict(page_size=2.5), TypeError, "page_size must be an int"),
    (dict(dtype="not-a-dtype"), TypeError, "dtype must be a JAX dtype"),
    (dict(size=2**31 - 8), ValueError, "must be below 2\\*\\*31"),
])
def test_config_errors(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    mc.SMALL.replace(**kwargs)


def test_config_is_hashable_and_static():
  assert hash(mc.SMALL) == hash(mc.SMALL.replace())
  assert mc.SMALL.rows == 208 and mc.SMALL.kv_cache_dim == 576
  treedef = jax.tree.structure(mc.init_cache(mc.SMALL))
  assert treedef.num_leaves == 2


# ----------------------------------------------------------------- command line
@pytest.mark.parametrize("argv, message", [
    (["--ops", "row,decod"], "unknown 'row', 'decod'"),      # measured nothing, exit 0,
    (["--impls", "pallas,foo"], "unknown 'foo'"),            # and wrote an empty results file
    (["--decode-impls", "pallas:convert"], "unknown 'pallas:convert'"),
    (["--iters", "-1"], "must be >= 1"),                     # printed negative us and GB/s
    (["--iters", "0"], "must be >= 1"),                      # silently the default
    (["--tokens", "x"], "not an integer"),                   # a traceback
    (["--tokens", "64,-1"], "must be >= 1"),
    (["--decode-shapes", "64,1,16"], "B,s_q,H,context"),
])
def test_bench_flags_are_checked_before_anything_runs(argv, message, capsys):
  from jax_mla_cache import bench
  with pytest.raises(SystemExit) as exit_info:
    bench.main(argv + ["--out", "/nonexistent/never-written.json"])
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--deepseek-quant", "bogus"], "invalid choice: 'bogus'"),  # after the whole main demo
    (["--deepseek-checkpoint", "/no/such/dir"], "no config.json in /no/such/dir"),  # skipped
    (["--deepseek-iters", "0"], "--deepseek-iters must be >= 1"),  # ZeroDivisionError
    (["--deepseek-iters", "-1"], "--deepseek-iters must be >= 1"),  # negative timings
    (["--deepseek-steps", "0"], "--deepseek-steps must be >= 1"),  # silently the default
])
def test_demo_deepseek_flags_are_checked_first(argv, message, capsys):
  from jax_mla_cache import demo
  with pytest.raises(SystemExit) as exit_info:
    demo.check_deepseek_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_command_line_help_lists_every_option(capsys):
  from jax_mla_cache import __main__ as cli
  assert cli.main(["--help"]) == 0
  assert "demo" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["demo", "--help", "--no-compilation-cache"])
  text = capsys.readouterr().out
  for option in ("--deepseek-checkpoint", "--deepseek-iters", "--no-bench",
                 "--no-compilation-cache", "--scan"):
    assert option in text, option


def test_placement_and_pool_arguments_name_themselves():
  """Errors that named nothing ("'str' object has no attribute 'client'", IndexError, a
  later chunk_size error) now name the argument."""
  with pytest.raises(TypeError, match="init_cache: device must be a jax.Device"):
    mc.init_cache(mc.SMALL, device="cpu")
  with pytest.raises(TypeError, match="init_cache: sharding must be"):
    mc.init_cache(mc.SMALL, sharding="x")
  with pytest.raises(TypeError, match="init_cache: config must be an MLACacheConfig"):
    mc.init_cache(dict(size=64))
  pool_args = (64, "bfloat16", "bfloat16", None, 8, 4, 1)
  with pytest.raises(ValueError, match="the index must be one of"):
    mc.MLATokenToKVPool(*pool_args, device=f"cpu:{len(jax.devices('cpu'))}")
  with pytest.raises(ValueError, match="the index must be one of"):
    mc.MLATokenToKVPool(*pool_args, device="cpu:x")
  with pytest.raises(ValueError, match="offload_chunk_page_num must be a positive int"):
    mc.MLATokenToKVPool(*pool_args, offload_chunk_page_num=0)


def test_a_hand_built_state_must_match_its_config():
  """MLAKVCache(buffers=..., config=...) with other buffers than the config's: the ops
  raise, naming the buffers (the kernels bound indices by the config: a smaller buffer
  would have been written past its end on the GPU; XLA dropped the writes silently)."""
  rows = jnp.zeros((100, 1, 576), jnp.bfloat16)
  nope, rope = jnp.ones((1, 1, 512), jnp.bfloat16), jnp.ones((1, 1, 64), jnp.bfloat16)
  for buffers, message in ((((rows,),) * 2, r"layer 0\) are \['bfloat16\[100, 1, 576\]'\]"),
                           (((jnp.zeros((208, 1, 576), jnp.float16),),) * 2, "float16"),
                           (((jnp.zeros((208, 1, 576), jnp.bfloat16),),), "holds 1 layers")):
    cache = mc.MLAKVCache(buffers=buffers, config=mc.SMALL)
    with pytest.raises(ValueError, match=message):
      mc.set_mla_kv_buffer(cache, 0, np.array([150]), nope, rope, implementation="xla")
  stacked = mc.init_cache(mc.SMALL, stacked=True)
  bad = mc.StackedMLAKVCache(buffers=(stacked.buffers[0][:300],), config=mc.SMALL)
  with pytest.raises(ValueError, match="every layer"):
    mc.get_mla_kv_buffer(bad, 0, np.array([1]), implementation="xla")
