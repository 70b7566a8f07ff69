"""A/B of mla_decode_converter.FLAGS_BY_SEQUENCE (TEMPORARY): the value warpgroup tests a
per-sequence count of masked pages instead of loading every block's page flags. Lengths
that end mid-block, whole blocks, and a masked page in every sequence (that sequence then
loads the flags). Each case twice per flag, alternating. On CPU: tiny shapes, correctness
only."""
import os
# Several CPU devices: interpret mode on one can hang (pallas_kernels.common.InterpretWarning).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import mla_decode as kernel, mla_decode_converter as conv

on_gpu = jax.default_backend() == "gpu"
cases = ([tuple(map(int, c.split(","))) for c in
          os.environ.get("AB_CASES", "64,4096;128,4096;128,16384").split(";")]
         if on_gpu else [(2, 200)])
base = mc.DEEPSEEK_V3.replace(layer_num=1)
for B, ctx in cases:
  rng = np.random.default_rng(0)
  pages = ctx // base.page_size + 1
  table, full, q = bench.decode_problem(rng, base, B, 1, 16, ctx)
  cfg = base.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head",
                     size=B * pages * base.page_size)
  cache = bench.decode_cache(cfg)
  layer = cache.layer(0)
  holed = table.at[:, 1].set(-1)
  for tail, t, lens in (("mid-block", table, full - 17), ("whole", table, full),
                        ("masked-page", holed, full)):
    ref_out, ref_lse = mc.mla_decode(cache, 0, q, t, lens, sm_scale=0.07, implementation="xla")
    for flag in ((True, False, True, False) if on_gpu else (True, False)):
      conv.FLAGS_BY_SEQUENCE = flag
      kernel.common._cached_kernel_fn.cache_clear()
      config = kernel.DecodeConfig(path="converter")
      f = jax.jit(lambda layer, q, t, n: kernel.mla_decode(
          layer, q, t, n, sm_scale=0.07, page_size=cfg.page_size, kv_lora_rank=512,
          config=config))
      out, lse = f(layer, q, t, lens)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
      lerr = float(jnp.max(jnp.abs(jnp.where(jnp.isinf(ref_lse), 0, lse - ref_lse))))
      line = (f"pth converter B={B} H=16 ctx={ctx} {tail:11s} by_sequence={flag:d}: "
              f"|out-ref|={err:.4f} |lse-ref|={lerr:.5f}")
      if on_gpu:
        us, _, _ = bench.time_per_call(lambda st: (*st[:4], f(*st[:4])),
                                       (layer, q, t, lens, None), 10, {})
        line += f"  {us:8.2f} us"
      print(line, flush=True)
