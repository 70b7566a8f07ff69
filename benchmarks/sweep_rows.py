"""Sweep the row kernels' tiling knobs (`pallas_kernels.RowConfig`) on the GPU.

    cd repo && PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/sweep_rows.py

For each op (set bf16, get bf16, set per_token_head) and T in {1, 64, 512, 4096, 32768},
on one DeepSeek-V3 layer (2^18 + 64 rows of 512 + 64), random distinct slots:

* every variant below is resolved to its kernel plan (block tokens B, stages, slot
  prefetch); variants with the same plan at a T share one kernel and one measurement
  (shown as "=name");
* all distinct kernels of one (op, T) are timed in one `jax_mla_cache.bench.time_per_call`
  (profiler device time): each step calls every kernel once, each kernel carries its own
  name (`RowConfig.kernel_tag`) and the per-kernel breakdown splits the time. If the
  profile does not name the kernels, each kernel is timed on its own instead;
* each kernel's result after timing (set: the buffer, rewritten idempotently every step;
  get: the gathered rows) is compared bit for bit with `jax_mla_cache.reference` on the
  same inputs; a mismatch shows as WRONG and never wins.

Prints one table per op (us per call and B[sS] = tokens per program [stages]), the
breakdown of the best kernel per T, the suggested config per T range and the best single
config. Off a GPU it runs a small interpret-mode smoke test (wall-clock times, meaningless).
Budget: ~150 s on an H200 with compiles; --budget stops starting new (op, T) past it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_mla_cache as mc
import pallas_kernels as pk
from jax_mla_cache import bench
from jax_mla_cache import reference as ref
from pallas_kernels import rows as rk

NEW = rk.DEFAULT_CONFIG
OLD = rk.LEGACY_CONFIG
_r = dataclasses.replace

# (name, config, prediction): the predictions are written before any measurement.
VARIANTS = {
    "set": [
        ("new", NEW, "B=8 at 4096 (4/SM): phases of neighbours overlap; ~2.5-2.6us"),
        ("old", OLD, "B=32 at 4096: one program per SM, load then store, no overlap"),
        ("new_c2", _r(NEW, chunks=2), "stores start after half the block landed"),
        ("t264", _r(NEW, target_programs=264), "B=16 at 4096, 2/SM"),
        ("m16", _r(NEW, max_block_tokens=16), "B=16 at 32768: 2048 programs"),
        ("old_c4", _r(OLD, chunks=4), "B=32 with 4 stages: overlap inside one program"),
    ],
    "get": [
        ("new", NEW, "prefetch + B=8 at 4096: ~3.0us; ~21.5us at 32768"),
        ("old", OLD, "slot-by-slot: B dependent L2 round trips per program"),
        ("old_pf", _r(OLD, loc_prefetch=True), "same blocks, slots read up front"),
        ("new_c2", _r(NEW, chunks=2), "first half stored while second half loads"),
        ("t264", _r(NEW, target_programs=264), "B=16 at 4096"),
        ("m16", _r(NEW, max_block_tokens=16), "B=16 at 32768"),
        ("direct1", _r(NEW, direct_block_tokens=1),
         "plain loads/stores, 1 token per program: 1.01us at T=1 (diag_direct, 2026-12-04)"),
        ("direct2", _r(NEW, direct_block_tokens=2), "2 tokens: best at T=512 (1.32us)"),
        ("direct4", _r(NEW, direct_block_tokens=4), "4 tokens: best from T=2048 (2.36us at 4096)"),
        ("direct8", _r(NEW, direct_block_tokens=8), "8 tokens: ~equal to 4 at 32768"),
    ],
    "pth": [
        ("new", NEW, "B=12 (2.6/SM at 4096): ~3.3us at 4096"),
        ("old", OLD, "B=28: 147 programs at 4096, 112 f32 per thread, 2 waves on 15 SMs"),
        ("r4", _r(NEW, max_reg_block_tokens=4), "B=4: one row per warp, 1024 programs"),
        ("r20", _r(NEW, max_reg_block_tokens=20), "B=20"),
        ("r28", _r(NEW, max_reg_block_tokens=28), "B=28 at 32768, 12 at 4096"),
        ("r20t132", _r(NEW, max_reg_block_tokens=20, target_programs=132),
         "B=20 at 4096 (205 programs)"),
        # Added 2026-12-04c, after the nope division became a reciprocal + correction
        # (less compute per row: smaller blocks may now hide the load-compute-store chain
        # better, or larger ones amortize it):
        ("r1", _r(NEW, max_reg_block_tokens=1), "B=1: 4096 programs at 4096, padding rows"),
        ("r2", _r(NEW, max_reg_block_tokens=2), "B=2: 2048 programs at 4096"),
        ("r8", _r(NEW, max_reg_block_tokens=8), "B=8 at 4096: ~3.2us"),
        # Added 2026-12-05d, stages for this kernel (`chunks`): the loads of every stage are
        # issued first, then each stage is quantized and stored while later ones land.
        ("r8c2", _r(NEW, max_reg_block_tokens=8, chunks=2),
         "B=8 as 2 x 4 at 4096: below B=4's 3.31us if load latency is what is left"),
        ("r12c3", _r(NEW, max_reg_block_tokens=12, chunks=3), "B=12 as 3 x 4"),
        ("r16c4", _r(NEW, max_reg_block_tokens=16, chunks=4),
         "B=16 as 4 x 4: 256 programs at 4096, ~2 per SM"),
    ],
}
TITLES = {"set": "set_mla bf16 (set_rows)", "get": "get_mla bf16 (get_rows)",
          "pth": "set_mla per_token_head (set_rows_per_token_head, fp8 + f32 + bf16)"}


def plan(op: str, T: int, cfg: pk.RowConfig) -> tuple:
  """What the kernel for (op, T, cfg) is: variants with equal plans compile the same."""
  if op == "pth":
    B = rk.reg_block_tokens(T, cfg)
    return ("B", B, "S", rk.stage_count(B, cfg.chunks))
  if op == "get" and cfg.direct_block_tokens:  # DeepSeek's bf16 rows take the direct gather
    return ("B", min(cfg.direct_block_tokens, T), "D", True)
  B = rk.copy_block_tokens(T, cfg)
  key = ("B", B, "S", rk.stage_count(B, cfg.chunks))
  return key + ("pf", cfg.loc_prefetch) if op == "get" else key


def plan_label(p: tuple) -> str:
  d = dict(zip(p[::2], p[1::2]))
  s = f"b{d['B']}" + (f"s{d['S']}" if d.get("S", 1) > 1 else "")
  if d.get("D"):
    return s + "D"  # D: direct gather (plain loads and stores)
  return s + ("" if d.get("pf", True) else "L")  # L: slot-by-slot (legacy) gathers


@jax.jit
def _bits_equal(a, b):
  ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  return jnp.all(lax.bitcast_convert_type(a, ut) == lax.bitcast_convert_type(b, ut))


def same(got, want) -> bool:
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  return len(got) == len(want) and all(
      g.shape == w.shape and g.dtype == w.dtype and bool(_bits_equal(g, w))
      for g, w in zip(got, want))


def make_case(op, T, geo, bases, rng):
  """(kernel fn(cfg) -> jitted, state args, reference result, donate?)."""
  R, Rr, rows = geo
  loc = jnp.asarray(rng.permutation(rows)[:T].astype(np.int32))
  nope = jnp.asarray(rng.standard_normal((T, 1, R), np.float32)).astype(jnp.bfloat16)
  rope = jnp.asarray(rng.standard_normal((T, 1, Rr), np.float32)).astype(jnp.bfloat16)
  if op == "set":
    want = jax.jit(ref.set_rows)(bases["kv"], loc, nope, rope)
    fn = lambda cfg: jax.jit(functools.partial(pk.set_rows, config=cfg), donate_argnums=0)
    return fn, (loc, nope, rope), want, ("kv",)
  if op == "get":
    want = jax.jit(functools.partial(ref.get_rows, kv_lora_rank=R, dst_dtype=jnp.bfloat16))(
        bases["kv"], loc)
    fn = lambda cfg: jax.jit(functools.partial(pk.get_rows, kv_lora_rank=R,
                                               dst_dtype=jnp.bfloat16, config=cfg))
    return fn, (loc,), want, ()
  want = jax.jit(ref.set_rows_per_token_head)(*bases["pth"], loc, nope, rope)
  fn = lambda cfg: jax.jit(functools.partial(pk.set_rows_per_token_head, config=cfg),
                           donate_argnums=(0, 1, 2))
  return fn, (loc, nope, rope), want, ("pth",)


def time_kernels(op, kernels, args, bases, iters):
  """Device us per call of each kernel (list), their outputs and breakdown per kernel."""
  if op == "get":
    kv = bases["kv"]
    step = lambda st: (st[0], tuple(k(kv, *args) for k in kernels))
    state = (None, tuple(None for _ in kernels))
  else:
    buf = bases["kv"] if op == "set" else bases["pth"]
    fresh = lambda: jax.tree.map(jnp.copy, buf)
    if op == "set":
      step = lambda st: (tuple(k(b, *args) for k, b in zip(kernels, st[0])), None)
    else:
      step = lambda st: (tuple(k(*b, *args) for k, b in zip(kernels, st[0])), None)
    state = (tuple(fresh() for _ in kernels), None)
  bd: dict[str, float] = {}
  total, state, method = bench.time_per_call(step, state, iters, bd)
  outs = state[1] if op == "get" else state[0]
  return total, outs, bd, method


def run_op(op, Ts, geo, bases, iters, budget, t_start, rng):
  names = [v[0] for v in VARIANTS[op]]
  cfgs = {v[0]: v[1] for v in VARIANTS[op]}
  table = {}  # (name, T) -> (us | None, label, ok)
  details = {}  # T -> (best name, breakdown lines)
  for T in Ts:
    if time.perf_counter() - t_start > budget:
      print(f"  [{op} T={T}: skipped, past the {budget:.0f} s budget]", flush=True)
      continue
    t0 = time.perf_counter()
    fn, args, want, _ = make_case(op, T, geo, bases, rng)
    plans: dict[tuple, str] = {}  # plan -> first variant name with it
    for name in names:
      plans.setdefault(plan(op, T, cfgs[name]), name)
    owners = list(plans.values())
    tags = {nm: f"_sw{k}x" for k, nm in enumerate(owners)}
    kernels = [fn(_r(cfgs[nm], kernel_tag=tags[nm])) for nm in owners]
    total, outs, bd, method = time_kernels(op, kernels, args, bases, iters)
    per = {nm: sum(v for e, v in bd.items() if tags[nm] in e) for nm in owners}
    if method == "profiler" and not all(per.values()):
      print(f"  (profile events do not name the kernels: {sorted(bd)[:6]}...; timing each "
            "kernel alone)", flush=True)
      for nm, k in zip(owners, kernels):
        per[nm], _, _, _ = time_kernels(op, [k], args, bases, iters)
    elif method != "profiler":
      per = {nm: total / len(owners) for nm in owners}  # wall clock: one number for all
    ok = {nm: same(o, want) for nm, o in zip(owners, outs)}
    for name in names:
      p = plan(op, T, cfgs[name])
      owner = plans[p]
      table[name, T] = (per[owner], plan_label(p), ok[owner], owner)
    good = [nm for nm in owners if ok[nm]]
    if good:
      best = min(good, key=lambda nm: per[nm])
      lines = [f"{e}: {v:.2f} us" for e, v in sorted(bd.items()) if tags[best] in e]
      other = {e: v for e, v in bd.items() if not any(t in e for t in tags.values())}
      if other:
        lines.append("not our kernels (per step, all variants): " + ", ".join(
            f"{e}: {v:.2f} us" for e, v in sorted(other.items())))
      details[T] = (best, lines)
    del want, outs
    print(f"  [{op} T={T}: {len(owners)} kernels, {time.perf_counter() - t0:.1f} s, "
          f"{method}]", flush=True)
  return table, details


def bytes_moved(op, T, geo):
  R, Rr, _ = geo
  if op == "pth":
    return T * (R + Rr) * 2 + T * (R + 4 + Rr * 2)
  return 2 * T * (R + Rr) * 2


def report(op, Ts, table, details, geo):
  names = [v[0] for v in VARIANTS[op]]
  Ts = [T for T in Ts if any((n, T) in table for n in names)]
  print(f"\n== {TITLES[op]}: device us per call (B = tokens per program, s = stages, "
        "L = slot-by-slot gathers; =x: same kernel as x)")
  print(f"{'variant':<8}" + "".join(f"{'T=' + str(T):>16}" for T in Ts))
  best = {}
  for T in Ts:
    cands = [(table[n, T][0], n) for n in names if (n, T) in table and table[n, T][2]]
    if cands:
      best[T] = table[min(cands)[1], T][3]  # the variant that owns the kernel
  for n in names:
    cells = []
    for T in Ts:
      if (n, T) not in table:
        cells.append("-")
        continue
      us, label, ok, owner = table[n, T]
      mark = "*" if best.get(T) == owner else " "
      cell = (f"{us:.2f}{mark}" if ok else "WRONG") + " " + label
      if owner != n:
        cell = f"={owner} {label}"
      cells.append(cell)
    print(f"{n:<8}" + "".join(f"{c:>16}" for c in cells))
  gbs = "".join(f"{bytes_moved(op, T, geo) / table[best[T], T][0] / 1e3:>13.0f}GB/s"
                if T in best else f"{'-':>16}" for T in Ts)
  print(f"{'best':<8}{gbs}")
  for T in Ts:
    if T in details:
      b, lines = details[T]
      print(f"  breakdown of the best at T={T} ({b}): " + "; ".join(lines))
  return best


def suggest(op, Ts, table, best):
  names = [v[0] for v in VARIANTS[op]]
  cfgs = {v[0]: v[1] for v in VARIANTS[op]}
  print(f"  suggested {op} config per T range (best variant, knobs that differ from "
        "DEFAULT_CONFIG):")
  lo = 0
  for T in Ts:
    if T not in best:
      continue
    # Among the variants that share the best kernel, name the default if it is one.
    tied = [n for n in names if (n, T) in table and table[n, T][3] == best[T]]
    b = "new" if "new" in tied else tied[0]
    diff = {f.name: getattr(cfgs[b], f.name) for f in dataclasses.fields(pk.RowConfig)
            if getattr(cfgs[b], f.name) != getattr(NEW, f.name)}
    print(f"    T in ({lo}, {T}]: {b} {table[b, T][1]} {diff or '(default)'}")
    lo = T
  # One config for every T: smallest geometric mean of time / best time.
  scores = {}
  for n in names:
    r = [table[n, T][0] / table[best[T], T][0] for T in best
         if (n, T) in table and table[n, T][2]]
    if len(r) == len(best) and r:
      scores[n] = math.exp(sum(map(math.log, r)) / len(r))
  if scores:
    n = min(scores, key=scores.get)
    worst = max(table[n, T][0] / table[best[T], T][0] for T in best)
    print(f"    one config for all T: {n} (geomean {100 * (scores[n] - 1):.1f}% over the "
          f"per-T best, worst {100 * (worst - 1):.1f}%); default 'new' is "
          f"{100 * (scores.get('new', float('nan')) - 1):.1f}% over")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--ops", default="set,get,pth")
  parser.add_argument("--tokens", default=None, help="comma list of T")
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--budget", type=float, default=135.0,
                      help="seconds after which no new (op, T) starts")
  args = parser.parse_args(argv)
  t_start = time.perf_counter()
  on_gpu = jax.devices()[0].platform == "gpu"
  cfg = mc.DEEPSEEK_V3 if on_gpu else mc.SMALL.replace(size=512 - 16)
  R, Rr, rows = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.rows
  geo = (R, Rr, rows)
  Ts = [int(t) for t in args.tokens.split(",")] if args.tokens else (
      list(bench.SET_TOKENS) if on_gpu else [1, 37])
  iters = args.iters or (20 if on_gpu else 1)
  print(f"sweep_rows: {jax.devices()[0].device_kind}, rows={rows}, R={R}, Rr={Rr}, T={Ts}, "
        f"iters={iters}, jax {jax.__version__}", flush=True)
  if not on_gpu:
    print("(no GPU: interpret-mode smoke run; times are wall clock and meaningless)")
  rng = np.random.default_rng(0)
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  bases = {
      "kv": jax.random.normal(k1, (rows, 1, R + Rr), jnp.bfloat16),
      "pth": (jax.random.normal(k2, (rows, 1, R), jnp.float32).astype(jnp.float8_e4m3fn),
              jax.random.uniform(k3, (rows, 1, 1), jnp.float32, 0.01, 1.0),
              jax.random.normal(k4, (rows, 1, Rr), jnp.bfloat16)),
  }
  if on_gpu:
    print(f"device copy bandwidth (XLA elementwise, read+write): "
          f"{bench.copy_bandwidth_gbps(1 << 30):.0f} GB/s", flush=True)
  for op in args.ops.split(","):
    print(f"\n{TITLES[op]}: variants (prediction)")
    for name, _, why in VARIANTS[op]:
      print(f"  {name:<7} {why}")
    table, details = run_op(op, Ts, geo, bases, iters, args.budget, t_start, rng)
    best = report(op, Ts, table, details, geo)
    suggest(op, Ts, table, best)
    sys.stdout.flush()
  print(f"\nsweep_rows: {time.perf_counter() - t_start:.1f} s in all")


if __name__ == "__main__":
  main()
