"""Host time to trace and lower the GPU demo's 61-layer steps for CUDA (no GPU needed).

    PYTHONPATH=$PWD python3 benchmarks/lower_demo.py [--layers 61] [--repeat 2]

Builds the demo's GPU model (DeepSeek-V3 cache geometry, `demo.GPU_MODEL`, batch 32,
512-token prompts) from abstract shapes only (nothing is allocated), then for the prefill
and the decode step prints the seconds of `jit(...).trace(...)` and of
`.lower(lowering_platforms=("cuda",))` and the size of the lowered module. That is the
part of the demo's cold compile done before XLA's own compile (the demo prints both on a
GPU). Each repeat runs in a fresh process, so no trace is cached between them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _one(layers: int) -> None:
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
  cache = mc.cache_spec(cache_cfg)
  P = -(-(S + steps) // cache_cfg.page_size)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  steps_to_lower = {
      "prefill": lambda: mla_demo.prefill.trace(params, cache, i32(B, S), i32(B), i32(B, P),
                                                implementation="pallas"),
      "decode": lambda: mla_demo.decode.trace(params, cache, i32(B), i32(B), i32(B, P),
                                              implementation="pallas"),
  }
  print(f"  ({os.path.dirname(mc.__file__)}, jax {jax.__version__})", flush=True)
  for name, trace in steps_to_lower.items():
    t0 = time.perf_counter()
    traced = trace()
    t1 = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    t2 = time.perf_counter()
    print(f"  {name}: trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s, "
          f"trace + lower {t2 - t0:.2f} s, module {len(text) / 1e6:.1f} MB", flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, default=61)
  ap.add_argument("--repeat", type=int, default=2)
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.one:
    _one(a.layers)
    return
  for r in range(a.repeat):
    print(f"run {r + 1} of {a.repeat} ({a.layers} layers):", flush=True)
    subprocess.run([sys.executable, __file__, "--one", f"--layers={a.layers}"], check=True)


if __name__ == "__main__":
  main()
