"""Fingerprints of every Mosaic GPU kernel the library builds, from a CUDA lowering on any host.

For a refactor that must not change what runs on the GPU (a helper's signature, a module
split): run this before and after and diff the output. Each line is one op at one shape
(decode paths and modes, set / get, the fused RoPE write, moves) and a hash of the Mosaic
GPU modules its lowering produced, printed without debug locations, so moving code between
lines or files does not change it, nor does the order in which a process lowers them; any
change to the kernels' operations does.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=$PWD \\
        python3 benchmarks/kernel_fingerprints.py > before.txt     # then after.txt; diff

Uses a private hook of jax 0.11 (`jax._src.pallas.mosaic_gpu.lowering`); a development tool.
"""

from __future__ import annotations

import hashlib
import re
import sys

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu import lowering as _lowering

import jax_mla_cache as mc
from pallas_kernels import mla_decode as decode_kernels

_MODULES: list[str] = []
_lower = _lowering.lower_unpipelined_jaxpr_to_module


def _record(*args, **kwargs):
  result = _lower(*args, **kwargs)
  asm = result.module.operation.get_asm(enable_debug_info=False)
  # (the dump file name carries a per-process counter: not part of the kernel)
  _MODULES.append(re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", asm))
  return result


def fingerprint(fn, *args) -> str:
  """Hash of the Mosaic modules that lowering `fn(*args)` for CUDA builds (abstract args)."""
  _MODULES.clear()
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  if not _MODULES:
    return "no Mosaic kernel (a cached kernel is lowered once a process: list each shape once)"
  digest = hashlib.sha256("\n".join(_MODULES).encode()).hexdigest()[:16]
  return f"{digest} ({len(_MODULES)} module{'s' * (len(_MODULES) > 1)})"


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def cases():
  """(name, fn, abstract args) of every kernel family at shapes that pick each path."""
  i32, bf16 = jnp.int32, jnp.bfloat16
  for mode, base in (("bf16", mc.DEEPSEEK_V3), ("pth", mc.DEEPSEEK_V3_FP8)):
    for page_size, B, s_q, H, path in [(64, 64, 1, 16, "narrow"), (64, 64, 1, 16, "wide"),
                                       (32, 8, 2, 16, "narrow"), (32, 8, 4, 128, None),
                                       (64, 64, 1, 16, None), (64, 64, 2, 16, None)]:
      cfg = base.replace(size=65536 - page_size, page_size=page_size, layer_num=1)
      P = 4096 // page_size
      fn = lambda buf, q, t, n, page_size=page_size, path=path: decode_kernels.mla_decode(
          buf, q, t, n, sm_scale=0.1, page_size=page_size, kv_lora_rank=512,
          config=decode_kernels.DecodeConfig(path=path))
      yield (f"mla_decode {mode} page {page_size} B={B} s_q={s_q} H={H} path={path}", fn,
             (mc.cache_spec(cfg).layer(0), _sds((B, s_q, H, 576), bf16), _sds((B, P), i32),
              _sds((B,), i32)))
    cfg = base.replace(size=4096, layer_num=2)
    cache = mc.cache_spec(cfg)
    for T in (1, 64, 4096):
      loc = _sds((T,), i32)
      rows = (_sds((T, 1, 512), bf16), _sds((T, 1, 64), bf16))
      yield (f"set {mode} T={T}", lambda c, l, n, r: mc.set_mla_kv_buffer(
          c, 1, l, n, r, implementation="pallas"), (cache, loc, *rows))
      yield (f"get {mode} T={T}", lambda c, l: mc.get_mla_kv_buffer(
          c, 1, l, implementation="pallas"), (cache, loc))
      yield (f"rope_set {mode} T={T}", lambda c, l, p, qn, qr, kn, kr, cs: (
          mc.rope_set_mla_kv_buffer(c, 1, l, p, qn, qr, kn, kr, cs, implementation="pallas")),
             (cache, loc, loc, _sds((T, 16, 512), bf16), _sds((T, 16, 64), bf16),
              _sds((T, 1, 512), bf16), _sds((T, 1, 64), bf16), _sds((4096, 64), jnp.float32)))
    for T in (8, 2048):
      yield (f"move tokens {mode} T={T}", lambda c, t, s: mc.move_kv_cache(
          c, t, s, implementation="pallas"), (cache, _sds((T,), i32), _sds((T,), i32)))
    yield (f"move pages {mode} P=4", lambda c, t, s: mc.move_kv_pages(
        c, t, s, implementation="pallas"), (cache, _sds((4,), i32), _sds((4,), i32)))


def main(argv: list[str]) -> None:
  only = argv[0] if argv else ""
  _lowering.lower_unpipelined_jaxpr_to_module = _record
  try:
    for name, fn, args in cases():
      if only in name:
        print(f"{name}: {fingerprint(fn, *args)}", flush=True)
  finally:
    _lowering.lower_unpipelined_jaxpr_to_module = _lower


if __name__ == "__main__":
  main(sys.argv[1:])
