"""DeepSeek-V3/V2 on the cache (`jax_mla_cache.models.deepseek_v3`) against HF transformers.

The fixtures (`tests/fixtures/deepseek_v{3,2}_tiny`, made by `make_deepseek_v3.py` with
torch + transformers, which the tests never import) hold tiny random checkpoints with DeepSeek's
real MLA widths (512 + 64), YaRN rope scaling and MoE layers, and transformers' float32 logits:
every prompt position of 32 prompts (V2: 16) of different lengths, then 8 greedy decode steps.

Each run here prefills the prompts as one right-padded batch through a shuffled page table,
then runs the decode steps teacher-forced with the golden tokens (so a step whose argmax
differs does not change what later steps see), and compares:

* float32 cache: max |logit error| <= 1e-3 at every prompt position and step (measured ~6e-6);
* bf16 cache: <= BF16_TOL (measured 0.018 V3, 0.019 V2, of max|logit| ~7.7);
* per_token_head FP8 (ropes in bf16): greedy agreement >= 95% of decode steps and the mean KL
  divergence per step, printed (`pytest -s`) and in the README's numerics table (measured
  V3 249/256 = 97.3%, KL 8.2e-4; V2 127/128, KL 4.1e-4). Every miss is a near tie of
  transformers' top two logits (< 0.046); V3 has one MoE routing flip (error 2.94): see the README.

The decode attention is `mla_decode` (XLA path on CPU) unless a test says otherwise; the query
goes to it in bf16 for bf16 and FP8 caches (what the kernel reads). Prefill attends to the
prompt's own float32 latents (as serving engines do), so prefill logits are exact whatever the
cache stores; decode steps read the cache.
"""

import dataclasses
import functools
import json
import math
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the checkpoint loader reads the fixtures with "
                    "safetensors (the 'models' extra; included in 'test')")

import jax_mla_cache as mc  # noqa: E402
from jax_mla_cache.models import deepseek_v3 as ds  # noqa: E402
from jax_mla_cache.models import mla_demo  # noqa: E402
from tests.conftest import has_gpu  # noqa: E402
from tests.test_inplace import copies_of_cache  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
V3 = os.path.join(FIXTURES, "deepseek_v3_tiny")
V2 = os.path.join(FIXTURES, "deepseek_v2_tiny")
PAGE_SIZE = 32  # the mla_decode kernel takes 32 or a multiple of 64 with per_token_head
F32_TOL = 1e-3
BF16_TOL = 0.05
FP8_AGREEMENT = 0.95
FP8_MEAN_KL = 5e-3
PALLAS_STEPS = 2
PALLAS_BATCH = 4
PALLAS_ATTENTION_TOL = 0.05
SLOW = os.environ.get("JAX_MLA_CACHE_SLOW_TESTS") == "1"

CACHES = {
    "float32": dict(dtype=jnp.float32, model_dtype=jnp.float32),
    "bf16": dict(dtype=jnp.bfloat16),
    "fp8_per_token_head": dict(dtype=jnp.float8_e4m3fn, quant_method="per_token_head"),
}



@functools.cache
def params(path: str) -> ds.DeepseekParams:
  return ds.load_checkpoint(path, max_position=64)


@functools.cache
def golden(path: str) -> dict[str, np.ndarray]:
  with np.load(os.path.join(path, "golden.npz")) as f:
    return {k: f[k] for k in f.files}


