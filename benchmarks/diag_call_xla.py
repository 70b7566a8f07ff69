"""The XLA work around the registers decode path's kernel (device time per XLA kernel from a
profiler trace, as bench.py):

1. its epilogue (the splits' merge, the output's column order and its transpose) written
   several ways, each checked bit-equal to the shipped one and timed;
2. whether a jitted step that decodes several layers with one page table makes the
   kernels' page-table operand (`make_meta`) once or once a layer: the events of one step
   of `--layers` decode calls, by name and count;
3. whole per_token_head calls (`--calls`, B,context; 16 heads, s_q 1) with each epilogue
   in place of the shipped one: outputs compared, time per XLA kernel.

    python benchmarks/diag_call_xla.py [--shapes B,S[;B,S...]] [--iters 20] [--layers 4]

The kernel leaves out^T (B, S, R, N) in q's dtype per split, rows in the order
128 c + 2 r + s = tile (c, s), row r, and lse (B, S, N); the call returns (B, N, R) in
q's dtype with the columns in order.
"""

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import mla_decode_registers as registers
from pallas_kernels.mla_decode import combine, finish_lse_merge

R, N = 512, 16
DTYPE = jnp.bfloat16


def u32(x):
  return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)


def pack(even, odd):
  """Two (.., 64) 16-bit arrays -> (.., 128) with their columns interleaved (via 32 bits)."""
  pairs = u32(even) | (u32(odd) << 16)
  out = lax.bitcast_convert_type(pairs, DTYPE)          # (.., 64, 2)
  return out.reshape(*out.shape[:-2], 128)


_SHIPPED = registers.finish_rows


def shipped(out, lse):
  return _SHIPPED(out, lse, DTYPE)


def merge_f32(out, lse, rows_last=True):
  """(merged (B, R, N) float32, lse (B, N)): `combine`'s arithmetic, without the cast
  (out (B, S, N, R) and merged (B, N, R) without `rows_last`)."""
  per_row = (lambda x: x[:, None, :]) if rows_last else (lambda x: x[..., None])
  S = out.shape[1]
  if S == 1:
    return out[:, 0].astype(jnp.float32), lse[:, 0]
  parts = [lse[:, s] for s in range(S)]
  m = parts[0]
  for p in parts[1:]:
    m = jnp.maximum(m, p)
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  weights = [jnp.exp(p - m) for p in parts]
  den = weights[0]
  for w in weights[1:]:
    den = den + w
  num = per_row(weights[0]) * out[:, 0].astype(jnp.float32)
  for s in range(1, S):
    num = num + per_row(weights[s]) * out[:, s].astype(jnp.float32)
  return finish_lse_merge(m, den, num, per_row)


