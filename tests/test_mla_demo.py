"""The cache inside a model: `jax_mla_cache.models.mla_demo` decoding vs recomputation.

A 2-layer MLA model (512 + 64 latent, the SMALL cache) prefills two right-padded
prompts of different lengths, then decodes STEPS tokens (teacher-forced, so both
paths see the same tokens). Every output is compared with `reference_forward`,
which recomputes the whole sequence from scratch with no cache, in the naive
(non-absorbed) attention form.

Why float tolerance and not bit-exactness for the plain bf16 cache: the cache
itself is lossless for what it is given (the ops tests prove get returns set's
rows bit for bit), but the two paths compute the same math differently: the
cached path absorbs w_uk into the query, the reference expands keys and values
per head, and decode runs (B, 1) matmuls where the reference runs (B, S) ones,
so XLA sums in other orders. The float32 latents then differ in their last bits,
and now and then one rounds to the neighbouring bf16 value. The bound is
1e-3 x max|logit| (measured: ~3e-5 for bf16, ~5e-7 for fp8, which rounds on a
coarser grid and so flips less).

FP8 (per_token_head) is checked twice: against the recomputation with the same
quantization applied to its latents (float tolerance, as above), and against the
exact recomputation, within a bound derived from the format: every cached nope
value is within half an e4m3 step (2^-4 relative, or 2^-10 x scale in the
subnormal range) and every rope value within half a bf16 step (2^-8 relative) of
the exact latent; the logits then stay within 5% of max|logit| (measured ~1.7%).
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from jax_mla_cache.models import mla_demo
from tests.test_inplace import copies_of_cache

PLAIN = mc.SMALL
FP8 = mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
LENGTHS = np.array([5, 12], np.int32)     # prompt lengths; prompts are padded to 12
PROMPT = 12
STEPS = 4
LOGIT_TOL = 1e-3
FP8_LOGIT_BOUND = 5e-2


@pytest.fixture(scope="module", params=[
    (PLAIN, "mla_decode", "rope_set"), (FP8, "mla_decode", "rope_set"),
    (PLAIN, "mla_decode", "set"), (PLAIN, "gather", "set"), (FP8, "gather", "set")],
    ids=["bf16", "fp8_per_token_head", "bf16_unfused_write", "bf16_gather",
         "fp8_per_token_head_gather"])
def run(request):
  """Prefill + STEPS decode steps (attention by mla_decode after the fused RoPE write, or
  after the separate write, or by gathering the context rows); returns everything the
  tests compare."""
  cache_cfg, attention, write = request.param
  cfg = mla_demo.MLADemoConfig(cache=cache_cfg)
  params = mla_demo.init_params(cfg, seed=0)
  batch = len(LENGTHS)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, PROMPT + STEPS))
  tokens = tokens.astype(np.int32)
  page_table = jnp.asarray(mla_demo.make_page_table(batch, PROMPT + STEPS, cache_cfg))

  # Compiled ahead of time so the no-copy test reads the HLO of the very executables run here.
  cache = mc.init_cache(cache_cfg)
  prompt = jnp.asarray(tokens[:, :PROMPT])
  prefill = mla_demo.prefill.lower(params, cache, prompt, LENGTHS, page_table).compile()
  decode = mla_demo.decode.lower(params, cache, prompt[:, 0], LENGTHS, page_table,
                                 attention=attention, write=write).compile()

  logits, cache = prefill(params, cache, prompt, LENGTHS, page_table)
  outputs = [logits]                      # outputs[i]: logits at position LENGTHS - 1 + i
  for i in range(STEPS):
    positions = LENGTHS + i
    logits, cache = decode(params, cache, tokens[np.arange(batch), positions], positions, page_table)
    outputs.append(logits)

  exact, _ = (mla_demo.reference_forward(params, jnp.asarray(tokens)) if cache_cfg.quantized
              else (None, None))
  stored, latents = mla_demo.reference_forward(params, jnp.asarray(tokens), cache_cfg)
  pick = lambda ref, i: np.asarray(ref)[np.arange(batch), LENGTHS - 1 + i]
  return dict(
      cache_cfg=cache_cfg, params=params, cache=cache, page_table=page_table, tokens=tokens,
      outputs=[np.asarray(o) for o in outputs],
      exact=exact is not None and [pick(exact, i) for i in range(STEPS + 1)],
      hlo={"prefill": prefill.as_text(), "decode": decode.as_text()}, decode=decode,
      stored=[pick(stored, i) for i in range(STEPS + 1)],
      # each layer's latents before rounding, given the earlier layers' stored ones
      latents=[(np.asarray(c), np.asarray(r)) for c, r in latents],
  )


def written_slots(run) -> np.ndarray:
  """(B, L) cache rows of each sequence's tokens (prompt + decoded), -1 past its end."""
  positions = np.arange(PROMPT + STEPS)[None, :]
  slots = np.asarray(mla_demo.token_slots(run["page_table"], jnp.asarray(
      np.broadcast_to(positions, (len(LENGTHS), PROMPT + STEPS))), run["cache_cfg"].page_size))
  return np.where(positions < (LENGTHS + STEPS)[:, None], slots, -1)


