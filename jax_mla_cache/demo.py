"""The cache inside a model: prefill + greedy decode of a DeepSeek-style MLA model.

    python -m jax_mla_cache demo [--layers N] [--steps N] [--batch N] [--prompt-len N]
                                 [--quant {none,per_token_head}]
                                 [--implementation {auto,xla,pallas}] [--scan]

On a GPU: the DeepSeek-V3 cache (61 layers, 2^18 rows of 512 + 64, page 64) under a
small random-weight model (`jax_mla_cache.models.mla_demo`), batch 32. On CPU: a
2-layer model on a small cache, well under a minute. Prints a progress line per
decode step, then a table: tokens/s, the time of the two cache ops the model calls
per layer (`set_mla_kv_buffer` with the decode step's B rows, `get_mla_kv_buffer`
with its B x context rows; timed alone, as `jax_mla_cache.bench` times them),
the cache's bytes, the implementation and the device. `--scan` runs the model's layers
under `jax.lax.scan` (stacked weights, a `StackedMLAKVCache`): one compiled layer body.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench
from jax_mla_cache.models import deepseek_v3 as ds_model
from jax_mla_cache.models import mla_demo

GPU_MODEL = dict(hidden_size=1024, num_heads=16, qk_nope_head_dim=128, v_head_dim=128,
                 mlp_size=2048, vocab_size=8192)
"""Model shapes under the 61-layer cache on a GPU (the weights are random; the cache
dims are DeepSeek-V3's, the model's are smaller so the weights stay ~1.5 GB)."""


def use_compilation_cache(path: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache (what a serving stack should do too).

  Compiled executables that took >= 1 s to compile are kept on disk, keyed by the lowered
  program, the device and the jax version, so a restart with the same shapes (the same
  batch buckets) loads them instead of compiling again. `path`: the directory; default
  $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax_mla_cache/xla. Returns the directory.
  """
  path = (path or os.environ.get("JAX_COMPILATION_CACHE_DIR")
          or os.path.join(os.path.expanduser("~"), ".cache", "jax_mla_cache", "xla"))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


def _parse(argv: list[str], on_gpu: bool) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m jax_mla_cache demo", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="the demo's other sections (python -m jax_mla_cache demo ...):\n"
             "  --no-bench            skip the kernel benchmark table at the end\n"
             "  --no-compilation-cache  no persistent compilation cache\n\n"
             "DeepSeek-V3 section " + deepseek_help(on_gpu))
  parser.add_argument("--layers", type=int, default=61 if on_gpu else 2)
  parser.add_argument("--steps", type=int, default=64 if on_gpu else 16, help="decode steps")
  parser.add_argument("--batch", type=int, default=32 if on_gpu else 4)
  parser.add_argument("--prompt-len", type=int, default=512 if on_gpu else 32)
  parser.add_argument("--quant", choices=("none", "per_token_head"), default="none",
                      help="cache storage: plain bf16, or per_token_head fp8")
  parser.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto",
                      help="cache ops: auto = Pallas on Hopper+ GPUs, XLA elsewhere")
  parser.add_argument("--model-dtype", choices=("float32", "bfloat16"),
                      default="bfloat16" if on_gpu else "float32",
                      help="the model's matmul dtype (the cache stores bf16 or fp8 either way)")
  parser.add_argument("--op-iters", type=int, default=50 if on_gpu else 10,
                      help="calls per cache-op timing")
  parser.add_argument("--attention", choices=("mla_decode", "gather"), default="mla_decode",
                      help="decode attention: mla_decode reads the cache in place; gather "
                           "copies every context row out first (get_mla_kv_buffer)")
  parser.add_argument("--write", choices=("rope_set", "set"), default="rope_set",
                      help="decode write: rope_set fuses both RoPEs, the latent write and the "
                           "query assembly into one launch; set keeps them separate "
                           "(with --attention gather: set)")
  parser.add_argument("--scan", action="store_true",
                      help="run the model's layers under lax.scan (stacked weights and a "
                           "StackedMLAKVCache: one compiled layer body)")
  parser.add_argument("--compare-attention", action=argparse.BooleanOptionalAction,
                      default=on_gpu,
                      help="also time a decode step with the other attention and write")
  args = parser.parse_args(argv)
  _require_positive(parser, args, ("layers", "steps", "batch", "prompt_len", "op_iters"))
  return args