def run(path: str, cache_name: str, steps: int = 8, implementation=None, attention="mla_decode",
        batch: int | None = None):
  """Prefill (all positions' logits) + `steps` teacher-forced decode steps of the first `batch`
  prompts (default all).

  Returns dict(prefill (B, S, V), decode (B, steps, V), cache, decode_hlo, page_table).
  """
  p, g = params(path), golden(path)
  g = {k: v[:batch] if k != "metadata" else v for k, v in g.items()}
  B, S = g["prompts"].shape
  pages_per_seq = -(-(S + steps) // PAGE_SIZE)
  cfg = ds.cache_config(p.config, size=(B * pages_per_seq + 3) * PAGE_SIZE, page_size=PAGE_SIZE,
                        **CACHES[cache_name])
  cache = mc.init_cache(cfg)
  page_table = jnp.asarray(mla_demo.make_page_table(B, S + steps, cfg, seed=1))
  prompts, lengths = jnp.asarray(g["prompts"]), jnp.asarray(g["lengths"])
  prefill_logits, cache = ds.prefill(p, cache, prompts, lengths, page_table, implementation,
                                     all_logits=True)
  decode = ds.decode_step.lower(p, cache, prompts[:, 0], lengths, page_table, implementation,
                                attention).compile()
  out = []
  for i in range(steps):
    logits, cache = decode(p, cache, jnp.asarray(g["decode_tokens"][:, i]), lengths + i,
                           page_table)
    out.append(np.asarray(logits))
  return dict(prefill=np.asarray(prefill_logits), decode=np.stack(out, 1), cache=cache,
              decode_hlo=decode.as_text(), page_table=page_table)


def prefill_error(path: str, logits: np.ndarray) -> float:
  g = golden(path)
  B = logits.shape[0]
  valid = np.arange(g["prompts"].shape[1])[None] < g["lengths"][:B, None]
  return float(np.abs(logits - g["prefill_logits"][:B])[valid].max())


def step_stats(path: str, logits: np.ndarray) -> dict[str, float]:
  """Max |error|, greedy agreement and mean KL(golden || ours) over (B, steps) decode steps."""
  ref = golden(path)["decode_logits"][: logits.shape[0], : logits.shape[1]]
  log_p, log_q = jax.nn.log_softmax(ref), jax.nn.log_softmax(logits)
  kl = np.asarray((np.exp(log_p) * (log_p - log_q)).sum(-1))
  return dict(max_abs=float(np.abs(logits - ref).max()),
              agreement=float((logits.argmax(-1) == ref.argmax(-1)).mean()),
              agreeing=int((logits.argmax(-1) == ref.argmax(-1)).sum()), steps=ref[..., 0].size,
              mean_kl=float(kl.mean()))


def report(name: str, path: str, result) -> dict[str, float]:
  stats = step_stats(path, result["decode"])
  print(f"\n{name} {os.path.basename(path)}: "
        f"prefill max|err| {prefill_error(path, result['prefill']):.3g}, "
        f"decode max|err| {stats['max_abs']:.3g}, greedy {stats['agreeing']}/{stats['steps']} "
        f"({stats['agreement']:.1%}), mean KL {stats['mean_kl']:.3g}")
  return stats


@pytest.fixture(scope="module", params=[V3, V2], ids=["v3", "v2"])
def float32_run(request):
  return request.param, run(request.param, "float32")


# ----------------------------------------------------------------- against transformers
def test_float32_cache_matches_transformers(float32_run):
  path, result = float32_run
  g = golden(path)
  chex.assert_shape(result["decode"], g["decode_logits"].shape)
  assert prefill_error(path, result["prefill"]) <= F32_TOL
  stats = report("float32 cache", path, result)
  for i in range(g["decode_logits"].shape[1]):
    err = np.abs(result["decode"][:, i] - g["decode_logits"][:, i]).max()
    assert err <= F32_TOL, f"decode step {i}: max |logit error| {err}"
  assert stats["agreement"] == 1.0


@pytest.mark.parametrize("path", [V3, V2], ids=["v3", "v2"])
def test_bf16_cache_within_tolerance(path):
  result = run(path, "bf16")
  assert prefill_error(path, result["prefill"]) <= F32_TOL  # prefill reads no cache
  stats = report("bf16 cache", path, result)
  assert stats["max_abs"] <= BF16_TOL
  assert stats["agreement"] >= FP8_AGREEMENT


@pytest.mark.parametrize("path", [V3, V2], ids=["v3", "v2"])
def test_fp8_per_token_head_greedy_agreement_and_kl(path):
  result = run(path, "fp8_per_token_head")
  stats = report("per_token_head fp8 cache", path, result)
  assert stats["agreement"] >= FP8_AGREEMENT, stats
  assert stats["mean_kl"] <= FP8_MEAN_KL, stats


@pytest.mark.parametrize("cache_name", ["bf16", "fp8_per_token_head"])
def test_pallas_interpret_against_xla_and_transformers(cache_name):
  """The Pallas kernels (interpret mode on CPU) in the model: the writes store the same bytes
  as the XLA path's; `mla_decode`'s kernel (bf16 probabilities on the tensor cores) moves the
  logits by up to PALLAS_ATTENTION_TOL from the XLA path's float32 softmax (bar a routing
  flip, see below). Interpret mode
  is slow (~10 s a decode step here), so this runs PALLAS_BATCH prompts for PALLAS_STEPS
  steps; JAX_MLA_CACHE_SLOW_TESTS=1 runs every prompt for 8 steps and then also asserts the
  greedy-agreement bound."""
  batch, steps = (None, 8) if SLOW else (PALLAS_BATCH, PALLAS_STEPS)
  pallas = run(V3, cache_name, steps, implementation="pallas", batch=batch)
  xla = run(V3, cache_name, steps, implementation="xla", batch=batch)
  stats = report(f"{cache_name} cache, pallas (interpret)", V3, pallas)
  # Same bytes: every row of layer 0 (its decode rows depend on the tokens only) and the
  # prompt rows of every layer (later layers' decode rows follow the attention's output).
  lengths = golden(V3)["lengths"][:pallas["prefill"].shape[0]]
  page_table = np.asarray(pallas["page_table"])
  prompt_rows = np.concatenate([page_table[b, np.arange(n) // PAGE_SIZE] * PAGE_SIZE
                                + np.arange(n) % PAGE_SIZE for b, n in enumerate(lengths)])
  for layer, (layer_p, layer_x) in enumerate(zip(pallas["cache"].buffers, xla["cache"].buffers)):
    for buf_p, buf_x in zip(layer_p, layer_x):
      rows = slice(None) if layer == 0 else prompt_rows
      np.testing.assert_array_equal(np.asarray(buf_p)[rows].view(np.uint8),
                                    np.asarray(buf_x)[rows].view(np.uint8))
  np.testing.assert_allclose(pallas["prefill"], xla["prefill"], rtol=0, atol=1e-5)
  # Within the kernel's tolerance at every step, but for a step where the difference flips a
  # MoE layer's top-k choice (routing is discontinuous; one step of 256 in the full run).
  step_diff = np.abs(pallas["decode"] - xla["decode"]).max(-1)
  over = step_diff > PALLAS_ATTENTION_TOL
  assert over.mean() <= 0.01, np.argwhere(over)
  assert prefill_error(V3, pallas["prefill"]) <= F32_TOL
  assert stats["mean_kl"] <= FP8_MEAN_KL, stats
  if cache_name == "bf16":
    assert stats["max_abs"] <= BF16_TOL
  if SLOW or cache_name == "bf16":
    assert stats["agreement"] >= FP8_AGREEMENT, stats


@pytest.mark.parametrize("cache_name", ["bf16", "fp8_per_token_head"])
def test_gather_attention_equals_mla_decode(cache_name):
  """attention="gather" (get_mla_kv_buffer + softmax) and "mla_decode" (in place) compute
  the same attention: logits equal to float32 rounding."""
  by_gather = run(V3, cache_name, 3, implementation="xla", attention="gather")
  in_place = run(V3, cache_name, 3, implementation="xla", attention="mla_decode")
  np.testing.assert_allclose(by_gather["decode"], in_place["decode"], rtol=0, atol=1e-4)


def test_generate_reproduces_transformers_greedy_tokens():
  """Free-running greedy generation (the prefill's argmax, then each step's) with a float32
  cache produces transformers' tokens and logits."""
  g, p = golden(V3), params(V3)
  B, S = g["prompts"].shape
  steps = g["decode_tokens"].shape[1]
  cfg = ds.cache_config(p.config, size=B * 3 * PAGE_SIZE, page_size=PAGE_SIZE,
                        **CACHES["float32"])
  page_table = mla_demo.make_page_table(B, S + steps, cfg)
  tokens, logits, _ = ds.generate(p, mc.init_cache(cfg), g["prompts"], g["lengths"], page_table,
                                  steps)
  np.testing.assert_array_equal(tokens, g["decode_tokens"])
  np.testing.assert_allclose(logits, g["decode_logits"], rtol=0, atol=F32_TOL)


# ----------------------------------------------------------------- in place
@pytest.mark.parametrize("cache_name", ["bf16", "fp8_per_token_head"])
def test_decode_step_copies_no_cache_buffer(cache_name):
  p = params(V3)
  cfg = ds.cache_config(p.config, size=4 * PAGE_SIZE, page_size=PAGE_SIZE, **CACHES[cache_name])
  page_table = jnp.asarray(mla_demo.make_page_table(2, 2 * PAGE_SIZE, cfg))
  args = (jnp.zeros((2,), jnp.int32), jnp.array([3, 17], jnp.int32), page_table)
  hlo = ds.decode_step.lower(p, mc.init_cache(cfg), *args).compile().as_text()
  assert copies_of_cache(hlo, cfg) == []
  assert "input_output_alias" in hlo


def test_decode_writes_rows_through_the_page_table(float32_run):
  """After prefill + decode, each sequence's rows hold its tokens' latents at
  `page_table[b, p // page_size] * page_size + p % page_size`; other pages stay zero."""
  path, result = float32_run
  g = golden(path)
  cache, page_table = result["cache"], np.asarray(result["page_table"])
  B, S = g["prompts"].shape
  end = g["lengths"] + g["decode_tokens"].shape[1]
  written = np.zeros(cache.config.rows, bool)
  for b in range(B):
    pos = np.arange(end[b])
    written[page_table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE] = True
  kv = np.asarray(cache.buffers[0][0])[:, 0]
  assert np.all(np.abs(kv[written]).max(-1) > 0)
  written[:PAGE_SIZE] = True  # page 0: prompt padding writes there
  assert not kv[~written].any()


# ----------------------------------------------------------------- the gather attention (SPEC §7)
def mla_decode_float64(rows, page_table, seq_lens, q, sm_scale, page_size, kv_lora_rank):
  """SPEC §7 in float64 numpy, one query at a time."""
  B, s_q, H, _ = q.shape
  n_pages = rows.shape[0] // page_size
  out = np.zeros((B, s_q, H, kv_lora_rank))
  lse = np.full((B, s_q, H), -np.inf)
  C = page_table.shape[1] * page_size
  for b in range(B):
    for j in range(s_q):
      last = min(seq_lens[b], C) - s_q + j
      pos = [p for p in range(max(last + 1, 0)) if 0 <= page_table[b, p // page_size] < n_pages]
      if not pos:
        continue
      k = np.stack([rows[page_table[b, p // page_size] * page_size + p % page_size] for p in pos])
      s = sm_scale * q[b, j].astype(np.float64) @ k.T                          # (H, n)
      m = s.max(-1, keepdims=True)
      e = np.exp(s - m)
      out[b, j] = (e / e.sum(-1, keepdims=True)) @ k[:, :kv_lora_rank]
      lse[b, j] = (m + np.log(e.sum(-1, keepdims=True)))[:, 0]
  return out, lse


@pytest.mark.parametrize("quant", [None, "per_token_head"])
def test_gather_mla_decode_follows_spec(quant, rng):
  """Causal draft queries (s_q = 2), a sequence with no visible position, a page id out of
  range (masked), and seq_lens past the page table (clamped)."""
  cfg = mc.SMALL.replace(layer_num=1, page_size=4, size=60)
  if quant:
    cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  rows = rng.standard_normal((cfg.rows, cfg.kv_cache_dim)).astype(np.float32)
  cache = mc.set_kv_buffer(mc.init_cache(cfg), 0, np.arange(cfg.rows),
                           jnp.asarray(rows[:, None], jnp.bfloat16))
  nope, rope = mc.get_mla_kv_buffer(cache, 0, np.arange(cfg.rows), jnp.float32)
  stored = np.concatenate([np.asarray(nope), np.asarray(rope)], -1)[:, 0].astype(np.float64)
  page_table = np.array([[3, 7, 1], [2, 99, 5], [4, 6, 8], [9, 10, 11]], np.int32)
  seq_lens = np.array([9, 12, 1, 40], np.int32)
  q = rng.standard_normal((4, 2, 3, cfg.kv_cache_dim)).astype(np.float32)
  out, lse = ds.gather_mla_decode(cache, 0, jnp.asarray(q), jnp.asarray(page_table),
                                  jnp.asarray(seq_lens), sm_scale=0.1)
  want_out, want_lse = mla_decode_float64(stored, page_table, seq_lens, q, 0.1, cfg.page_size,
                                          cfg.kv_lora_rank)
  chex.assert_shape(out, (4, 2, 3, cfg.kv_lora_rank))
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(lse)[2, 0] == -np.inf) and not np.asarray(out)[2, 0].any()


# ----------------------------------------------------------------- loading
def test_config_from_both_rope_layouts():
  """transformers 5 writes `rope_parameters`; real checkpoints `rope_scaling` + `rope_theta`."""
  with open(os.path.join(V3, "config.json")) as f:
    hf = json.load(f)
  real = {k: v for k, v in hf.items() if k != "rope_parameters"}
  real["rope_theta"] = hf["rope_parameters"]["rope_theta"]
  real["rope_scaling"] = {k: v for k, v in hf["rope_parameters"].items()
                          if k not in ("rope_theta", "rope_type")}
  a, b = ds.DeepseekConfig.from_hf(hf), ds.DeepseekConfig.from_hf(real)
  assert a.rope_scaling_dict["factor"] == b.rope_scaling_dict["factor"] == 40.0
  np.testing.assert_array_equal(a.cos_sin_cache(128), b.cos_sin_cache(128))
  assert a.softmax_scale == b.softmax_scale
  mscale = 0.1 * math.log(40.0) + 1.0
  assert math.isclose(a.softmax_scale, 96 ** -0.5 * mscale**2)
  assert (a.scoring_func, a.topk_method, a.q_lora_rank) == ("sigmoid", "noaux_tc", 48)
  assert [a.is_moe_layer(i) for i in range(3)] == [False, True, True]
  v2 = params(V2).config
  assert (v2.scoring_func, v2.topk_method, v2.q_lora_rank) == \
      ("softmax", "group_limited_greedy", None)


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """A safetensors file of numpy arrays, fp8 included (the format: 8-byte header length,
  JSON header, data)."""
  names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
           np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int8): "I8"}
  header, blobs, offset = {}, [], 0
  for name, array in tensors.items():
    data = np.ascontiguousarray(array).tobytes()
    header[name] = dict(dtype=names[array.dtype], shape=list(array.shape),
                        data_offsets=[offset, offset + len(data)])
    blobs.append(data)
    offset += len(data)
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_fp8_block_quantized_and_bf16_weights_load(tmp_path):
  """DeepSeek-V3's FP8 checkpoints: (out, in) float8_e4m3fn weights with a float32
  `weight_scale_inv` per 128 x 128 block (here 32 x 32 blocks, partial at the edges), and
  bf16 weights."""
  from safetensors.numpy import load_file

  tensors = load_file(os.path.join(V3, "model.safetensors"))
  block = 32
  expected = {}
  for name in list(tensors):
    w = tensors[name]
    if name.endswith("kv_b_proj.weight") or name.endswith("q_b_proj.weight"):
      rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
      scale = np.zeros((rows, cols), np.float32)
      q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
      for i in range(rows):
        for j in range(cols):
          tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
          scale[i, j] = np.abs(tile).max() / 448
          q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
              (tile / scale[i, j]).astype(q.dtype)
      tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, scale
      expected[name] = q.astype(np.float32) * np.repeat(np.repeat(scale, block, 0), block, 1)[
          : w.shape[0], : w.shape[1]]
    elif name.endswith("o_proj.weight"):
      tensors[name] = w.astype(ml_dtypes.bfloat16)
      expected[name] = tensors[name].astype(np.float32)
  _write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  with open(os.path.join(V3, "config.json")) as f:
    config = json.load(f)
  config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                       weight_block_size=[block, block])
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  loaded = ds.load_checkpoint(str(tmp_path), max_position=64)
  c = loaded.config
  H, dn, R = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
  for i, layer in enumerate(loaded.layers):
    kv_b = expected[f"model.layers.{i}.self_attn.kv_b_proj.weight"].reshape(H, -1, R)
    np.testing.assert_array_equal(np.asarray(layer.attention.w_uk), kv_b[:, :dn])
    np.testing.assert_array_equal(np.asarray(layer.attention.q_b_proj).reshape(c.q_lora_rank, -1),
                                  expected[f"model.layers.{i}.self_attn.q_b_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(layer.attention.o_proj).reshape(-1, c.hidden_size),
                                  expected[f"model.layers.{i}.self_attn.o_proj.weight"].T)


def test_fused_expert_layout_loads_like_per_expert(tmp_path):
  """transformers 5's in-memory names (`mlp.experts.gate_up_proj` (E, 2I, D),
  `mlp.experts.down_proj` (E, D, I)) load to the same weights as the per-expert names."""
  from safetensors.numpy import load_file, save_file

  tensors = load_file(os.path.join(V3, "model.safetensors"))
  c = params(V3).config
  for layer in range(c.first_k_dense_replace, c.num_hidden_layers):
    p = f"model.layers.{layer}.mlp.experts"
    get = lambda e, proj: tensors.pop(f"{p}.{e}.{proj}.weight")
    gate_up, down = [], []
    for e in range(c.n_routed_experts):
      gate_up.append(np.concatenate([get(e, "gate_proj"), get(e, "up_proj")], 0))
      down.append(get(e, "down_proj"))
    tensors[f"{p}.gate_up_proj"], tensors[f"{p}.down_proj"] = np.stack(gate_up), np.stack(down)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  shutil.copy(os.path.join(V3, "config.json"), tmp_path / "config.json")
  fused = ds.load_checkpoint(str(tmp_path), max_position=64)
  chex.assert_trees_all_equal(fused, params(V3))


def test_bad_input_names_the_argument(tmp_path):
  with pytest.raises(FileNotFoundError, match="path="):
    shutil.copy(os.path.join(V3, "config.json"), tmp_path / "config.json")
    ds.load_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match="model_type"):
    ds.DeepseekConfig.from_hf(dict(model_type="llama"))
  p = params(V3)
  small = mc.init_cache(mc.SMALL)  # 2 layers; the model has 3
  with pytest.raises(ValueError, match="cache must have"):
    ds.decode_step(p, small, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                   jnp.ones((2, 1), jnp.int32))
  cfg = ds.cache_config(p.config, size=64, page_size=PAGE_SIZE)
  with pytest.raises(ValueError, match="positions must have shape"):
    ds.decode_step(p, mc.init_cache(cfg), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
                   jnp.ones((2, 1), jnp.int32))
  with pytest.raises(ValueError, match="attention must be one of"):
    ds.decode_step(p, mc.init_cache(cfg), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                   jnp.ones((2, 1), jnp.int32), attention="flash")


def _edited_checkpoint(tmp_path, edit_config=None, edit_tensors=None) -> str:
  """The V3 fixture copied to `tmp_path` with its config.json and/or tensors edited."""
  from safetensors.numpy import load_file
  with open(os.path.join(V3, "config.json")) as f:
    config = json.load(f)
  if edit_config:
    edit_config(config)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  if edit_tensors:
    tensors = load_file(os.path.join(V3, "model.safetensors"))
    edit_tensors(tensors)
    _write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  else:
    shutil.copy(os.path.join(V3, "model.safetensors"), tmp_path / "model.safetensors")
  return str(tmp_path)


def _int8_o_proj(tensors):
  name = "model.layers.0.self_attn.o_proj.weight"
  tensors[name] = np.clip(np.round(tensors[name] * 1000), -127, 127).astype(np.int8)


CHECKPOINT_REFUSALS = {
    # (config edit, tensor edit, load kwargs, error, message): each loaded silently before
    # (second hostile-input pass, 2026-12-07c), with wrong weights, tables or logits.
    "rope_interleave_false": (lambda c: c.update(rope_interleave=False), None, {},
                              NotImplementedError, "rope_interleave=False"),
    "other_quantization": (lambda c: c.update(quantization_config=dict(
        quant_method="compressed-tensors")), None, {}, NotImplementedError,
        "quant_method='compressed-tensors'"),
    "int8_weights": (None, _int8_o_proj, {}, NotImplementedError, "o_proj.weight is int8"),
    "int8_dtype": (None, None, dict(dtype=jnp.int8), TypeError, "dtype must be float32"),
    "max_position_0": (None, None, dict(max_position=0), ValueError, "max_position"),
    "missing_key": (lambda c: c.pop("kv_lora_rank"), None, {}, ValueError,
                    "missing kv_lora_rank"),
    "widths_do_not_match": (lambda c: c.update(kv_lora_rank=2 * c["kv_lora_rank"]), None, {},
                            ValueError, "kv_b_proj.weight has .* does not match"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_REFUSALS))
def test_checkpoints_the_loader_cannot_read_are_refused(tmp_path, case):
  edit_config, edit_tensors, kwargs, error, message = CHECKPOINT_REFUSALS[case]
  path = _edited_checkpoint(tmp_path, edit_config, edit_tensors)
  with pytest.raises(error, match=message):
    ds.load_checkpoint(path, **{"max_position": 64, **kwargs})


def test_rope_parameters_are_checked():
  from jax_mla_cache import rope
  hf = dict(qk_rope_head_dim=8, rope_theta=10000.0, max_position_embeddings=64,
            rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=16,
                              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
  assert rope.cos_sin_cache_from_hf_config(hf).shape == (64, 8)
  for edit, message in ((dict(rope_theta=0.0), "rope_theta"),
                        (dict(rope_theta=float("nan")), "rope_theta"),
                        (dict(factor=0), "factor"), (dict(factor=-2), "factor"),
                        (dict(original_max_position_embeddings=0), "original_max_position"),
                        (dict(beta_fast=0), "beta_fast")):
    bad = dict(hf, rope_scaling=dict(hf["rope_scaling"]))
    for key, value in edit.items():
      (bad if key == "rope_theta" else bad["rope_scaling"])[key] = value
    with pytest.raises(ValueError, match=message):
      rope.cos_sin_cache_from_hf_config(bad)
  for max_position in (0, -1, 2.7, True):
    with pytest.raises(ValueError, match="max_position"):
      rope.cos_sin_cache_from_hf_config(hf, max_position)
  for dim in (0, -4, 192.5):
    with pytest.raises(ValueError, match="qk_head_dim"):
      rope.deepseek_softmax_scale(dim, None)


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cache_name", list(CACHES))
def test_gpu_matches_transformers(cache_name):
  """On the GPU with the default implementation (the Pallas kernels on sm_90+): the same
  bounds as on CPU (float32 weights, matmuls at Precision.HIGHEST)."""
  assert has_gpu()
  result = run(V3, cache_name)
  stats = report(f"{cache_name} cache, GPU", V3, result)
  assert prefill_error(V3, result["prefill"]) <= F32_TOL
  if cache_name == "float32":
    assert stats["max_abs"] <= F32_TOL
  elif cache_name == "bf16":
    assert stats["max_abs"] <= BF16_TOL
  else:
    assert stats["agreement"] >= FP8_AGREEMENT and stats["mean_kl"] <= FP8_MEAN_KL, stats
  assert copies_of_cache(result["decode_hlo"], result["cache"].config) == []


@pytest.mark.gpu
def test_gpu_deepseek_v3_shaped_decode_runs():
  """DeepSeek-V3's real attention widths (128 heads, 7168 hidden), 2 layers, random bf16
  weights: a bf16-cache decode step compiles with no cache copy and gives finite logits."""
  config = ds.deepseek_v3_shaped(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
                                 n_group=1, topk_group=1)
  config = dataclasses.replace(config, vocab_size=4096)
  p = ds.random_params(config, max_position=1024)
  cfg = ds.cache_config(config, size=16 * 64, page_size=64)
  cache = mc.init_cache(cfg)
  page_table = jnp.asarray(mla_demo.make_page_table(4, 256, cfg))
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (4, 64)), jnp.int32)
  lengths = jnp.array([64, 10, 33, 1], jnp.int32)
  logits, cache = ds.prefill(p, cache, prompts, lengths, page_table)
  step = ds.decode_step.lower(p, cache, lengths, lengths, page_table).compile()
  assert copies_of_cache(step.as_text(), cfg) == []
  logits, cache = step(p, cache, jnp.argmax(logits, -1).astype(jnp.int32), lengths, page_table)
  assert np.isfinite(np.asarray(logits)).all()


# ----------------------------------------------------------------- README and demo
def test_readme_example_runs():
  text = open(os.path.join(os.path.dirname(FIXTURES), os.pardir, "README.md")).read()
  example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "deepseek_v3.load_checkpoint" in block)
  scope: dict = {}
  cwd = os.getcwd()
  os.chdir(os.path.join(os.path.dirname(FIXTURES), os.pardir))
  try:
    exec(compile(example, "README.md", "exec"), scope)
  finally:
    os.chdir(cwd)
  chex.assert_shape(scope["tokens"], (2, 8))
  chex.assert_shape(scope["step_logits"], (2, 8, 256))


def test_demo_section_runs_the_fixture(capsys):
  from jax_mla_cache import demo

  rest, mine = demo.split_deepseek_args(
      ["--layers", "1", "--deepseek-steps", "2", "--no-bench", "--deepseek-iters", "1"])
  assert rest == ["--layers", "1", "--no-bench"]
  assert mine == ["--deepseek-steps", "2", "--deepseek-iters", "1"]
  results = demo.deepseek_main(mine)
  out = capsys.readouterr().out
  for text in ("tokens/s", "of the step", "greedy tokens equal to transformers'"):
    assert text in out
  run_ = results["checkpoint"]
  np.testing.assert_array_equal(run_["generated"], golden(V3)["decode_tokens"][:, :2])
  assert run_["golden_agreement"] == 1.0
  assert run_["decode_tokens_per_s"] > 0 and 0 < run_["write_us"] and 0 < run_["attention_us"]
  assert "shaped" not in results  # the DeepSeek-V3-shaped model runs on GPUs (or --deepseek-shaped)


def test_demo_shaped_model_path_on_a_small_config():
  """The GPU demo's random-weight path (`random_params`, the step breakdown) on small widths."""
  from jax_mla_cache import demo

  config = dataclasses.replace(
      ds.deepseek_v3_shaped(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=2, topk_group=1),
      vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=2,
      q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=16)
  p = ds.random_params(config, dtype=jnp.float32, max_position=64)
  cfg = ds.cache_config(config, size=4 * 2 * PAGE_SIZE, page_size=PAGE_SIZE)
  prompts = np.random.default_rng(0).integers(0, 128, (3, 12)).astype(np.int32)
  result = demo._deepseek_run("small", p, cfg, prompts, np.array([12, 3, 7], np.int32), 3, None,
                              "mla_decode", 1)
  chex.assert_shape(result["generated"], (3, 3))
  assert result["cache_share"] > 0


@pytest.mark.parametrize("cache_name", ["bf16", "fp8_per_token_head"])
def test_decode_step_lowers_for_cuda_with_the_kernels(cache_name):
  """The decode step of the DeepSeek-V3-shaped model (128 heads, 7168 hidden, one MoE layer)
  lowers for CUDA on this CPU host with implementation="pallas": the fused write and
  mla_decode kernels take the model's shapes (they raise at trace time when they don't)."""
  config = ds.deepseek_v3_shaped(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                 n_group=1, topk_group=1)
  config = dataclasses.replace(config, vocab_size=1024, max_position_embeddings=4096)
  p = jax.eval_shape(lambda: ds.random_params(config, max_position=4096))
  p = dataclasses.replace(p, cos_sin_cache=jax.ShapeDtypeStruct((4096, 64), jnp.float32))
  cfg = ds.cache_config(config, size=64 * 64, page_size=64, **CACHES[cache_name])
  B = 8
  args = (p, mc.cache_spec(cfg), jax.ShapeDtypeStruct((B,), jnp.int32),
          jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, 8), jnp.int32))
  text = ds.decode_step.trace(*args, implementation="pallas").lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
