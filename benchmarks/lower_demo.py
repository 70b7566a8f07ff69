"""Host time to trace and lower the GPU demo's 61-layer steps for CUDA (no GPU needed), and
on a GPU where XLA's compile of them goes.

    PYTHONPATH=$PWD python3 benchmarks/lower_demo.py [--layers 61] [--repeat 2]
    PYTHONPATH=$PWD python3 benchmarks/lower_demo.py --compile --layers 1 61 --impl pallas xla
    PYTHONPATH=$PWD python3 benchmarks/lower_demo.py --scan [--compile] [--layers 1 61]

Builds the demo's GPU model (DeepSeek-V3 cache geometry, `demo.GPU_MODEL`, batch 32,
512-token prompts) from abstract shapes only (nothing is allocated), then for the prefill
and the decode step prints the seconds of `jit(...).trace(...)` and of
`.lower(lowering_platforms=("cuda",))` and the size of the lowered module. That is the
part of the demo's cold compile done before XLA's own compile (the demo prints both on a
GPU). Each repeat runs in a fresh process, so no trace is cached between them.

`--compile` (on a GPU) also compiles each lowered step for the local device and prints
XLA's compile seconds, for every `--layers` count and `--impl` ("pallas": the demo's Mosaic
GPU kernels; "xla": the same model on XLA ops only), each in a fresh process with no
persistent compilation cache: the growth from 1 to 61 layers is what each layer costs, and
the difference between the implementations is what the Mosaic GPU kernels cost.

`--scan`: the same model with its layers under `jax.lax.scan` (`mla_demo.stack_layers`
and a `StackedMLAKVCache`): one layer body to trace, lower and compile, whatever the layer
count.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _one(layers: int, impl: str, compile_: bool, scan: bool = False) -> None:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax
  import jax.numpy as jnp

  import jax_mla_cache as mc
  from jax_mla_cache import demo
  from jax_mla_cache.models import mla_demo

  cache_cfg = mc.DEEPSEEK_V3.replace(layer_num=layers)
  model_cfg = mla_demo.MLADemoConfig(cache=cache_cfg, dtype=jnp.bfloat16, **demo.GPU_MODEL)
  B, S, steps = 32, 512, 64
  params = jax.eval_shape(lambda: mla_demo.init_params(model_cfg, seed=0))
  cache = mc.cache_spec(cache_cfg, stacked=scan)
  if scan:   # the layers under lax.scan: stacked weights, a StackedMLAKVCache
    params = jax.eval_shape(mla_demo.stack_layers, params)
  P = -(-(S + steps) // cache_cfg.page_size)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  steps_to_lower = {
      "prefill": lambda: mla_demo.prefill.trace(params, cache, i32(B, S), i32(B), i32(B, P),
                                                implementation=impl),
      "decode": lambda: mla_demo.decode.trace(params, cache, i32(B), i32(B), i32(B, P),
                                              implementation=impl),
  }
  print(f"  ({os.path.dirname(mc.__file__)}, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}, {layers} layers, {impl}"
        f"{', scanned' if scan else ''})", flush=True)
  for name, trace in steps_to_lower.items():
    t0 = time.perf_counter()
    traced = trace()
    t1 = time.perf_counter()
    lowered = traced.lower() if compile_ else traced.lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    t2 = time.perf_counter()
    line = (f"  {name}: trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s, "
            f"trace + lower {t2 - t0:.2f} s, module {len(text) / 1e6:.1f} MB")
    if compile_:
      lowered.compile()
      line += f", XLA compile {time.perf_counter() - t2:.2f} s"
    print(line, flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, nargs="+", default=[61])
  ap.add_argument("--impl", nargs="+", default=["pallas"], choices=["pallas", "xla"])
  ap.add_argument("--compile", action="store_true",
                  help="also compile for the local device (a GPU) and time XLA's compile")
  ap.add_argument("--scan", action="store_true",
                  help="the layers under lax.scan (mla_demo.stack_layers, a stacked cache)")
  ap.add_argument("--repeat", type=int, default=2)
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.one:
    _one(a.layers[0], a.impl[0], a.compile, a.scan)
    return
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  for r in range(a.repeat):
    for impl in a.impl:
      for layers in a.layers:
        print(f"run {r + 1} of {a.repeat} ({layers} layers, {impl}):", flush=True)
        subprocess.run([sys.executable, __file__, "--one", f"--layers={layers}",
                        f"--impl={impl}"] + (["--compile"] if a.compile else [])
                       + (["--scan"] if a.scan else []),
                       check=True, env=env)


if __name__ == "__main__":
  main()
