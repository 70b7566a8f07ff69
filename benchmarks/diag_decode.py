"""The decode kernels' time per storage mode, path and stage count, side by side (device time
from a profiler trace, as bench.py), default B=64, s_q=1, H=16, context 4096.

    python benchmarks/diag_decode.py [--shape B,s_q,H,ctx] [--only PREFIX[,PREFIX...]]
        [--ablate convert] [--convert-layouts WGMMA_UPCAST_2X,WGMMA_UPCAST_4X]

--convert-layouts: time the per_token_head narrow path once per register
layout of their fp8 conversion (`mla_decode_narrow.CONVERT_LAYOUT`; the first is the
baseline) and report each output's largest difference from the first layout's (the
conversion is exact in every layout, so the outputs must be bit-equal).

--ablate convert: a diagnosis build (wrong results) whose wide-path kernel leaves out the
per_token_head fp8 -> bf16 conversion of each block (the scores and values then read
whatever the converted tile holds), timed after the kernels as shipped.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import mla_decode as kernel
from pallas_kernels import mla_decode_narrow, mla_decode_wide


def set_convert_layout(name: str) -> None:
  """The conversion layout of the narrow path (a diagnosis override)."""
  layout = getattr(plgpu.Layout, name)
  mla_decode_narrow.CONVERT_LAYOUT = layout
  kernel.common._cached_kernel_fn.cache_clear()   # (a kernel is jitted once per build)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", default="64,1,16,4096")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--only", default=None,
                      help="run only the variants whose names start with one of these (commas)")
  parser.add_argument("--convert-layouts", default=None,
                      help="comma-separated plgpu.Layout names for the fp8 conversion")
  parser.add_argument("--ablate", default=None, choices=["convert"],
                      help="also time a diagnosis build of the wide path without this piece")
  args = parser.parse_args()
  B, s_q, H, ctx = map(int, args.shape.split(","))
  rng = np.random.default_rng(0)
  base = mc.DEEPSEEK_V3.replace(layer_num=1)
  pages = ctx // base.page_size
  table, lens, q = bench.decode_problem(rng, base, B, s_q, H, ctx)
  variants = [(f"{mode}-{path}-s{stages}", mode == "pth",
               kernel.DecodeConfig(path=path, stages=stages))
              for mode in ("bf16", "pth") for path in kernel.PATHS
              for stages in ((2, 3, 4) if path == "registers" else (2, 3))]
  caches = {}
  if args.only:
    variants = [v for v in variants if v[0].startswith(tuple(args.only.split(",")))]
  layouts = args.convert_layouts.split(",") if args.convert_layouts else [None]
  variants = [(name + (f"-{lay}" if lay else ""), quant, config, lay)
              for name, quant, config in variants for lay in layouts
              if lay is None or lay == layouts[0] or (quant and config.path != "wide")]
  firsts = {}          # (per conversion layout run: the first layout's output)
  first_of_mode = {}    # storage mode -> (the first variant's name, its output)
  if args.ablate:
    variants += [(f"{name}-no-{args.ablate}", quant, config, lay)
                 for name, quant, config, lay in variants if config.path == "wide" and quant]
  for name, quant, config, lay in variants:
    if lay is not None:
      set_convert_layout(lay)
    if name.endswith("-no-convert"):
      mla_decode_wide.convert_fp8 = lambda *a, **k: None   # diagnosis build: wrong results
      kernel.common._cached_kernel_fn.cache_clear()        # (a kernel is jitted once per build)
    cfg = (base.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head") if quant
           else base).replace(size=B * pages * base.page_size)
    if quant not in caches:
      caches[quant] = bench.decode_cache(cfg)
    layer = caches[quant].layer(0)
    geo = kernel.Geometry(B=B, s_q=s_q, H=H, R=512, Rr=64, P=pages, page_size=cfg.page_size,
                          rows=cfg.rows, quantized=quant, dtype=jnp.dtype(jnp.bfloat16))
    why = kernel._path(config.path).takes(geo, config)
    if why is not None:
      print(f"{name:20s} not taken: {why}", flush=True)
      continue
    f = jax.jit(lambda layer, q, t, n, config=config: kernel.mla_decode(
        layer, q, t, n, sm_scale=0.07, page_size=cfg.page_size, kv_lora_rank=512, config=config))
    bd = {}
    try:
      us, _, method = bench.time_per_call(lambda st: (*st[:4], f(*st[:4])),
                                          (layer, q, table, lens, None), args.iters, bd)
      out = np.asarray(f(layer, q, table, lens)[0], np.float32)
    except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
      print(f"{name:20s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
      continue
    if lay is not None:
      first = firsts.setdefault(name.replace(f"-{lay}", "", 1), out)
      diff = f"  max |out - {layouts[0]}'s|: {np.nanmax(np.abs(out - first)):.3g}"
    else:
      # Against the first variant of the same storage mode (different paths round
      # differently: a check that a new path computes the same thing, not a test).
      first_name, first = first_of_mode.setdefault(quant, (name, out))
      diff = (f"  max |out - {first_name}'s| {np.nanmax(np.abs(out - first)):.3g} "
              f"(max |out| {np.nanmax(np.abs(first)):.3g})" if first_name != name else "")
    nbytes = B * ctx * cfg.row_bytes
    kern = {k: v for k, v in bd.items() if "mla_decode" in k}
    print(f"{name:20s} {us:9.2f} us  {nbytes / us / 1e3:7.1f} GB/s  kernels: "
          + ", ".join(f"{k[:40]} {v:.1f}" for k, v in kern.items()) + diff, flush=True)


if __name__ == "__main__":
  main()
