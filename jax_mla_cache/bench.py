"""Kernel benchmark: device time per call and GB/s, Pallas vs XLA in one process.

    python -m jax_mla_cache bench [--out benchmarks/results/h200.json] [--small]

Method (see shared ANCHORS.md): on a GPU each op is called `iters` times in a
Python loop (every call a jitted, cache-donating launch) inside
`jax.profiler.trace`, and the device time per call is the sum of the durations
of all GPU kernel and memcpy events the calls issued, divided by `iters`
(CUPTI timestamps, as tokamax's benchmark utilities do). This excludes host
dispatch and loop overhead, which hide small-T kernels. Where no GPU events are
recorded (CPU) the figure is wall-clock per call after `block_until_ready`.
Host offload is timed by wall clock (what a caller waits for), against plain
device<->pinned-host copies of the same bytes in the same run.

GB/s counts bytes read plus written: rows x row bytes x 2 for set/get/move
(plus the layers for moves); one direction for host copies. The fused RoPE write
(`rope_set`, `rope_set_pth`: impl "pallas" is the one fused kernel, "unfused" is XLA RoPE +
our set kernel + a concatenate, "xla" the all-XLA composition) counts q in + q out +
latent in + row out: T x (2 x H x (R+Rr) x 2 + (R+Rr) x 2 + row bytes), bf16 activations.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import offload, rope, rope_write

SET_TOKENS = (1, 64, 512, 4096, 32768)
MOVE_TOKENS = (8, 64, 256, 1024, 4096)
PAGE_COUNTS = (1, 16, 256)
OFFLOAD_TOKENS = 4096
ROPE_TOKENS = (1, 8, 64, 512, 4096)
ROPE_HEADS = (16, 128)
ROPE_MAX_POSITION = 163840  # DeepSeek-V3's max_position_embeddings


ERRORS: list[str] = []
"""Failures of single measurements in this run (reported, and written to the results)."""


@dataclasses.dataclass
class Record:
  op: str
  impl: str
  T: int
  layers: int
  us: float
  gbps: float
  B: int | None = None      # batch (mla_decode)
  s_q: int | None = None    # queries per sequence (mla_decode)
  H: int | None = None      # query heads (mla_decode, the fused RoPE write)
  tflops: float | None = None
  compile_s: float | None = None  # first call: trace + compile + one run (seconds)


_FIRST_CALL_S: list[float] = []
"""Seconds of the latest `time_per_call`'s first call (picked up by `report`)."""