def _require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      names: tuple[str, ...]) -> None:
  """argparse's error unless each option `names` (attribute names) is >= 1 or unset."""
  for name in names:
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def cache_config(args: argparse.Namespace, on_gpu: bool) -> mc.MLACacheConfig:
  """DeepSeek-V3's cache on a GPU, a small one sized to the batch on CPU."""
  if on_gpu:
    cfg = mc.DEEPSEEK_V3.replace(layer_num=args.layers)
  else:
    pages = args.batch * -(-(args.prompt_len + args.steps) // mc.SMALL.page_size)
    cfg = mc.SMALL.replace(layer_num=args.layers, size=pages * mc.SMALL.page_size)
  if args.quant == "per_token_head":
    cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  return cfg


def _progress(step: int, total: int, seconds: float, tty: bool) -> None:
  width = 30
  done = width * step // total
  line = f"  decode {step:4d}/{total} [{'#' * done}{'.' * (width - done)}] {seconds * 1e3:8.2f} ms"
  if tty:
    print("\r" + line, end="\n" if step == total else "", flush=True)
  else:
    print(line, flush=True)


def time_cache_ops(
    cache: mc.MLAKVCache, write_loc: np.ndarray, read_loc: np.ndarray,
    implementation: str | None, iters: int,
) -> tuple[dict[str, float], str, mc.MLAKVCache]:
  """Microseconds per call of layer 0's set (rows `write_loc`) and get (rows `read_loc`).

  Returns ({"set_mla_kv_buffer": us, "get_mla_kv_buffer": us}, method, cache). The
  cache is donated through the set calls and handed back.
  """
  cfg = cache.config
  rng = np.random.default_rng(0)
  shape = lambda width: (len(write_loc), 1, width)
  nope = jnp.asarray(rng.standard_normal(shape(cfg.kv_lora_rank), np.float32), cfg.model_dtype)
  rope = jnp.asarray(rng.standard_normal(shape(cfg.qk_rope_head_dim), np.float32), cfg.model_dtype)
  write_loc, read_loc = jnp.asarray(write_loc), jnp.asarray(read_loc)

  def set_step(cache):
    return mc.set_mla_kv_buffer(cache, 0, write_loc, nope, rope, implementation=implementation)

  def get_step(_):
    return mc.get_mla_kv_buffer(cache, 0, read_loc, implementation=implementation)

  set_us, cache, method = bench.time_per_call(set_step, cache, iters)
  get_us, _, _ = bench.time_per_call(get_step, None, iters)
  return {"set_mla_kv_buffer": set_us, "get_mla_kv_buffer": get_us}, method, cache


def time_decode_steps(params, cache, tokens, positions, page_table, implementation, iters: int
                      ) -> tuple[dict[str, float], mc.MLAKVCache]:
  """Wall-clock milliseconds per decode step for each (attention, write): mla_decode after
  the fused write, mla_decode after the separate write, gather; repeating the last step
  (same tokens and slots) after a warm-up call. The cache is donated through the steps and
  handed back."""
  result = {}
  for attention, write in (("mla_decode", "rope_set"), ("mla_decode", "set"), ("gather", "set")):
    step = functools.partial(mla_demo.decode, implementation=implementation, attention=attention,
                             write=write)
    logits, cache = step(params, cache, tokens, positions, page_table)
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
      logits, cache = step(params, cache, tokens, positions, page_table)
    logits.block_until_ready()
    result[f"{attention} attention, {write} write"] = (time.perf_counter() - t0) / iters * 1e3
  return result, cache


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Run the demo; returns the figures of the final table."""
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  args = _parse(list(sys.argv[1:] if argv is None else argv), on_gpu)
  implementation = None if args.implementation == "auto" else args.implementation
  resolved = mc.resolve_implementation(implementation)
  cache_cfg = cache_config(args, on_gpu)
  model_cfg = mla_demo.MLADemoConfig(
      cache=cache_cfg, dtype=getattr(jnp, args.model_dtype), **(GPU_MODEL if on_gpu else {}))
  B, S, steps = args.batch, args.prompt_len, args.steps
  print(f"jax_mla_cache demo on {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"cache ops: {resolved}")
  print(f"  model: {args.layers} layers, hidden {model_cfg.hidden_size}, {model_cfg.num_heads} heads, "
        f"{args.model_dtype}; cache: {cache_cfg.rows} rows x "
        f"({cache_cfg.kv_lora_rank} + {cache_cfg.qk_rope_head_dim}), "
        f"{args.quant}, {_bytes(cache_cfg.kv_size_bytes)}")
  print(f"  batch {B}, prompt {S} tokens, {steps} decode steps"
        + (", layers under lax.scan (StackedMLAKVCache)" if args.scan else ""), flush=True)

  t0 = time.perf_counter()
  params = mla_demo.init_params(model_cfg, seed=0)
  cache = mc.init_cache(cache_cfg, stacked=args.scan)
  if args.scan:
    params = mla_demo.stack_layers(params)
  page_table = jnp.asarray(mla_demo.make_page_table(B, S + steps, cache_cfg))
  prompt = jnp.asarray(np.random.default_rng(1).integers(0, model_cfg.vocab_size, (B, S)), jnp.int32)
  lengths = jnp.full((B,), S, jnp.int32)
  jax.block_until_ready((params, cache))
  setup_s = time.perf_counter() - t0

  lower_s, compile_s = {}, {}

  def build(name, lowered):
    """(lowered: a function so that its trace + lower is timed apart from XLA's compile)"""
    t0 = time.perf_counter()
    lowered = lowered()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    lower_s[name], compile_s[name] = t1 - t0, time.perf_counter() - t0
    return compiled

  prefill = build("prefill", lambda: mla_demo.prefill.lower(
      params, cache, prompt, lengths, page_table, implementation=implementation))
  decode = build("decode", lambda: mla_demo.decode.lower(
      params, cache, prompt[:, 0], lengths, page_table, implementation=implementation,
      attention=args.attention, write=args.write))
  print(f"  set-up {setup_s:.1f} s, compile {sum(compile_s.values()):.1f} s (prefill step "
        f"{compile_s['prefill']:.1f} s, decode step {compile_s['decode']:.1f} s, of which trace + "
        f"lower {lower_s['prefill']:.1f} / {lower_s['decode']:.1f} s and the rest XLA's compile "
        f"or a load from the persistent compilation cache)", flush=True)

  t0 = time.perf_counter()
  logits, cache = prefill(params, cache, prompt, lengths, page_table)
  logits.block_until_ready()
  prefill_s = time.perf_counter() - t0
  print(f"  prefill {B} x {S} tokens: {prefill_s * 1e3:.1f} ms", flush=True)

  greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
  greedy(logits).block_until_ready()  # compiled before the clock starts
  positions = [jnp.full((B,), S + i, jnp.int32) for i in range(steps)]
  tty = sys.stdout.isatty()
  generated = []
  decode_start = time.perf_counter()
  for i in range(steps):
    t0 = time.perf_counter()
    tokens = greedy(logits)
    logits, cache = decode(params, cache, tokens, positions[i], page_table)
    logits.block_until_ready()
    generated.append(tokens)
    _progress(i + 1, steps, time.perf_counter() - t0, tty)
  decode_s = time.perf_counter() - decode_start

  # The rows the last decode step wrote and read, per layer.
  C = page_table.shape[1] * cache_cfg.page_size
  write_loc = np.asarray(mla_demo.token_slots(page_table, (lengths + steps - 1)[:, None],
                                              cache_cfg.page_size)).reshape(B)
  read_loc = np.asarray(mla_demo.token_slots(
      page_table, jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C)),
      cache_cfg.page_size)).reshape(B * C)
  op_us, method, cache = time_cache_ops(cache, write_loc, read_loc, implementation, args.op_iters)
  write = args.write if args.attention == "mla_decode" else "set"
  step_ms = {f"{args.attention} attention, {write} write": decode_s / steps * 1e3}
  if args.compare_attention:
    step_ms, cache = time_decode_steps(params, cache, tokens, positions[-1], page_table,
                                       implementation, iters=max(3, args.op_iters // 5))

  context_tokens = B * (S + steps)
  results = {
      "device": f"{device.device_kind} ({device.platform})",
      "implementation": resolved,
      "layers": args.layers,
      "scan": args.scan,
      "batch": B,
      "prefill_tokens_per_s": B * S / prefill_s,
      "decode_tokens_per_s": B * steps / decode_s,
      "decode_ms_per_step": decode_s / steps * 1e3,
      "compile_s": compile_s,
      "lower_s": lower_s,
      "set_mla_kv_buffer_us": op_us["set_mla_kv_buffer"],
      "get_mla_kv_buffer_us": op_us["get_mla_kv_buffer"],
      "op_timing": method,
      "attention": f"{args.attention} attention, {write} write",
      "decode_step_ms": step_ms,
      "cache_bytes": cache_cfg.kv_size_bytes,
      "context_bytes": context_tokens * cache_cfg.row_bytes * cache_cfg.layer_num,
      "generated": np.asarray(jnp.stack(generated, axis=1)) if generated else np.zeros((B, 0)),
  }
  _print_table(results, B, C, cache_cfg)
  return results


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n:,} B ({n / size:.2f} {unit})"
  return f"{n:,} B"


def _rate(x: float) -> str:
  return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _print_table(r: dict[str, Any], batch: int, context: int, cfg: mc.MLACacheConfig) -> None:
  rows = [
      ("device", r["device"]),
      ("cache ops implementation", r["implementation"]),
      ("prefill", f"{_rate(r['prefill_tokens_per_s'])} tokens/s"),
      ("decode loop", f"{_rate(r['decode_tokens_per_s'])} tokens/s ({r['decode_ms_per_step']:.2f} ms/step, "
                      f"batch {r['batch']}, {r['layers']} layers{' under lax.scan' if r['scan'] else ''}, "
                      f"{r['attention']}; sample + "
                      f"step, waited for every step)"),
      *((f"decode step, {name}", f"{ms:.2f} ms (wall clock, the step repeated without waiting: "
                                 f"dispatch overlaps the previous step)")
        for name, ms in r["decode_step_ms"].items() if len(r["decode_step_ms"]) > 1),
      (f"set_mla_kv_buffer, {batch} rows", f"{r['set_mla_kv_buffer_us']:,.1f} us/call"),
      (f"get_mla_kv_buffer, {batch * context} rows", f"{r['get_mla_kv_buffer_us']:,.1f} us/call"),
      ("cache op timing", r["op_timing"] + (" (device time, profiler)" if r["op_timing"] == "profiler"
                                            else " (wall clock per call, incl. dispatch)")),
      ("cache bytes (all layers)", _bytes(r["cache_bytes"])),
      ("bytes of cached context", f"{_bytes(r['context_bytes'])} ({cfg.row_bytes} B/row/layer)"),
  ]
  width = max(len(k) for k, _ in rows)
  print()
  for key, value in rows:
    print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
  main()


# ===================================================================== DeepSeek-V3 on the cache
# `python -m jax_mla_cache demo` also runs `jax_mla_cache.models.deepseek_v3`: the tiny
# checkpoint of tests/fixtures (a real Hugging Face directory, checked against transformers'
# logits) on any device, and on a GPU a DeepSeek-V3-shaped model with random weights. Options
# of this section all start with --deepseek (`split_deepseek_args` hands them here).

DEEPSEEK_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "fixtures", "deepseek_v3_tiny")
_DEEPSEEK_VALUE_OPTIONS = ("--deepseek-checkpoint", "--deepseek-quant", "--deepseek-attention",
                           "--deepseek-layers", "--deepseek-batch", "--deepseek-prompt-len",
                           "--deepseek-steps", "--deepseek-iters")


