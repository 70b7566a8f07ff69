"""GPU diagnostics (one device call): per_token_head bits against the numpy model, and
the host tier's costs (fresh vs recycled pinned buffers, donation of host buffers).

    PYTHONPATH=$PWD python3 benchmarks/diag_gpu.py [pth] [offload]
"""

import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import numpy_model  # noqa: E402


def pth_bits():
  """Stored (q, scale, rope) of rows written once, each implementation vs the numpy model."""
  cfg = mc.DEEPSEEK_V3_FP8.replace(size=8192 - 64, layer_num=1)
  rows = cfg.rows
  for kind in ("distinct", "hostile"):
    for tokens in (1000, 4096):
      rng = np.random.default_rng(tokens)
      if kind == "distinct":
        loc = rng.permutation(rows)[:tokens].astype(np.int32)
      else:
        loc = rng.integers(0, rows, tokens).astype(np.int32)
        loc[:50] = -1
        loc[50:100] = rows + 5
        loc[110:120] = 0
      nope = rng.standard_normal((tokens, 1, 512)).astype(np.float32)
      rope = rng.standard_normal((tokens, 1, 64)).astype(np.float32)
      nope_b = jnp.asarray(nope, jnp.bfloat16)
      rope_b = jnp.asarray(rope, jnp.bfloat16)
      q_m, s_m, r_m = numpy_model.quantize(np.asarray(nope_b.astype(jnp.float32)),
                                           np.asarray(rope_b.astype(jnp.float32)), jnp.bfloat16)
      valid = (loc >= 0) & (loc < rows)
      vals, counts = np.unique(loc[valid], return_counts=True)
      once = set(vals[counts == 1].tolist())
      tok = np.array([t for t in range(tokens) if int(loc[t]) in once])
      for impl in ("pallas", "xla"):
        cache = mc.set_mla_kv_buffer(mc.init_cache(cfg), 0, jnp.asarray(loc), nope_b, rope_b,
                                     implementation=impl)
        q, s, r = (np.asarray(b) for b in cache.layer(0))
        report = []
        for name, got, want in (("q", q, q_m), ("scale", s, s_m), ("rope", r, r_m)):
          g = got[loc[tok]].view(np.uint8) if got.dtype.itemsize == 1 else got[loc[tok]]
          w = want[tok].view(np.uint8) if want.dtype.itemsize == 1 else want[tok]
          g = g.reshape(len(tok), -1).view(np.uint8)
          w = np.ascontiguousarray(w).reshape(len(tok), -1).view(np.uint8)
          bad = np.argwhere(g != w)
          report.append(f"{name}: {len(np.unique(bad[:, 0])) if len(bad) else 0} rows bad")
          if len(bad) and name == "rope":
            for t_i in np.unique(bad[:, 0])[:4]:
              t = tok[t_i]
              gr = got[loc[t], 0].astype(np.float32)
              wr = want[t, 0].astype(np.float32)
              el = np.flatnonzero(gr != wr)
              print(f"    {impl} token {t} (block pos {t % 64}, loc {loc[t]}): elements {el[:12]}"
                    f" got {gr[el[:4]]} want {wr[el[:4]]} scale got {s[loc[t]].ravel()}"
                    f" want {s_m[t].ravel()}", flush=True)
        print(f"  pth {kind:8s} T={tokens:<5d} {impl:6s}: " + ", ".join(report), flush=True)


def offload_costs():
  cfg = mc.DEEPSEEK_V3.replace(size=2**16 - 64)
  if jax.devices()[0].platform == "cpu":  # a smoke run of the script
    cfg = cfg.replace(layer_num=2, size=8192 - 64)
  cache = mc.init_cache(cfg)
  idx = jnp.arange(4096, dtype=jnp.int32)
  nbytes = 4096 * cfg.row_bytes * cfg.layer_num
  gbps = lambda s: f"{nbytes / s / 1e9:7.1f} GB/s"

  def timed(label, fn, reps=5):
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      out = fn()
      t1 = time.perf_counter()
      jax.block_until_ready(out)
      times.append((t1 - t0, time.perf_counter() - t0))
    issue, total = np.median([t[0] for t in times]), np.median([t[1] for t in times])
    print(f"  {label:34s} issue {issue * 1e3:8.2f} ms  total {total * 1e3:8.2f} ms  {gbps(total)}",
          flush=True)
    return out

  dev = jax.devices()[0]
  host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  dev_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  blob = jnp.ones((nbytes // 2,), jnp.bfloat16)
  t0 = time.perf_counter()
  hb = jax.device_put(blob, host_s).block_until_ready()
  print(f"  first pinned device_put: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
  timed("device_put d2h pinned (fresh)", lambda: jax.device_put(blob, host_s))
  timed("device_put h2d", lambda: jax.device_put(hb, dev_s))
  t0 = time.perf_counter()
  host = mc.get_cpu_copy(cache, idx).block_until_ready()
  print(f"  first get_cpu_copy (compile+alloc): {(time.perf_counter() - t0) * 1e3:.1f} ms")
  timed("get_cpu_copy fresh", lambda: mc.get_cpu_copy(cache, idx))
  state = {"h": host}

  def reuse():
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      old = jax.tree.leaves(state["h"])
      state["h"] = mc.get_cpu_copy(cache, idx, reuse=state["h"])
      if w:
        print("    warning:", str(w[0].message)[:200])
      state["deleted"] = all(x.is_deleted() for x in old)
    return state["h"]

  timed("get_cpu_copy reuse", reuse)
  print(f"  reuse consumed the old host buffers: {state['deleted']}")

  def delete_then_fresh():
    for x in jax.tree.leaves(state["h"]):
      x.delete()
    state["h"] = mc.get_cpu_copy(cache, idx)
    return state["h"]

  timed("delete old, then fresh", delete_then_fresh)
  st = {"c": cache}

  def load():
    st["c"] = mc.load_cpu_copy(st["c"], state["h"], idx)
    return st["c"]

  timed("load_cpu_copy", load)


if __name__ == "__main__":
  parts = sys.argv[1:] or ["pth", "offload"]
  print(f"diag on {jax.devices()[0].device_kind}", flush=True)
  if "pth" in parts:
    pth_bits()
  if "offload" in parts:
    offload_costs()