def test_decode_matches_recomputation_to_float_tolerance(run):
  for i, (out, ref) in enumerate(zip(run["outputs"], run["stored"])):
    chex.assert_shape(out, (len(LENGTHS), run["params"].config.vocab_size))
    err = np.abs(out - ref).max()
    assert err <= LOGIT_TOL * np.abs(ref).max(), f"step {i}: max |logit error| {err}"


def test_fp8_decode_within_bound_of_exact_recomputation(run):
  if not run["cache_cfg"].quantized:
    pytest.skip("per_token_head only")
  for i, (out, ref) in enumerate(zip(run["outputs"], run["exact"])):
    err = np.abs(out - ref).max()
    assert err <= FP8_LOGIT_BOUND * np.abs(ref).max(), f"step {i}: max |logit error| {err}"


def test_cached_rows_within_storage_bound(run):
  """Every cached latent row is the exact latent up to the storage format's rounding."""
  cfg = run["cache_cfg"]
  slots = written_slots(run)
  valid = slots >= 0
  f32_noise = 1e-5  # the two paths' float32 latents differ in their last bits
  for layer_id, (c_kv, k_rope) in enumerate(run["latents"]):
    nope, rope = mc.get_mla_kv_buffer(run["cache"], layer_id, slots[valid], jnp.float32)
    nope, rope = np.asarray(nope[:, 0]), np.asarray(rope[:, 0])
    c_kv, k_rope = c_kv[valid], k_rope[valid]
    if cfg.quantized:
      scale = np.abs(c_kv).max(-1, keepdims=True) / 448
      nope_bound = 2.0**-4 * np.abs(c_kv) + 2.0**-10 * scale
    else:
      nope_bound = 2.0**-8 * np.abs(c_kv)
    rope_bound = 2.0**-8 * np.abs(k_rope)
    assert np.all(np.abs(nope - c_kv) <= nope_bound * (1 + f32_noise) + f32_noise), layer_id
    assert np.all(np.abs(rope - k_rope) <= rope_bound * (1 + f32_noise) + f32_noise), layer_id


def test_only_sequence_pages_and_padding_page_written(run):
  """Padded prompt tokens land in page 0; no row outside the sequences' slots changes."""
  cfg = run["cache_cfg"]
  untouched = np.ones(cfg.rows, bool)
  untouched[written_slots(run)[written_slots(run) >= 0]] = False
  untouched[: cfg.page_size] = False
  for layer in run["cache"].buffers:
    for buf in layer:
      assert not np.asarray(buf, np.float32)[untouched].any()
  assert np.asarray(run["cache"].buffers[0][-1][0], np.float32).any(), "padding wrote row 0"


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_compiled_step_copies_no_cache_buffer(run, step):
  hlo = run["hlo"][step]
  assert copies_of_cache(hlo, run["cache_cfg"]) == []
  assert "input_output_alias" in hlo


def converts_of_cache(hlo: str, cfg) -> list[str]:
  """Lines of compiled HLO that convert a whole cache buffer to another dtype (a pass over
  the whole buffer that `copies_of_cache` does not see)."""
  dims = {",".join(map(str, shape)) for shape, _ in cfg.buffer_shapes()}
  return [line for line in hlo.splitlines()
          if re.search(r"\bconvert\(", line)
          and any(re.search(rf"= \w+\[{d}\]\S* convert\(", line) for d in dims)]


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_compiled_step_converts_no_cache_buffer(run, step):
  # XLA:CPU has no fp8 scatter: it would convert a whole fp8 buffer to f16 and back around
  # one (O(buffer) per write); the reference scatters the bit patterns instead.
  assert converts_of_cache(run["hlo"][step], run["cache_cfg"]) == []


def test_reusing_a_donated_cache_raises(run):
  cache = mc.init_cache(run["cache_cfg"])
  args = (np.zeros(len(LENGTHS), np.int32), LENGTHS, run["page_table"])
  _, new = run["decode"](run["params"], cache, *args)
  with pytest.raises(RuntimeError, match="deleted|donated"):
    run["decode"](run["params"], cache, *args)
  jax.block_until_ready(new)


def test_demo_cli_runs(capsys):
  from jax_mla_cache import demo

  results = demo.main(["--layers", "1", "--steps", "2", "--batch", "2", "--prompt-len", "4",
                       "--op-iters", "2"])
  out = capsys.readouterr().out
  assert results["implementation"] == mc.resolve_implementation(None)
  for row in ("decode", "set_mla_kv_buffer", "get_mla_kv_buffer", "cache bytes",
              results["implementation"]):
    assert row in out
  chex.assert_shape(results["generated"], (2, 2))
  assert results["decode_tokens_per_s"] > 0