def split_deepseek_args(argv: list[str]) -> tuple[list[str], list[str]]:
  """(the main demo's arguments, this section's `--deepseek*` ones)."""
  rest, mine = [], []
  it = iter(argv)
  for arg in it:
    if arg.startswith("--deepseek") or arg == "--no-deepseek" or arg.startswith("--no-deepseek"):
      mine.append(arg)
      if arg in _DEEPSEEK_VALUE_OPTIONS:
        mine.append(next(it, ""))
    else:
      rest.append(arg)
  return rest, mine


def _deepseek_parser(on_gpu: bool) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jax_mla_cache demo (DeepSeek-V3 section)",
                                   add_help=False)
  parser.add_argument("--deepseek", action=argparse.BooleanOptionalAction, default=True,
                      help="run this section")
  parser.add_argument("--deepseek-checkpoint", default=DEEPSEEK_FIXTURE,
                      help="a Hugging Face DeepSeek-V2/V3 directory (default: the tiny fixture)")
  parser.add_argument("--deepseek-shaped", action=argparse.BooleanOptionalAction, default=on_gpu,
                      help="also a DeepSeek-V3-shaped model with random weights (GPU default)")
  parser.add_argument("--deepseek-quant", choices=("none", "per_token_head"), default="none",
                      help="cache storage: plain bf16, or per_token_head fp8")
  parser.add_argument("--deepseek-attention", choices=ds_model.ATTENTIONS, default="mla_decode")
  parser.add_argument("--deepseek-layers", type=int, default=4, help="shaped model's layers")
  parser.add_argument("--deepseek-batch", type=int, default=32, help="shaped model's batch")
  parser.add_argument("--deepseek-prompt-len", type=int, default=512,
                      help="shaped model's longest prompt")
  parser.add_argument("--deepseek-steps", type=int, default=None,
                      help="decode steps (default: the golden file's, or 32)")
  parser.add_argument("--deepseek-iters", type=int, default=20 if on_gpu else 5,
                      help="calls per timing of the step-share breakdown")
  return parser