def pack_transposed(out, lse):
  """Merged and cast as shipped, each parity's tiles transposed (two 021 transposes of
  16-bit elements), then packed."""
  merged, lse = combine(out, lse, DTYPE, rows_last=True, transpose=False)
  B = merged.shape[0]
  tiles = merged.reshape(B, R // 128, 2, 64, N)
  even, odd = (tiles[:, :, s].transpose(0, 3, 1, 2) for s in range(2))   # (B, N, c, 64)
  return pack(even, odd).reshape(B, N, R), lse


def transposed_first(out, lse):
  """out^T transposed per split and parity before the merge (the merge then runs in the
  output's layout), packed at the end."""
  B, S = out.shape[:2]
  t = out.reshape(B, S, R // 128, 2, 64, N).transpose(0, 1, 3, 5, 2, 4)   # (B, S, 2, N, c, 64)
  merged, lse = merge_f32(t.reshape(B, S, 2 * N, R // 2),
                          jnp.concatenate([lse, lse], axis=2), rows_last=False)
  merged = merged.astype(DTYPE).reshape(B, 2, N, R // 128, 64)
  return pack(merged[:, 0], merged[:, 1]).reshape(B, N, R), lse[:, :N]


def generic(out, lse):
  """One generic transpose of the merged 16-bit array (no packing)."""
  merged, lse = combine(out, lse, DTYPE, rows_last=True, transpose=False)
  B = merged.shape[0]
  t = merged.reshape(B, R // 128, 2, 64, N).transpose(0, 4, 1, 3, 2)
  return t.reshape(B, N, R), lse


def f32_generic(out, lse):
  """The merge in float32, one generic transpose, then the cast."""
  merged, lse = merge_f32(out, lse)
  B = merged.shape[0]
  t = merged.reshape(B, R // 128, 2, 64, N).transpose(0, 4, 1, 3, 2)
  return t.reshape(B, N, R).astype(DTYPE), lse


VARIANTS = {"shipped": shipped, "pack_transposed": pack_transposed,
            "transposed_first": transposed_first, "generic": generic,
            "f32_generic": f32_generic}


def time_events(fn, args, iters, counts=False):
  """us per call per GPU event name (and the events' number per call with `counts`)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  if jax.devices()[0].platform != "gpu":
    return None
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(iters):
        res = fn(*args)
      jax.block_until_ready(res)
    totals, number = bench.gpu_events(d, counts=True)
  us = {k: v / iters / 1e3 for k, v in totals.items()}
  return (us, {k: n / iters for k, n in number.items()}) if counts else us


def layers_step(n_layers: int, iters: int, B: int = 64, ctx: int = 4096, H: int = 16):
  """Events of one jitted call decoding `n_layers` times with one page table."""
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1, dtype=jnp.float8_e4m3fn,
                               quant_method="per_token_head")
  if jax.devices()[0].platform != "gpu":
    cfg, B, ctx = cfg.replace(size=1024, page_size=64), 2, 128
  cache = bench.decode_cache(cfg)
  table, lens, q = bench.decode_problem(np.random.default_rng(0), cfg, B, 1, H, ctx)

  @jax.jit
  def step(cache, q, table, lens):
    outs = []
    for layer in range(n_layers):   # one layer's buffers, a different q each time
      out, _ = mc.mla_decode(cache, 0, q * (layer + 1), table, lens, sm_scale=0.1,
                             implementation="pallas")
      outs.append(out)
    return outs

  events = time_events(step, (cache, q, table, lens), iters, counts=True)
  if events is None:
    text = step.lower(cache, q, table, lens).compile().as_text()
    print(f"{n_layers} layers (cpu): make_meta's concatenate in the optimized HLO "
          f"{text.count('concatenate(')} times")
    return
  us, number = events
  print(f"{n_layers} layers, B={B} ctx={ctx}: {sum(us.values()):.2f} us a step")
  for name in sorted(us, key=lambda k: -us[k]):
    print(f"  {number[name]:4.1f} x  {us[name]:8.2f} us  {name}")


def whole_calls(shapes: str, iters: int, H: int = 16):
  cfg = mc.DEEPSEEK_V3.replace(layer_num=1, dtype=jnp.float8_e4m3fn,
                               quant_method="per_token_head")
  for shape in filter(None, shapes.split(";")):
    B, ctx = map(int, shape.split(","))
    if jax.devices()[0].platform != "gpu":
      cfg, B, ctx = cfg.replace(size=1024, page_size=64), B, ctx
    cache = bench.decode_cache(cfg)
    table, lens, q = bench.decode_problem(np.random.default_rng(0), cfg, B, 1, H, ctx)
    want = None
    for name, fn in VARIANTS.items():
      registers.finish_rows = (lambda f: lambda out, lse, dtype: f(out, lse))(fn)
      call = jax.jit(lambda c, q, t, l: mc.mla_decode(c, 0, q, t, l, sm_scale=0.1,
                                                      implementation="pallas"))
      got = call(cache, q, table, lens)
      want = got if want is None else want
      same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(got, want))
      events = time_events(call, (cache, q, table, lens), iters)
      total = f"{sum(events.values()):8.2f} us" if events else "   (cpu)"
      parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(events.items(), key=lambda kv: -kv[1])) \
          if events else ""
      print(f"call B={B:4d} ctx={ctx:6d}  {name:18s} {total}  bit-equal: {same}  {parts}",
            flush=True)
  registers.finish_rows = _SHIPPED


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", default="64,2;128,1;64,4")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--calls", default="64,4096;128,4096;64,16384")
  args = parser.parse_args()
  if args.calls:
    whole_calls(args.calls, args.iters)
  if args.layers:
    layers_step(args.layers, args.iters)
  rng = np.random.default_rng(0)
  for shape in filter(None, args.shapes.split(";")):
    B, S = map(int, shape.split(","))
    out = jnp.asarray(rng.standard_normal((B, S, R, N)), DTYPE)
    lse = rng.standard_normal((B, S, N)).astype(np.float32) * 3
    lse[0, :, 0] = -np.inf                         # a row no split saw
    lse[1, 0, :] = -np.inf                         # a split that saw nothing
    lse = jnp.asarray(lse)
    want = None
    for name, fn in VARIANTS.items():
      f = jax.jit(fn)
      got = f(out, lse)
      if want is None:
        want = got
      same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(got, want))
      events = time_events(f, (out, lse), args.iters)
      total = f"{sum(events.values()):8.2f} us" if events else "   (cpu)"
      parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(events.items(), key=lambda kv: -kv[1])) \
          if events else ""
      print(f"B={B:4d} S={S}  {name:18s} {total}  bit-equal: {same}  {parts}", flush=True)


if __name__ == "__main__":
  main()
