"""Where a decode kernel's block time goes: Mosaic GPU's in-kernel profiler on one call.

The decode kernels mark their phases with ``jax.named_scope`` (waits on barriers, the fp8
conversion, the score product, the softmax, the exchanges, the value product, the loads).
With `pallas_kernels.common.PROFILE` set, a kernel built afterwards records when each
warpgroup enters and leaves each region (Mosaic GPU's profiler: one thread a warpgroup,
``globaltimer`` stamps, the first ``--space`` events of each warpgroup) and writes a
Perfetto trace (``*-trace.json``, open it at ui.perfetto.dev). This script runs one path
once at one shape and prints, per warpgroup, each region's median duration over the
steady-state blocks (the first two blocks of every program left out) and the median
period of the warpgroup's first region:

    python benchmarks/trace_decode.py [--shape B,s_q,H,ctx] [--mode pth|bf16]
        [--path registers|narrow|wide] [--space 64] [--out DIR] [--timeline PROGRAM]

GPU only (the interpreter has no profiler). The record buffer takes shared memory (16
bytes an event a warpgroup): keep ``--space`` small for kernels that fill it (the wide
path at H=128 leaves ~1 KB).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

WARPGROUPS = {"registers": 2, "narrow": 2, "wide": 2}


def summarize(trace: dict, warpgroups: int, skip: int = 2) -> dict:
  """{warpgroup: {"regions": {name: (count, median ns)}, "period": (first region,
  median ns between its starts)}} from a Mosaic GPU profiler trace (events "B"/"E" with
  "ts" in us, "tid" = 1 + warpgroup + warpgroups x program). Each region's first `skip`
  occurrences in every program are left out (the pipeline filling)."""
  per_thread = collections.defaultdict(list)
  for ev in trace["traceEvents"]:
    per_thread[ev["tid"]].append(ev)
  durations = collections.defaultdict(lambda: collections.defaultdict(list))
  periods = collections.defaultdict(list)
  first_region = {}
  for tid, events in per_thread.items():
    wg = (tid - 1) % warpgroups
    stack, seen, starts = [], collections.Counter(), collections.defaultdict(list)
    for ev in events:
      if ev["ph"] == "B":
        stack.append(ev)
        starts[ev["name"]].append(ev["ts"])
        if ev["name"] != "Init":   # (the profiler's own first event)
          first_region.setdefault(wg, ev["name"])
      elif stack:
        begin = stack.pop()
        seen[begin["name"]] += 1
        if seen[begin["name"]] > skip:
          durations[wg][begin["name"]].append((ev["ts"] - begin["ts"]) * 1e3)
    name = first_region.get(wg)
    if name is not None:
      ts = starts[name][skip:]
      periods[wg].extend((b - a) * 1e3 for a, b in zip(ts, ts[1:]))
  return {
      wg: {"regions": {name: (len(v), statistics.median(v)) for name, v in regions.items()},
           "period": (first_region[wg],
                      statistics.median(periods[wg]) if periods[wg] else float("nan"))}
      for wg, regions in sorted(durations.items())}


def timeline(trace: dict, warpgroups: int, program: int = 0) -> dict:
  """{warpgroup: [(region, start ns, end ns), ...]} of one program (its "tid"s), times from
  the program's first event, regions in the order they closed (nested ones first)."""
  tids = {1 + wg + warpgroups * program: wg for wg in range(warpgroups)}
  events = [ev for ev in trace["traceEvents"] if ev["tid"] in tids]
  if not events:
    return {}
  t0 = min(ev["ts"] for ev in events)
  out, stacks = collections.defaultdict(list), collections.defaultdict(list)
  for ev in events:
    wg = tids[ev["tid"]]
    if ev["ph"] == "B":
      stacks[wg].append(ev)
    elif stacks[wg]:
      begin = stacks[wg].pop()
      out[wg].append((begin["name"], (begin["ts"] - t0) * 1e3, (ev["ts"] - t0) * 1e3))
  return dict(sorted(out.items()))


def print_summary(summary: dict) -> None:
  for wg, s in summary.items():
    name, period = s["period"]
    print(f"warpgroup {wg}: period of '{name}' {period:8.0f} ns (median)")
    for region, (count, ns) in sorted(s["regions"].items(), key=lambda kv: -kv[1][1]):
      print(f"  {region:16s} {ns:8.0f} ns  ({count} samples)")


def main() -> None:
  import jax_mla_cache as mc
  from jax_mla_cache import bench
  from pallas_kernels import common
  from pallas_kernels import mla_decode as kernel

  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", default="64,1,16,4096")
  parser.add_argument("--mode", default="pth", choices=["pth", "bf16"])
  parser.add_argument("--path", default="registers", choices=kernel.PATHS)
  parser.add_argument("--space", type=int, default=64, help="events a warpgroup records")
  parser.add_argument("--out", default=None, help="folder for the trace (default: a new one)")
  parser.add_argument("--timeline", type=int, default=None, metavar="PROGRAM",
                      help="also print this program's regions in time order")
  args = parser.parse_args()
  B, s_q, H, ctx = map(int, args.shape.split(","))
  out = args.out or tempfile.mkdtemp(prefix="trace_decode_")
  os.makedirs(out, exist_ok=True)
  common.PROFILE = (args.space, out)
  common._cached_kernel_fn.cache_clear()   # kernels built from here on record their regions

  quant = args.mode == "pth"
  base = mc.DEEPSEEK_V3.replace(layer_num=1)
  pages = ctx // base.page_size
  cfg = (base.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head") if quant
         else base).replace(size=B * pages * base.page_size)
  table, lens, q = bench.decode_problem(np.random.default_rng(0), cfg, B, s_q, H, ctx)
  layer = bench.decode_cache(cfg).layer(0)
  config = kernel.DecodeConfig(path=args.path)
  f = jax.jit(lambda layer, q, t, n: kernel.mla_decode(
      layer, q, t, n, sm_scale=0.07, page_size=cfg.page_size, kv_lora_rank=512, config=config))
  jax.block_until_ready(f(layer, q, table, lens))
  jax.effects_barrier()                      # the trace is written by a host callback
  traces = sorted(glob.glob(os.path.join(out, "*-trace.json")), key=os.path.getmtime)
  if not traces:
    raise SystemExit(f"no trace in {out} (the profiler runs on the GPU only)")
  print(f"{args.mode} {args.path} B={B} s_q={s_q} H={H} context {ctx}: {traces[-1]}")
  with open(traces[-1]) as fh:
    trace = json.load(fh)
  print_summary(summarize(trace, WARPGROUPS[args.path]))
  if args.timeline is not None:
    for wg, regions in timeline(trace, WARPGROUPS[args.path], args.timeline).items():
      print(f"program {args.timeline}, warpgroup {wg}:")
      for name, start, end in sorted(regions, key=lambda r: r[1]):
        print(f"  {start:9.0f} {end:9.0f} ns  {name}")


if __name__ == "__main__":
  main()