def gpu_events(trace_dir: str, counts: bool = False):
  """Total duration (ns) per GPU event name (kernels, memcpys) in a profiler trace, or None
  without one; with `counts`, (those totals, the number of events per name)."""
  from jax.profiler import ProfileData

  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    return None
  totals: dict[str, int] = {}
  number: dict[str, int] = {}
  for plane in ProfileData.from_file(files[-1]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      # Stream lines hold one event per kernel / memcpy; the "XLA Ops"/"XLA Modules"
      # lines repeat the same time grouped differently and would double count.
      if not line.name.startswith("Stream"):
        continue
      for event in line.events:
        totals[event.name] = totals.get(event.name, 0) + int(event.duration_ns)
        number[event.name] = number.get(event.name, 0) + 1
  if not totals:
    return None
  return (totals, number) if counts else totals


def time_per_call(step: Callable[[Any], Any], state: Any, iters: int,
                  breakdown: dict[str, float] | None = None) -> tuple[float, Any, str]:
  """Device microseconds per `state = step(state)`; returns (us, state, method).

  With `breakdown` (a dict), it is filled with microseconds per call per GPU event name.
  """
  t0 = time.perf_counter()
  state = jax.block_until_ready(step(state))
  _FIRST_CALL_S[:] = [time.perf_counter() - t0]
  for _ in range(2):
    state = step(state)
  jax.block_until_ready(state)
  if jax.devices()[0].platform == "gpu":
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        for _ in range(iters):
          state = step(state)
        jax.block_until_ready(state)
      events = gpu_events(d)
    if events is not None:
      if breakdown is not None:
        breakdown.update({name: ns / iters / 1e3 for name, ns in events.items()})
      return sum(events.values()) / iters / 1e3, state, "profiler"
  t0 = time.perf_counter()
  for _ in range(iters):
    state = step(state)
  jax.block_until_ready(state)
  return (time.perf_counter() - t0) / iters * 1e6, state, "wallclock"


def _wall_us(fn: Callable[[], Any], iters: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e6


def copy_bandwidth_gbps(nbytes: int) -> float:
  """Device copy bandwidth (read + write) of an XLA elementwise op over `nbytes`."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda v: v + jnp.bfloat16(1), donate_argnums=0)
  us, _, _ = time_per_call(f, x, 10)
  return 2 * nbytes / us / 1e3


def _rows(rng, tokens, width):
  return jnp.asarray(rng.standard_normal((tokens, 1, width)).astype(np.float32)).astype(jnp.bfloat16)


def bench_rows(cfg: mc.MLACacheConfig, tokens_list, impls, iters, report) -> None:
  """set_mla / set_mla_pth / get_mla on one layer of `cfg.rows` rows."""
  rng = np.random.default_rng(0)
  quant_cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  for tokens in tokens_list:
    loc = jnp.asarray(rng.permutation(cfg.rows)[:tokens].astype(np.int32))
    nope, rope = _rows(rng, tokens, cfg.kv_lora_rank), _rows(rng, tokens, cfg.qk_rope_head_dim)
    in_bytes = tokens * cfg.kv_cache_dim * 2
    for impl in impls:
      for op, c in (("set_mla", cfg), ("set_mla_pth", quant_cfg)):
        try:
          _bench_row_op(op, c, impl, tokens, loc, nope, rope, in_bytes, iters, report)
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
          ERRORS.append(f"{op} {impl} T={tokens}: {type(e).__name__}: {str(e)[:300]}")
          print(f"  !! {ERRORS[-1]}", flush=True)


def _bench_row_op(op, c, impl, tokens, loc, nope, rope, in_bytes, iters, report) -> None:
  """One set (and, for set_mla, get) measurement on a fresh one-layer cache."""
  # Inputs are arguments, never closure constants: XLA would constant-fold them.
  f = jax.jit(lambda s, l, n, r, impl=impl: mc.set_mla_kv_buffer(s, 0, l, n, r,
                                                               implementation=impl),
              donate_argnums=0)
  us, (cache, *_), method = time_per_call(lambda st: (f(*st), *st[1:]),
                                          (mc.init_cache(c), loc, nope, rope), iters,
                                          bd := {})
  report(Record(op, impl, tokens, 1, us, (in_bytes + tokens * c.row_bytes) / us / 1e3), method, bd)
  if op == "set_mla":
    g = jax.jit(lambda s, l, impl=impl: mc.get_mla_kv_buffer(s, 0, l, implementation=impl))
    # state = (cache, loc, last output); only the gathered rows are produced per call
    us, _, method = time_per_call(lambda st: (st[0], st[1], g(st[0], st[1])),
                                  (cache, loc, None), iters, bd := {})
    report(Record("get_mla", impl, tokens, 1, us, 2 * tokens * c.row_bytes / us / 1e3), method, bd)


def bench_rope_set(cfg: mc.MLACacheConfig, tokens_list, heads_list, impls, iters, report,
                   max_position: int = ROPE_MAX_POSITION) -> None:
  """rope_set / rope_set_pth on one layer: impl "pallas" gives two records, the fused
  kernel ("pallas") and the unfused composition with the Pallas set kernel ("unfused");
  impl "xla" gives the all-XLA composition ("xla")."""
  rng = np.random.default_rng(3)
  quant_cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  table = jnp.asarray(rope.rope_cos_sin_cache(max_position, cfg.qk_rope_head_dim))
  R, Rr, W = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_cache_dim
  variants = {"pallas": (("pallas", rope_write.rope_set_mla_kv_buffer, "pallas"),
                         ("unfused", rope_write.unfused_rope_set_mla_kv_buffer, "pallas")),
              "xla": (("xla", rope_write.unfused_rope_set_mla_kv_buffer, "xla"),)}
  for heads in heads_list:
    for tokens in tokens_list:
      loc = jnp.asarray(rng.permutation(cfg.rows)[:tokens].astype(np.int32))
      pos = jnp.asarray(rng.integers(0, max_position, tokens).astype(np.int32))
      acts = tuple(jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16)
                   for shape in ((tokens, heads, R), (tokens, heads, Rr), (tokens, 1, R),
                                 (tokens, 1, Rr)))
      for op, c in (("rope_set", cfg), ("rope_set_pth", quant_cfg)):
        nbytes = tokens * (2 * heads * W * 2 + W * 2 + c.row_bytes)
        for name, fn, set_impl in (v for impl in impls for v in variants.get(impl, ())):
          try:
            f = jax.jit(lambda s, *a, fn=fn, set_impl=set_impl: fn(s, 0, *a,
                                                                   implementation=set_impl),
                        donate_argnums=0)
            # state = (cache, last q_out, inputs...): inputs are arguments, never constants
            us, _, method = time_per_call(lambda st: (*f(st[0], *st[2:]), *st[2:]),
                                          (mc.init_cache(c), None, loc, pos, *acts, table),
                                          iters, bd := {})
            report(Record(op, name, tokens, 1, us, nbytes / us / 1e3, H=heads), method, bd)
          except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            ERRORS.append(f"{op} {name} H={heads} T={tokens}: {type(e).__name__}: {str(e)[:300]}")
            print(f"  !! {ERRORS[-1]}", flush=True)


def bench_moves(cfg: mc.MLACacheConfig, tokens_list, pages_list, impls, iters, report) -> None:
  """move / move_pth over every layer (one call), whole-page moves, and move_stacked: the
  plain token moves on a `StackedMLAKVCache` (one buffer of layer_num x rows rows, so one
  kernel moves layer_num x T pairs)."""
  rng = np.random.default_rng(1)
  quant_cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  for op, c in (("move", cfg), ("move_pth", quant_cfg), ("move_stacked", cfg)):
    cache = mc.init_cache(c, stacked=op == "move_stacked")
    for tokens in tokens_list:
      perm = rng.permutation(c.rows)[: 2 * tokens].astype(np.int32)
      tgt, src = jnp.asarray(perm[:tokens]), jnp.asarray(perm[tokens:])
      for impl in impls:
        f = jax.jit(lambda s, t, r, impl=impl: mc.move_kv_cache(s, t, r, implementation=impl),
                    donate_argnums=0)
        us, (cache, *_), method = time_per_call(lambda st: (f(*st), *st[1:]),
                                                (cache, tgt, src), iters, bd := {})
        report(Record(op, impl, tokens, c.layer_num, us,
                      2 * tokens * c.row_bytes * c.layer_num / us / 1e3), method, bd)
    if op == "move":
      npages = c.rows // c.page_size
      for pages in pages_list:
        perm = rng.permutation(npages)[: 2 * pages].astype(np.int32)
        tgt, src = jnp.asarray(perm[:pages]), jnp.asarray(perm[pages:])
        for impl in impls:
          f = jax.jit(lambda s, t, r, impl=impl: mc.move_kv_pages(s, t, r, implementation=impl),
                      donate_argnums=0)
          us, (cache, *_), method = time_per_call(lambda st: (f(*st), *st[1:]),
                                                  (cache, tgt, src), iters, bd := {})
          nbytes = 2 * pages * c.page_size * c.row_bytes * c.layer_num
          report(Record("move_pages", impl, pages, c.layer_num, us, nbytes / us / 1e3), method, bd)
    del cache


DECODE_SHAPES = (
    # (B, s_q, H, context): memory-bound (DeepSeek-V3's 128 heads over 8-way TP) ...
    (64, 1, 16, 4096), (128, 1, 16, 4096), (64, 1, 16, 16384), (128, 1, 16, 16384),
    (64, 2, 16, 4096),      # speculative decoding at H=16 (32 query rows)
    # ... and compute-bound (all 128 heads, speculative s_q = 2)
    (128, 1, 128, 4096), (128, 2, 128, 4096),
)
SMALL_DECODE_SHAPES = ((2, 1, 16, 256), (2, 2, 16, 128))


def decode_cache(cfg: mc.MLACacheConfig, seed: int = 0) -> mc.MLAKVCache:
  """A one-layer cache of `cfg` filled with random rows (never zeros: they time faster)."""
  key = jax.random.key(seed)
  k1, k2, k3 = jax.random.split(key, 3)

  @jax.jit
  def fill():
    shapes = cfg.buffer_shapes()
    if not cfg.quantized:
      (shape, dtype), = shapes
      return (jax.random.normal(k1, shape, jnp.float32).astype(dtype),)
    (ns, nd), (ss, sd), (rs, rd) = shapes
    nope = jnp.clip(jax.random.normal(k1, ns, jnp.float32) * 100, -448, 448).astype(nd)
    scale = jax.random.uniform(k2, ss, jnp.float32, 0.001, 0.01).astype(sd)
    rope = (jax.random.normal(k3, rs, jnp.float32) * 100).astype(rd)
    return nope, scale, rope

  return mc.MLAKVCache(buffers=(fill(),), config=cfg)


def decode_problem(rng: np.random.Generator, cfg: mc.MLACacheConfig, B: int, s_q: int, H: int,
                   ctx: int):
  """(page_table (B, pages) int32, seq_lens (B,) int32, q (B, s_q, H, W) bf16) of a decode
  call where every sequence has `ctx` tokens on distinct pages, shuffled (page 0 unused)."""
  pages = -(-ctx // cfg.page_size)
  table = jnp.asarray((rng.permutation(B * pages) + 1).reshape(B, pages).astype(np.int32))
  lens = jnp.full((B,), ctx, jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, s_q, H, cfg.kv_cache_dim)).astype(np.float32) * 0.1,
                  jnp.bfloat16)
  return table, lens, q


def gather_attention(cache: mc.MLAKVCache, q, page_table, seq_lens, *, sm_scale: float,
                     implementation: str):
  """The read path without `mla_decode`: `get_mla_kv_buffer` of every context row, then
  absorbed attention in XLA (bf16 products, float32 softmax), as engines do today. The
  nope and rope parts stay separate (two score products): concatenating them first would
  copy the whole gathered context once more (and slicing the values out of it again)."""
  cfg = cache.config
  B, s_q, H, W = q.shape
  R = cfg.kv_lora_rank
  L = page_table.shape[1] * cfg.page_size
  rows, valid = mc.attention.positions_rows(page_table, cfg.page_size, cfg.rows)
  nope, rope = mc.get_mla_kv_buffer(cache, 0, rows.reshape(-1), q.dtype,
                                    implementation=implementation)
  nope, rope = nope.reshape(B, L, R), rope.reshape(B, L, W - R)
  s = (jnp.einsum("bjhd,bld->bjhl", q[..., :R], nope, preferred_element_type=jnp.float32)
       + jnp.einsum("bjhd,bld->bjhl", q[..., R:], rope, preferred_element_type=jnp.float32))
  s = s * sm_scale
  pos = jnp.arange(L)
  limit = seq_lens[:, None] - s_q + jnp.arange(s_q)[None]
  s = jnp.where((pos[None, None] <= limit[..., None])[:, :, None] & valid[:, None, None], s,
                -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bjhl,blr->bjhr", p.astype(q.dtype), nope,
                    preferred_element_type=jnp.float32).astype(q.dtype)


def bench_decode(cfg: mc.MLACacheConfig, shapes, impls, iters, report) -> None:
  """mla_decode (bf16 cache) / mla_decode_pth (per_token_head) per shape and implementation:
  "pallas" (the kernel), "xla" (`mla_decode`'s XLA reference), "gather" (get_mla_kv_buffer
  + XLA attention). gbps counts the cache bytes read once; tflops 2 x rows x (W + R)."""
  rng = np.random.default_rng(4)
  quant_cfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  for B, s_q, H, ctx in shapes:
    pages = -(-ctx // cfg.page_size)
    size = B * pages * cfg.page_size
    table, lens, q = decode_problem(rng, cfg, B, s_q, H, ctx)
    W, R = cfg.kv_cache_dim, cfg.kv_lora_rank
    flops = 2 * B * s_q * H * ctx * (W + R)
    for op, c in (("mla_decode", cfg), ("mla_decode_pth", quant_cfg)):
      c = c.replace(size=size, layer_num=1)
      cache = decode_cache(c)
      nbytes = B * ctx * c.row_bytes
      sm = float(W) ** -0.5
      for impl in impls:
        try:
          if impl == "gather":
            f = jax.jit(lambda cache, q, t, n: gather_attention(
                cache, q, t, n, sm_scale=sm, implementation="pallas"))
          elif impl.startswith("pallas:"):   # one kernel path, forced ("pallas:narrow")
            from pallas_kernels import mla_decode as kernel
            config = kernel.DecodeConfig(path=impl.split(":", 1)[1])
            geo = kernel.Geometry(B=B, s_q=s_q, H=H, R=R, Rr=W - R, P=pages,
                                  page_size=c.page_size, rows=c.rows, quantized=c.quantized,
                                  dtype=jnp.dtype(q.dtype))
            if kernel._path(config.path).takes(geo, config) is not None:
              continue
            f = jax.jit(lambda cache, q, t, n, config=config: kernel.mla_decode(
                cache.layer(0), q, t, n, sm_scale=sm, page_size=c.page_size,
                kv_lora_rank=R, config=config))
          else:
            f = jax.jit(lambda cache, q, t, n, impl=impl: mc.mla_decode(
                cache, 0, q, t, n, sm_scale=sm, implementation=impl))
          us, _, method = time_per_call(lambda st: (st[0], st[1], st[2], st[3], f(*st[:4])),
                                        (cache, q, table, lens, None), iters, bd := {})
          report(Record(op, impl, ctx, 1, us, nbytes / us / 1e3, B=B, s_q=s_q, H=H,
                        tflops=flops / us / 1e6), method, bd)
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
          ERRORS.append(f"{op} {impl} B={B} s_q={s_q} H={H} T={ctx}: {type(e).__name__}: "
                        f"{str(e)[:300]}")
          print(f"  !! {ERRORS[-1]}", flush=True)
      del cache


def bench_offload(cfg: mc.MLACacheConfig, tokens: int, iters: int, report) -> dict:
  """get_cpu_copy / load_cpu_copy of `tokens` rows x every layer vs plain pinned copies."""
  kind = offload.host_memory_kind()
  cache = mc.init_cache(cfg)
  idx = jnp.asarray(np.random.default_rng(2).permutation(cfg.rows)[:tokens].astype(np.int32))
  nbytes = tokens * cfg.row_bytes * cfg.layer_num
  result = {"pinned_d2h_gbps": None, "pinned_h2d_gbps": None, "memory_kind": kind}
  if kind is not None:
    dev = jax.devices()[0]
    host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
    dev_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    blob = jnp.ones((nbytes // 2,), jnp.bfloat16)
    host_blob = jax.device_put(blob, host_s)
    result["pinned_d2h_gbps"] = nbytes / _wall_us(lambda: jax.device_put(blob, host_s), iters) / 1e3
    result["pinned_h2d_gbps"] = nbytes / _wall_us(lambda: jax.device_put(host_blob, dev_s), iters) / 1e3
    del blob, host_blob
  us = _wall_us(lambda: mc.get_cpu_copy(cache, idx), iters)
  report(Record("offload_d2h", "xla_fresh_buffers", tokens, cfg.layer_num, us, nbytes / us / 1e3), "wallclock")
  # The steady state of an engine: each copy recycles the previous copy's host buffers.
  state = {"host": mc.get_cpu_copy(cache, idx)}

  def copy_out():
    state["host"] = mc.get_cpu_copy(cache, idx, reuse=state["host"])
    return state["host"]

  us = _wall_us(copy_out, iters)
  report(Record("offload_d2h", "xla", tokens, cfg.layer_num, us, nbytes / us / 1e3), "wallclock")
  host = state["host"].block_until_ready()
  state = {"cache": cache}

  def load():
    state["cache"] = mc.load_cpu_copy(state["cache"], host, idx)
    return state["cache"]

  us = _wall_us(load, iters)
  report(Record("offload_h2d", "xla", tokens, cfg.layer_num, us, nbytes / us / 1e3), "wallclock")
  return result


def source_hash() -> str:
  """sha256 (12 hex) of the package and kernel sources: identifies the code that ran even
  where the checkout's git metadata is older than its files (a copied working tree)."""
  import hashlib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for pkg in ("jax_mla_cache", "pallas_kernels"):
    for dirpath, _, files in sorted(os.walk(os.path.join(root, pkg))):
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
          digest.update(f.read())
  return digest.hexdigest()[:12]


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(__file__)).stdout.strip()
  except Exception:
    return os.environ.get("GIT_COMMIT", "unknown")


OPS = ("rows", "moves", "offload", "decode", "rope")
IMPLS = ("pallas", "xla")
DECODE_IMPLS = ("pallas", "pallas:registers", "pallas:narrow", "pallas:wide", "xla", "gather")


def _positive_int(text: str) -> int:
  """argparse type: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _int_list(text: str, *, empty: bool = False) -> tuple[int, ...]:
  """argparse type: a comma list of ints >= 1 (`empty`: '' is no value)."""
  items = [t for t in text.split(",") if t.strip()] if empty else text.split(",")
  return tuple(_positive_int(t.strip()) for t in items)


def _choice_list(allowed: tuple[str, ...]):
  """argparse type: a comma list of values from `allowed` (a typo is an error, not an
  empty benchmark that writes an empty results file)."""
  def parse(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(","))
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
      raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose "
                                       f"from {', '.join(allowed)}")
    return values
  return parse


def _decode_shapes(text: str) -> tuple[tuple[int, int, int, int], ...]:
  """argparse type: a semicolon list of B,s_q,H,context."""
  shapes = []
  for item in text.split(";"):
    shape = _int_list(item)
    if len(shape) != 4:
      raise argparse.ArgumentTypeError(f"a decode shape is B,s_q,H,context, got {item!r}")
    shapes.append(shape)
  return tuple(shapes)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m jax_mla_cache bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<device>.json)")
  parser.add_argument("--small", action="store_true", help="CPU-sized shapes (default off a GPU)")
  parser.add_argument("--ops", type=_choice_list(OPS), default=OPS,
                      help="comma list: rows,moves,offload,decode,rope")
  parser.add_argument("--decode-impls", type=_choice_list(DECODE_IMPLS), default=None,
                      help="comma list for mla_decode: pallas, pallas:<path> (one kernel path), xla, "
                           "gather (default pallas,pallas:narrow,pallas:wide,gather on a GPU; xla off it)")
  parser.add_argument("--decode-shapes", type=_decode_shapes, default=None,
                      help="semicolon list of B,s_q,H,context overriding the decode shapes")
  parser.add_argument("--impls", type=_choice_list(IMPLS), default=None,
                      help="comma list (default pallas,xla on a GPU; xla elsewhere: interpret-mode "
                           "timings mean nothing)")
  parser.add_argument("--iters", type=_positive_int, default=None)
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument("--breakdown", action="store_true", help="print device time per kernel")
  parser.add_argument("--tokens", type=_int_list, default=None, help="comma list overriding T for set/get")
  parser.add_argument("--move-tokens", type=_int_list, default=None, help="comma list overriding T for moves")
  parser.add_argument("--rope-tokens", type=_int_list, default=None, help="comma list overriding T for rope_set")
  parser.add_argument("--heads", type=_int_list, default=None, help="comma list overriding H for rope_set")
  parser.add_argument("--pages", type=lambda t: _int_list(t, empty=True), default=None,
                      help="comma list overriding the page counts of move_pages ('' for none)")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  small = args.small or not on_gpu
  impls = args.impls or (("pallas", "xla") if on_gpu else ("xla",))
  ops = set(args.ops)
  iters = args.iters or (20 if on_gpu else 2)
  if small:
    cfg = mc.SMALL.replace(size=4096 - 16, layer_num=4)
    set_tokens, move_tokens, page_counts, off_tokens = (1, 64, 512), (8, 64), (1, 16), 256
    rope_tokens, rope_heads, rope_positions = (1, 64), (16,), 4096
  else:
    cfg = mc.DEEPSEEK_V3
    set_tokens, move_tokens, page_counts, off_tokens = SET_TOKENS, MOVE_TOKENS, PAGE_COUNTS, OFFLOAD_TOKENS
    rope_tokens, rope_heads, rope_positions = ROPE_TOKENS, ROPE_HEADS, ROPE_MAX_POSITION
  if args.tokens:
    set_tokens = args.tokens
  if args.move_tokens:
    move_tokens = args.move_tokens
  if args.rope_tokens:
    rope_tokens = args.rope_tokens
  if args.heads:
    rope_heads = args.heads
  if args.pages is not None:
    page_counts = args.pages
  records: list[Record] = []
  methods: set[str] = set()

  def report(rec: Record, method: str, breakdown: dict[str, float] | None = None) -> None:
    if rec.compile_s is None and _FIRST_CALL_S:
      rec.compile_s = round(_FIRST_CALL_S.pop(), 3)
    records.append(rec)
    methods.add(method)
    heads = f" H={rec.H:<3d}" if rec.H is not None and rec.B is None else ""
    shape = (f" B={rec.B} s_q={rec.s_q} H={rec.H} {rec.tflops:6.1f} TFLOPS"
             if rec.B is not None and rec.tflops is not None else "")
    print(f"  {rec.op:12s} {rec.impl:7s} T={rec.T:<6d} layers={rec.layers:<3d}{heads} "
          f"{rec.us:10.2f} us {rec.gbps:9.1f} GB/s{shape}  [{method}]"
          + (f" (first call {rec.compile_s:.1f} s)" if rec.compile_s is not None else ""),
          flush=True)
    if args.breakdown and breakdown:
      for name, us in sorted(breakdown.items(), key=lambda kv: -kv[1]):
        print(f"      {us:9.2f} us  {name[:100]}", flush=True)

  print(f"jax_mla_cache bench on {device.device_kind} (jax {jax.__version__}); "
        f"{'small' if small else 'DeepSeek-V3'} shapes, impls {impls}", flush=True)
  copy_gbps = copy_bandwidth_gbps(2**28 if small else 2**30)
  print(f"  device copy bandwidth: {copy_gbps:.1f} GB/s (read+write)", flush=True)
  row_cfg = cfg.replace(layer_num=1)
  errors = ERRORS

  def section(name, fn, *fn_args):
    """Run one group of measurements; a failure is reported and recorded, not fatal."""
    try:
      return fn(*fn_args)
    except Exception as e:  # noqa: BLE001 - keep the other groups' figures
      errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
      print(f"  !! {errors[-1]}", flush=True)
      return None

  if "rows" in ops:
    section("rows", bench_rows, row_cfg, set_tokens, impls, iters, report)
  if "decode" in ops:
    decode_impls = args.decode_impls or (
        ("pallas", "pallas:narrow", "pallas:wide", "gather") if on_gpu else ("xla",))
    shapes = SMALL_DECODE_SHAPES if small else DECODE_SHAPES
    if args.decode_shapes:
      shapes = args.decode_shapes
    section("decode", bench_decode, cfg.replace(layer_num=1), shapes, decode_impls, iters,
            report)
  if "moves" in ops:
    section("moves", bench_moves, cfg, move_tokens, page_counts, impls, iters, report)
  if "rope" in ops:
    section("rope", bench_rope_set, row_cfg, rope_tokens, rope_heads, impls, iters, report,
            rope_positions)
  pinned = {"pinned_d2h_gbps": None, "pinned_h2d_gbps": None}
  if "offload" in ops:
    pinned = section("offload", bench_offload, cfg, off_tokens, max(3, iters // 4), report) or pinned
    print(f"  pinned host copy: d2h {pinned['pinned_d2h_gbps']} GB/s, h2d {pinned['pinned_h2d_gbps']} GB/s")

  results = {
      "device": device.device_kind,
      "jax": jax.__version__,
      "commit": _commit(),
      "source_hash": source_hash(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "method": ("device time per call from jax.profiler trace (sum of GPU kernel/memcpy events / calls)"
                 if "profiler" in methods else "wall clock per call after block_until_ready")
                + "; offload by wall clock",
      "shapes": "small (CPU)" if small else "DeepSeek-V3: 2^18 rows x 576, 61 layers for moves/offload",
      "copy_gbps": copy_gbps,
      "pinned_copy_gbps": pinned.get("pinned_d2h_gbps"),
      "pinned_d2h_gbps": pinned.get("pinned_d2h_gbps"),
      "pinned_h2d_gbps": pinned.get("pinned_h2d_gbps"),
      "records": [dataclasses.asdict(r) for r in records],
      "errors": errors,
  }
  name = "h200" if "H200" in device.device_kind else device.platform
  out = args.out or os.path.join("benchmarks", "results", f"{name}.json")
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {out}")
  if not args.no_plot:
    try:
      from jax_mla_cache import plots
      png = os.path.splitext(out)[0] + ".png"
      plots.plot_results(results, png)
      print(f"wrote {png}")
    except ImportError as e:
      print(f"(no plot: {e})", file=sys.stderr)
  return results


if __name__ == "__main__":
  main()