def _parse_deepseek(argv: list[str], on_gpu: bool) -> argparse.Namespace:
  """The `--deepseek*` options, checked (a bad value or a checkpoint directory given but
  missing is an error before anything runs; the default fixture may be absent)."""
  parser = _deepseek_parser(on_gpu)
  args = parser.parse_args(argv)
  _require_positive(parser, args, ("deepseek_layers", "deepseek_batch", "deepseek_prompt_len",
                                   "deepseek_steps", "deepseek_iters"))
  path = args.deepseek_checkpoint
  if path != DEEPSEEK_FIXTURE and not os.path.isfile(os.path.join(path, "config.json")):
    parser.error(f"--deepseek-checkpoint: no config.json in {path}")
  return args


def check_deepseek_args(argv: list[str]) -> None:
  """Parse the `--deepseek*` options now (exits with argparse's message on a bad one), so
  that a typo is reported before the main demo runs, not after."""
  _parse_deepseek(list(argv), jax.devices()[0].platform == "gpu")


def deepseek_help(on_gpu: bool) -> str:
  """The `--deepseek*` options' help, for the demo's --help."""
  return _deepseek_parser(on_gpu).format_help().split("\n", 2)[-1]


def decode_step_breakdown(
    params: ds_model.DeepseekParams, cache: mc.MLAKVCache, tokens: jax.Array,
    positions: jax.Array, page_table: jax.Array, implementation: str | None, attention: str,
    iters: int,
) -> tuple[dict[str, Any], mc.MLAKVCache]:
  """Time one decode step, and the cache calls it makes run alone with the same shapes.

  Method: `bench.time_per_call` of (a) the jitted decode step, (b) a jitted function making
  only the step's latent writes (`rope_set_mla_kv_buffer` in every layer: RoPE + the write
  at the step's slots, the fused kernel on sm_90+) and (c) one making only its attention calls over the cache (every
  layer's `mla_decode`, or the gather path), on random queries and latents of the step's
  shapes and dtypes. On a GPU each figure is device time (the sum of the GPU kernels a call
  launches, from a profiler trace), so share = (b + c) / a is the part of the step's GPU
  time spent in cache ops; on CPU it is wall clock per call (dispatch included).
  Returns ({"step_us", "write_us", "attention_us", "method"}, the cache).
  """
  c = params.config
  B, L = tokens.shape[0], c.num_hidden_layers
  H, R, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
  rng = np.random.default_rng(0)
  random = lambda shape, dtype: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  q_dtype = ds_model.attention_q_dtype(cache.config)
  q_latent, q_rope = random((B, H, R), params.dtype), random((B, H, dr), params.dtype)
  c_kv, k_rope = random((B, 1, R), params.dtype), random((B, 1, dr), params.dtype)
  q = random((B, 1, H, R + dr), q_dtype)
  write_loc = mla_demo.token_slots(page_table, positions[:, None], cache.config.page_size)[:, 0]
  attend_fn = ds_model.gather_mla_decode if attention == "gather" else mc.mla_decode

  @jax.jit
  def attend(cache):
    return [attend_fn(cache, layer, q, page_table, positions + 1, sm_scale=c.softmax_scale,
                      implementation=implementation)[0] for layer in range(L)]

  @functools.partial(jax.jit, donate_argnums=0)
  def writes(cache):
    q_out = []
    for layer in range(L):
      cache, q_layer = mc.rope_set_mla_kv_buffer(
          cache, layer, write_loc, positions, q_latent, q_rope, c_kv, k_rope,
          params.cos_sin_cache, q_out_dtype=q_dtype, implementation=implementation)
      q_out.append(q_layer)
    return cache, q_out

  def step(state):
    return ds_model.decode_step(params, state[1], tokens, positions, page_table, implementation,
                                attention)

  attention_us, _, _ = bench.time_per_call(lambda _: attend(cache), None, iters)
  write_us, (cache, _), _ = bench.time_per_call(lambda s: writes(s[0]), (cache, None), iters)
  step_us, (_, cache), method = bench.time_per_call(step, (None, cache), iters)
  return dict(step_us=step_us, write_us=write_us, attention_us=attention_us, method=method), cache