def _mosaic_kernels_in_decode_step(layers: int, cache_cfg) -> tuple[int, int]:
  """(Mosaic GPU custom calls, characters) of the demo's decode step lowered for CUDA."""
  cfg = cache_cfg.replace(layer_num=layers, page_size=32)  # per_token_head decode: >= 32
  model_cfg = mla_demo.MLADemoConfig(cache=cfg, dtype=jnp.bfloat16)
  params = jax.eval_shape(lambda: mla_demo.init_params(model_cfg, seed=0))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  B = 4
  text = mla_demo.decode.trace(
      params, mc.cache_spec(cfg), i32(B), i32(B), i32(B, 2), implementation="pallas"
  ).lower(lowering_platforms=("cuda",)).as_text()
  return text.count("custom_call @mosaic_gpu_v2("), len(text)


@pytest.mark.parametrize("cache_cfg", [PLAIN, FP8], ids=["bf16", "fp8"])
def test_decode_step_emits_each_kernel_once_for_all_layers(cache_cfg):
  """Every layer calls the same kernels with the same static shapes: the lowered step holds
  one Mosaic GPU kernel per distinct op (a function called per layer), not one per layer,
  and no per-layer constant (the cos/sin table) -- what made a 61-layer step compile for
  minutes."""
  kernels_1, chars_1 = _mosaic_kernels_in_decode_step(1, cache_cfg)
  kernels_4, chars_4 = _mosaic_kernels_in_decode_step(4, cache_cfg)
  assert kernels_1 >= 2  # the fused write and mla_decode
  assert kernels_4 == kernels_1
  assert chars_4 < chars_1 + 3 * 60_000  # a layer adds its XLA ops, not kernels or tables


@pytest.mark.parametrize("cache_cfg,attention,write", [
    (FP8.replace(page_size=32), "mla_decode", "rope_set"), (PLAIN, "gather", "set")],
    ids=["fp8_mla_decode", "bf16_gather"])
def test_scanned_layers_give_the_unrolled_logits(cache_cfg, attention, write):
  """`stack_layers` + a StackedMLAKVCache: the layers run under lax.scan (traced layer ids)
  and give the unrolled model's logits (float tolerance: XLA may fuse the scanned body
  differently), prefill and decode."""
  cache_cfg = cache_cfg.replace(layer_num=3)
  cfg = mla_demo.MLADemoConfig(cache=cache_cfg)
  params = mla_demo.init_params(cfg, seed=0)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, PROMPT + 2)).astype(np.int32)
  page_table = jnp.asarray(mla_demo.make_page_table(2, PROMPT + 2, cache_cfg))
  logits = {}
  for stacked in (False, True):
    p = mla_demo.stack_layers(params) if stacked else params
    cache = mc.init_cache(cache_cfg, stacked=stacked)
    out, cache = mla_demo.prefill(p, cache, jnp.asarray(tokens[:, :PROMPT]), LENGTHS,
                                  page_table)
    outs = [out]
    for i in range(2):
      positions = LENGTHS + i
      out, cache = mla_demo.decode(p, cache, tokens[np.arange(2), positions], positions,
                                   page_table, attention=attention, write=write)
      outs.append(out)
    logits[stacked] = np.stack([np.asarray(o) for o in outs])
  scale = np.abs(logits[False]).max()
  np.testing.assert_allclose(logits[True], logits[False], atol=LOGIT_TOL * scale, rtol=0)
  with pytest.raises(TypeError, match="StackedMLAKVCache"):
    mla_demo.decode(mla_demo.stack_layers(params), mc.init_cache(cache_cfg), tokens[:, 0],
                    LENGTHS, page_table)


def test_scanned_decode_step_does_not_grow_with_layers():
  """The scanned decode step (stacked layers and cache) lowers for CUDA to one layer body:
  its module is the same size at 2 and 8 layers, with the same kernels."""
  def lowered(layers):
    cfg = FP8.replace(layer_num=layers, page_size=32)
    model_cfg = mla_demo.MLADemoConfig(cache=cfg, dtype=jnp.bfloat16)
    params = jax.eval_shape(lambda: mla_demo.stack_layers(mla_demo.init_params(model_cfg)))
    spec = mc.cache_spec(cfg, stacked=True)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    text = mla_demo.decode.trace(params, spec, i32(4), i32(4), i32(4, 2),
                                 implementation="pallas").lower(
        lowering_platforms=("cuda",)).as_text()
    return text.count("custom_call @mosaic_gpu_v2("), len(text)

  (kernels_2, chars_2), (kernels_8, chars_8) = lowered(2), lowered(8)
  assert kernels_2 >= 2 and kernels_8 == kernels_2
  assert abs(chars_8 - chars_2) < 2_000
