"""The least device time a kernel launch costs (one device call): Mosaic GPU vs Triton.

The one-token get and set are ~0.1-0.15 us above the seed's Triton kernels (ANCHORS.md)
even where both move the row with plain loads and stores. This times, with each side's
own profiler (kernel durations, as `bench` and the ANCHORS table do), one-program kernels
that do next to nothing:

* ``store128``: store 128 float32 zeros (one per thread of a warpgroup);
* ``row_copy``: copy one 576-element bf16 row (plain loads and stores);

as Mosaic GPU kernels (JAX profiler) and as Triton kernels (PyTorch profiler, in a
subprocess; skipped where torch/triton are missing). If Mosaic's floor is the larger, the
small-T gap is the launch itself, not the kernels' bodies.

    PYTHONPATH=$PWD python3 benchmarks/diag_floor.py [--iters 50]
"""

import argparse
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_mla_cache import bench

TRITON = r'''
import sys, torch, triton, triton.language as tl
from torch.profiler import profile, ProfilerActivity

@triton.jit
def store128(o_ptr):
  offs = tl.arange(0, 128)
  tl.store(o_ptr + offs, tl.zeros((128,), tl.float32))

@triton.jit
def row_copy(src_ptr, dst_ptr, row):
  offs = tl.arange(0, 1024)
  m = offs < 576
  tl.store(dst_ptr + offs, tl.load(src_ptr + row * 576 + offs, mask=m), mask=m)

iters = int(sys.argv[1])
o = torch.empty(128, device="cuda", dtype=torch.float32)
src = torch.randn(4096, 576, device="cuda", dtype=torch.bfloat16)
dst = torch.empty(576, device="cuda", dtype=torch.bfloat16)
for name, launch in (("store128", lambda: store128[(1,)](o)),
                     ("row_copy", lambda: row_copy[(1,)](src, dst, 77))):
  for _ in range(3):
    launch()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(iters):
      launch()
    torch.cuda.synchronize()
  ts = [e.time_range.elapsed_us() for e in prof.events()
        if str(e.device_type).endswith("CUDA") and name in e.name]
  ok = torch.equal(dst, src[77]) if name == "row_copy" else bool((o == 0).all())
  print(f"triton {name:9s} {sum(ts) / max(len(ts), 1):.3f} us  ({len(ts)} kernels, ok={ok})",
        flush=True)
'''


def mosaic_kernels():
  def store128(o_ref):
    o_ref[...] = jnp.zeros((128,), jnp.float32)

  def row_copy(src_ref, dst_ref):
    lay = plgpu.Layout.WG_STRIDED((1024,), vec_size=8)     # nope bytes: 8 per thread
    dst_ref.at[pl.ds(0, 1024)][...] = plgpu.load(src_ref.at[77, pl.ds(0, 1024)], layout=lay)
    dst_ref.at[pl.ds(1024, 128)][...] = plgpu.load(
        src_ref.at[77, pl.ds(1024, 128)], layout=plgpu.Layout.WG_STRIDED((128,), vec_size=1))

  k1 = plgpu.kernel(store128, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(1,),
                    grid_names=("b",), kernel_name="floor_store128")
  k2 = plgpu.kernel(row_copy, out_type=jax.ShapeDtypeStruct((1152,), jnp.uint8), grid=(1,),
                    grid_names=("b",), kernel_name="floor_row_copy")
  src = jax.random.randint(jax.random.key(0), (4096, 1152), 0, 255).astype(jnp.uint8)
  return [("store128", jax.jit(lambda s: k1()), None),
          ("row_copy", jax.jit(k2), src)]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=50)
  a = ap.parse_args()
  if jax.devices()[0].platform != "gpu":
    print("diag_floor needs a GPU (kernel device times)")
    return
  for name, f, x in mosaic_kernels():
    bd = {}
    bench.time_per_call(lambda s, f=f: (s[0], f(s[0])), (x, None), a.iters, bd)
    out = f(x)
    ok = bool((out == 0).all()) if name == "store128" else bool((out == x[77]).all())
    print(f"mosaic {name:9s} {sum(bd.values()):.3f} us  ({bd}, ok={ok})", flush=True)
  # Triton's @jit reads its function's source: the script must be a file, not `-c`.
  with tempfile.TemporaryDirectory() as d:
    script = os.path.join(d, "triton_floor.py")
    with open(script, "w") as f:
      f.write(TRITON)
    r = subprocess.run([sys.executable, script, str(a.iters)], capture_output=True,
                       text=True, timeout=300)
  print(r.stdout.strip() or f"triton part failed: {r.stderr.strip()[-600:]}", flush=True)


if __name__ == "__main__":
  main()