def _deepseek_run(name: str, params: ds_model.DeepseekParams, cache_cfg: mc.MLACacheConfig,
                  prompts: np.ndarray, lengths: np.ndarray, steps: int,
                  implementation: str | None, attention: str, iters: int,
                  golden: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
  """Prefill + greedy decode of one model; prints and returns its figures."""
  B, S = prompts.shape
  c = params.config
  print(f"\n{name}: {c.model_type}, {c.num_hidden_layers} layers "
        f"({sum(map(c.is_moe_layer, range(c.num_hidden_layers)))} MoE, "
        f"{c.n_routed_experts} experts computed densely), hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads, q_lora_rank {c.q_lora_rank}, latent "
        f"{c.kv_lora_rank} + {c.qk_rope_head_dim}, weights {jnp.dtype(params.dtype).name}; cache "
        f"{cache_cfg.quant_method or jnp.dtype(cache_cfg.dtype).name}, page {cache_cfg.page_size}, "
        f"attention {attention}")
  print(f"  batch {B}, prompts of {int(lengths.min())}..{int(lengths.max())} tokens, "
        f"{steps} decode steps", flush=True)
  cache = mc.init_cache(cache_cfg)
  page_table = jnp.asarray(mla_demo.make_page_table(B, S + steps, cache_cfg))
  prompts_j, lengths_j = jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)
  t0 = time.perf_counter()
  prefill = ds_model.prefill.lower(params, cache, prompts_j, lengths_j, page_table,
                                   implementation).compile()
  decode = ds_model.decode_step.lower(params, cache, lengths_j, lengths_j, page_table,
                                      implementation, attention).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  logits, cache = prefill(params, cache, prompts_j, lengths_j, page_table)
  logits.block_until_ready()
  prefill_s = time.perf_counter() - t0
  greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))
  greedy(logits).block_until_ready()  # compiled before the clock starts
  generated = []
  t0 = time.perf_counter()
  for i in range(steps):
    tokens = greedy(logits)
    logits, cache = decode(params, cache, tokens, lengths_j + i, page_table)
    generated.append(tokens)
  logits.block_until_ready()
  decode_s = time.perf_counter() - t0
  generated = np.asarray(jnp.stack(generated, 1))
  breakdown, cache = decode_step_breakdown(params, cache, tokens, lengths_j + steps - 1,
                                           page_table, implementation, attention, iters)
  share = (breakdown["write_us"] + breakdown["attention_us"]) / breakdown["step_us"]
  result = dict(
      prefill_tokens_per_s=int(lengths.sum()) / prefill_s, decode_tokens_per_s=B * steps / decode_s,
      decode_ms_per_step=decode_s / steps * 1e3, compile_s=compile_s, cache_share=share,
      generated=generated, **breakdown)
  unit = ("device time" if breakdown["method"] == "profiler"
          else "wall clock, dispatch included: on CPU the parts can exceed the whole")
  print(f"  compile {compile_s:.1f} s; prefill {_rate(result['prefill_tokens_per_s'])} tokens/s "
        f"({prefill_s * 1e3:.1f} ms); decode {_rate(result['decode_tokens_per_s'])} tokens/s "
        f"({result['decode_ms_per_step']:.2f} ms/step, greedy loop)")
  print(f"  decode step {breakdown['step_us']:,.1f} us ({unit}); its cache ops alone: writes "
        f"{breakdown['write_us']:,.1f} us + attention over the cache "
        f"{breakdown['attention_us']:,.1f} us"
        f" = {share:.1%} of the step")
  if golden is not None:
    same = generated == golden["decode_tokens"][:, :steps]
    result["golden_agreement"] = float(same.mean())
    print(f"  greedy tokens equal to transformers' (free-running): {int(same.sum())}/{same.size} "
          f"steps, {int(same.all(1).sum())}/{B} sequences entirely")
  return result


