"""Sweep of the Pallas move kernels' variants on the DeepSeek-V3 cache (one GPU).

    cd repo && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/sweep_moves.py

Times each variant (paths of `pallas_kernels.move` and `MoveTiling` settings, plus the XLA
reference) with `jax_mla_cache.bench.time_per_call` (profiler device time per call: the sum
of every GPU kernel the call launched) for
  move      plain bf16, 61 layers, T in {8, 64, 256, 1024, 4096}, random distinct disjoint rows
  move_ovl  the same at T=256 and 4096 with overlapping sets (swaps + a shift chain: the
            streamed path's "endangered" mode)
  move_pth  per_token_head (fp8 nope, f32 scale, bf16 rope) 61 layers, the same T
  pages     move_pages, P in {1, 16, 256} pages of 64 rows
and checks every variant's result bitwise against `jax_mla_cache.reference.move_rows` on the
same inputs (the moved rows plus a sample of untouched rows; the reference runs on the
touched rows only, so the 18 GB cache is never copied). One cache per mode is allocated once
and donated through every call. Prints a table per case, then the per-kernel breakdown of
the best variant and of the default.

Compile cost: lowering one 61-buffer streamed or two-pass variant takes ~2-4 s of host time
(Mosaic's layout inference grows faster than linearly with the buffers' copies); the direct
path lowers in well under a second. `--budget` (seconds, default 125) lets an alternative
variant start only while ~5 s of budget remain; `default` and `xla` always run. To cover
everything, split the sweep: `--cases move` then `--cases ovl,pages,pth`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc
from jax_mla_cache import bench, reference
from pallas_kernels import move as pm

T = pm.MoveTiling
DEFAULT = T()
# name -> tiling (None: XLA reference). Ordered: the default first.
TOKEN_VARIANTS = {
    "default": DEFAULT,
    "stream": T(path="stream"),  # with one-element rows (per_token_head): two-pass
    "direct_p512": T(path="direct", direct_programs=512),
    "direct_p2048": T(path="direct", direct_programs=2048),
    "direct_p8192": T(path="direct", direct_programs=8192),
    "direct_i8": T(path="direct", direct_items_per_thread=8),
    "direct_i32": T(path="direct", direct_items_per_thread=32, direct_max_tokens=8192),
    "rounds": T(path="direct", direct_rounds=True),  # rounds when T exceeds registers
    "two_pass": T(path="two_pass"),
    # two-pass with every buffer in one launch per pass (the default splits 61 layers into
    # launches of at most 8 buffers per row layout, for lowering time)
    "two_pass_1launch": T(path="two_pass", two_pass_max_buffers=1 << 10),
    "two_pass_b32": T(path="two_pass", two_pass_max_buffers=32),
    "xla": None,
}
SMALL_T_VARIANTS = ("default", "stream", "direct_p512", "direct_p2048", "direct_p8192", "xla")
LARGE_T_VARIANTS = ("default", "rounds", "stream", "direct_p2048", "direct_i8", "two_pass",
                    "two_pass_1launch", "two_pass_b32", "xla")
PTH_VARIANTS = ("default", "rounds", "two_pass", "direct_p2048", "xla")
OVL_VARIANTS = ("default", "rounds", "stream", "xla")
PAGE_VARIANTS = {
    "default": DEFAULT,  # up to 16 pages of 64 rows: the direct (token) path
    "stream": T(path="stream"),
    "stream_item4k": T(path="stream", stream_item_bytes=4096),
    "stream_item8k": T(path="stream", stream_item_bytes=8192, stream_ring_bytes=72 * 1024),
    "two_pass": T(path="two_pass"),
    "xla": None,
}


@dataclasses.dataclass
class Row:
  case: str
  variant: str
  us: float
  gbps: float
  ok: str
  breakdown: dict


def _pairs(rng, units, count, overlap):
  if not overlap:
    perm = rng.permutation(units)[: 2 * count].astype(np.int32)
    return perm[:count], perm[count:]
  # Overlapping: half swaps, a quarter a shift-by-one chain, the rest disjoint.
  perm = rng.permutation(units).astype(np.int32)
  tgt, src = [], []
  swaps = count // 4
  a, b = perm[:swaps], perm[swaps:2 * swaps]
  tgt += list(a) + list(b)
  src += list(b) + list(a)
  chain = count // 4
  base = int(perm[2 * swaps])
  base = min(base, units - chain - 2)
  tgt += list(range(base + 1, base + 1 + chain))
  src += list(range(base, base + chain))
  used = set(tgt) | set(src)
  rest = [int(x) for x in perm[2 * swaps:] if int(x) not in used][: 2 * (count - len(tgt))]
  k = count - len(tgt)
  tgt += rest[:k]
  src += rest[k:2 * k]
  return np.asarray(tgt, np.int32), np.asarray(src, np.int32)


def _touched_rows(tgt, src, unit, rows, rng):
  """Rows to check: every row of every moved unit, plus 256 random rows."""
  units = np.unique(np.concatenate([tgt, src]))
  idx = (units[:, None] * unit + np.arange(unit)).reshape(-1)
  sample = rng.integers(0, rows, 256)
  return np.unique(np.concatenate([idx, sample])).astype(np.int32)


def _expected(compact, check, tgt, src, unit):
  """Reference result on the checked rows only: `compact[k]` holds row `check[k]`."""
  pos = {int(r): i for i, r in enumerate(check)}
  # Row-level pairs (pages expanded); every moved row is in `check`.
  t = (tgt[:, None] * unit + np.arange(unit)).reshape(-1)
  s = (src[:, None] * unit + np.arange(unit)).reshape(-1)
  ct = np.asarray([pos[int(x)] for x in t], np.int32)
  cs = np.asarray([pos[int(x)] for x in s], np.int32)
  return reference.move_rows(compact, jnp.asarray(ct), jnp.asarray(cs))


def _bits(x):
  x = jnp.asarray(x)
  return np.asarray(x.view(jnp.uint8) if x.dtype.itemsize == 1 else
                    x.view(jnp.uint16) if x.dtype.itemsize == 2 else x.view(jnp.uint32))


def run_case(cache, case, variants, tgt, src, unit, iters, nbytes, rows_rng, budget_end,
             results):
  """Times every variant on `cache` (donated through); returns the cache."""
  tgt_d, src_d = jnp.asarray(tgt), jnp.asarray(src)
  rows = cache.flat_buffers()[0].shape[0]
  check = _touched_rows(tgt, src, unit, rows, rows_rng)
  check_d = jnp.asarray(check)
  for name, tiling in variants.items():
    # A 61-buffer Pallas variant takes up to ~4 s to lower (Mosaic layout inference), so an
    # alternative starts only while that much budget is left; default and xla always run.
    if time.perf_counter() + 5 > budget_end and name not in ("default", "xla"):
      print(f"  {case:18s} {name:16s} skipped (time budget)", flush=True)
      continue
    if tiling is None:
      fn = (lambda b, t, s: reference.move_rows(b, t, s)) if unit == 1 else (
          lambda b, t, s: reference.move_pages(b, t, s, page_size=unit))
    elif unit == 1:
      fn = lambda b, t, s, tiling=tiling: pm.move_rows(b, t, s, tiling=tiling)
    else:
      fn = lambda b, t, s, tiling=tiling: pm.move_pages(b, t, s, page_size=unit, tiling=tiling)
    f = jax.jit(lambda c, t, s, fn=fn: c.with_flat_buffers(tuple(fn(c.flat_buffers(), t, s))),
                donate_argnums=0)
    try:
      # Correctness first, on the current state (one call), then timing.
      before = [b[check_d] for b in cache.flat_buffers()]
      want = _expected(before, check, tgt, src, unit)
      cache = f(cache, tgt_d, src_d)
      got = [b[check_d] for b in cache.flat_buffers()]
      bad = [k for k, (g, w) in enumerate(zip(got, want))
             if not np.array_equal(_bits(g), _bits(w))]
      ok = "ok" if not bad else f"MISMATCH buffers {bad[:4]}{'...' if len(bad) > 4 else ''}"
      bd = {}
      us, (cache, _, _), _ = bench.time_per_call(lambda st: (f(*st), *st[1:]),
                                                 (cache, tgt_d, src_d), iters, bd)
    except Exception as e:  # noqa: BLE001  (a variant that fails must not stop the sweep)
      msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      print(f"  {case:18s} {name:16s} FAILED {msg}", flush=True)
      results.append(Row(case, name, float("nan"), float("nan"), "FAILED", {}))
      continue
    results.append(Row(case, name, us, nbytes / us / 1e3, ok, bd))
    print(f"  {case:18s} {name:16s} {us:9.2f} us {nbytes / us / 1e3:8.1f} GB/s "
          f"kernels={len(bd):<2d} {ok}", flush=True)
  return cache


def report(results):
  print("\n== summary (device us per call; GB/s = 2 x moved bytes / time) ==")
  cases = list(dict.fromkeys(r.case for r in results))
  for case in cases:
    rows = [r for r in results if r.case == case]
    timed = [r for r in rows if r.ok == "ok" and r.variant != "xla"]
    best = min(timed, key=lambda r: r.us) if timed else None
    line = "  ".join(f"{r.variant}={r.us:.1f}" + ("" if r.ok == "ok" else "!") for r in rows)
    print(f"{case:18s} best={best.variant if best else '-':14s} {line}")
  print("\n== per-kernel breakdown (us per call): best pallas variant and default ==")
  for case in cases:
    rows = [r for r in results if r.case == case]
    timed = [r for r in rows if r.ok == "ok" and r.variant != "xla"]
    if not timed:
      continue
    best = min(timed, key=lambda r: r.us)
    shown = [best] + [r for r in rows if r.variant == "default" and r is not best]
    for r in shown:
      print(f"{case} / {r.variant}: {r.us:.2f} us")
      for name, us in sorted(r.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"    {us:9.2f}  {name[:110]}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--budget", type=float, default=125.0,
                      help="seconds after which only default and xla run")
  parser.add_argument("--small", action="store_true", help="CPU-sized smoke run")
  parser.add_argument("--cases", default="move,ovl,pages,pth",
                      help="comma list of move,ovl,pages,pth (split the sweep over runs)")
  parser.add_argument("--move-t", default=None, help="comma list overriding the move case's T")
  parser.add_argument("--page-counts", default=None, help="comma list overriding the page counts")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  budget_end = start + args.budget
  on_gpu = jax.devices()[0].platform == "gpu"
  small = args.small or not on_gpu
  if small:
    cfg = mc.SMALL.replace(size=1024 - 16, layer_num=2)
    move_t, ovl_t, pth_t, pages = (8, 64), (64,), (64,), (4,)
    iters = 1
  else:
    cfg = mc.DEEPSEEK_V3
    move_t, ovl_t, pth_t, pages = (8, 64, 256, 1024, 4096), (256, 4096), (8, 64, 256, 1024, 4096), (1, 16, 256)
    iters = args.iters
  print(f"sweep_moves on {jax.devices()[0].device_kind} (jax {jax.__version__}), "
        f"{cfg.layer_num} layers x {cfg.rows} rows", flush=True)
  rng = np.random.default_rng(0)
  results: list[Row] = []
  cases = set(args.cases.split(","))
  if args.move_t:
    move_t = tuple(int(v) for v in args.move_t.split(","))
  if args.page_counts:
    pages = tuple(int(v) for v in args.page_counts.split(","))
  if "move" not in cases:
    move_t = ()
  if "ovl" not in cases:
    ovl_t = ()
  if "pages" not in cases:
    pages = ()
  if "pth" not in cases:
    pth_t = ()

  def pick(names):
    return {k: TOKEN_VARIANTS[k] for k in names}

  cache = mc.init_cache(cfg) if (move_t or ovl_t or pages) else None
  # Random contents, so a wrong row cannot pass as zeros (one fused kernel per layer).
  if cache is not None:
    flat = cache.flat_buffers()
    keys = jax.random.split(jax.random.key(1), len(flat))
    fill = jax.jit(lambda b, k: jax.random.bits(k, b.shape, jnp.uint16).view(b.dtype),
                   donate_argnums=0)
    cache = cache.with_flat_buffers(tuple(fill(b, k) for b, k in zip(flat, keys)))
    del flat
  row_bytes = cfg.row_bytes * cfg.layer_num
  for t in move_t:
    tgt, src = _pairs(rng, cfg.rows, t, overlap=False)
    names = SMALL_T_VARIANTS if t <= 64 else LARGE_T_VARIANTS
    cache = run_case(cache, f"move T={t}", pick(names), tgt, src, 1, iters,
                     2 * t * row_bytes, rng, budget_end, results)
  for t in ovl_t:
    tgt, src = _pairs(rng, cfg.rows, t, overlap=True)
    cache = run_case(cache, f"move_ovl T={t}", pick(OVL_VARIANTS), tgt, src, 1, iters,
                     2 * t * row_bytes, rng, budget_end, results)
  npages = cfg.rows // cfg.page_size
  for p in pages:
    tgt, src = _pairs(rng, npages, p, overlap=False)
    cache = run_case(cache, f"pages P={p}", PAGE_VARIANTS, tgt, src, cfg.page_size, iters,
                     2 * p * cfg.page_size * row_bytes, rng, budget_end, results)
  del cache
  qcfg = cfg.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
  qcache = mc.init_cache(qcfg) if pth_t else None
  flat = qcache.flat_buffers() if qcache is not None else ()
  keys = jax.random.split(jax.random.key(2), max(1, len(flat)))
  qfill = jax.jit(lambda b, k: jax.random.bits(
      k, b.shape, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[b.dtype.itemsize]).view(b.dtype),
      donate_argnums=0)
  if qcache is not None:
    qcache = qcache.with_flat_buffers(tuple(qfill(b, k) for b, k in zip(flat, keys)))
  del flat
  for t in pth_t:
    tgt, src = _pairs(rng, qcfg.rows, t, overlap=False)
    qcache = run_case(qcache, f"move_pth T={t}", pick(PTH_VARIANTS), tgt, src, 1, iters,
                      2 * t * qcfg.row_bytes * qcfg.layer_num, rng, budget_end, results)
  del qcache
  report(results)
  bad = [r for r in results if r.ok != "ok"]
  print(f"\n{len(results)} runs, {len(bad)} failed or mismatched, "
        f"{time.perf_counter() - start:.0f} s total")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
