"""A/B of mla_decode_parts.ZERO_MASKED (rows past the length / on masked pages zeroed before
the value product) on the H200: lengths that end mid-block (the zeroing runs once per
sequence and split) and whole blocks (only the scalar test runs). Each case twice per flag.
On CPU: tiny shapes, correctness only."""
import os
# Several CPU devices: interpret mode on one can hang (pallas_kernels.common.InterpretWarning).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
import jax_mla_cache as mc
from jax_mla_cache import bench
from pallas_kernels import mla_decode as kernel, mla_decode_parts as parts

on_gpu = jax.default_backend() == "gpu"
cases = ([("bf16", "narrow", 64, 1, 16, 4096), ("bf16", "narrow", 64, 2, 16, 4096),
          ("pth", "converter", 64, 1, 16, 4096), ("pth", "narrow", 64, 2, 16, 4096),
          ("bf16", "wide", 128, 2, 128, 4096), ("pth", "wide", 128, 2, 128, 4096),
          ("bf16", "narrow", 128, 1, 16, 1024)]
         if on_gpu else [(m, p, 2, s, 16, 200) for m, p, s in
                         [("pth", "narrow", 2), ("bf16", "narrow", 1), ("bf16", "wide", 4),
                          ("pth", "converter", 1)]])
base = mc.DEEPSEEK_V3.replace(layer_num=1)
for mode, path, B, s_q, H, ctx in cases:
  rng = np.random.default_rng(0)
  pages = ctx // base.page_size + 1
  table, full, q = bench.decode_problem(rng, base, B, s_q, H, ctx)
  cfg = (base.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head") if mode == "pth"
         else base).replace(size=B * pages * base.page_size)
  cache = bench.decode_cache(cfg)
  layer = cache.layer(0)
  for tail, lens in (("mid-block", full - 17), ("whole", full)):
    ref_out, ref_lse = mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.07,
                                     implementation="xla")
    for zero in ((True, False, True, False) if on_gpu else (True,)):
      parts.ZERO_MASKED = zero
      kernel.common._cached_kernel_fn.cache_clear()
      config = kernel.DecodeConfig(path=path)
      f = jax.jit(lambda layer, q, t, n: kernel.mla_decode(
          layer, q, t, n, sm_scale=0.07, page_size=cfg.page_size, kv_lora_rank=512,
          config=config))
      out, lse = f(layer, q, table, lens)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
      lerr = float(jnp.max(jnp.abs(jnp.where(jnp.isinf(ref_lse), 0, lse - ref_lse))))
      line = (f"{mode:4s} {path:9s} B={B} s_q={s_q} H={H} ctx={ctx} {tail:9s} zero={zero:d}: "
              f"|out-ref|={err:.4f} |lse-ref|={lerr:.5f}")
      if on_gpu:
        us, _, _ = bench.time_per_call(lambda st: (*st[:4], f(*st[:4])),
                                       (layer, q, table, lens, None), 10, {})
        line += f"  {us:8.2f} us"
      print(line, flush=True)