def deepseek_main(argv: list[str] | None = None) -> dict[str, Any]:
  """The DeepSeek-V3 section of the demo (options: `--deepseek*`); returns its figures."""
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  args = _parse_deepseek(list(argv or []), on_gpu)
  results: dict[str, Any] = {}
  if not args.deepseek:
    return results
  implementation = None
  quant = dict(dtype=jnp.float8_e4m3fn, quant_method="per_token_head") \
      if args.deepseek_quant == "per_token_head" else dict(dtype=jnp.bfloat16)
  path = args.deepseek_checkpoint
  if os.path.isfile(os.path.join(path, "config.json")):
    golden_file = os.path.join(path, "golden.npz")
    golden = dict(np.load(golden_file)) if os.path.isfile(golden_file) else None
    if golden is not None:
      prompts, lengths = golden["prompts"], golden["lengths"]
      steps = args.deepseek_steps or golden["decode_tokens"].shape[1]
    else:
      prompts = np.random.default_rng(0).integers(0, 100, (4, 16)).astype(np.int32)
      lengths, steps = np.array([16, 5, 9, 12], np.int32), args.deepseek_steps or 32
    params = ds_model.load_checkpoint(path, max_position=prompts.shape[1] + steps)
    size = len(lengths) * -(-(prompts.shape[1] + steps) // 64) * 64
    cache_cfg = ds_model.cache_config(params.config, size=size, page_size=64, **quant)
    results["checkpoint"] = _deepseek_run(
        f"DeepSeek checkpoint {path}", params, cache_cfg, prompts, lengths, steps,
        implementation, args.deepseek_attention, args.deepseek_iters, golden)
  else:
    print(f"\nDeepSeek checkpoint: no config.json in {path} (skipped)")
  if args.deepseek_shaped:
    config = ds_model.deepseek_v3_shaped(num_hidden_layers=args.deepseek_layers)
    B, S = args.deepseek_batch, args.deepseek_prompt_len
    steps = args.deepseek_steps or 32
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (B, S)).astype(np.int32)
    lengths = rng.integers(S // 2, S + 1, B).astype(np.int32)
    params = ds_model.random_params(config, dtype=jnp.bfloat16, max_position=S + steps)
    size = B * -(-(S + steps) // 64) * 64
    cache_cfg = ds_model.cache_config(config, size=size, page_size=64, **quant)
    results["shaped"] = _deepseek_run(
        "DeepSeek-V3-shaped, random weights", params, cache_cfg, prompts, lengths, steps,
        implementation, args.deepseek_attention, args.deepseek_iters)
  return results
