"""Every Pallas kernel with hostile slots (negative, >= rows, duplicates), for
`compute-sanitizer --tool memcheck`: it must report 0 errors. Also checks results
against the numpy model of the seed (rows written once) so a silent out-of-bounds write
shows up as a mismatch."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla_cache as mc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import numpy_model  # noqa: E402


def main() -> int:
  failures = 0
  rng = np.random.default_rng(3)
  decode_only = "--decode-only" in sys.argv[1:]
  for cfg in (mc.DEEPSEEK_V3.replace(size=8192 - 64, layer_num=3),
              mc.DEEPSEEK_V3_FP8.replace(size=8192 - 64, layer_num=3)):
    if decode_only:
      failures += sum(hostile_decode(cfg, rng, s_q) for s_q in (1, 2))
      continue
    rows, tokens = cfg.rows, 1000
    loc = rng.integers(0, rows, tokens).astype(np.int32)     # duplicates likely
    loc[:50] = -1
    loc[50:100] = rows + rng.integers(0, 10**6, 50)
    loc[100:110] = -rows - 1
    loc[110:120] = 0
    loc = jnp.asarray(loc)
    nope = jnp.asarray(rng.standard_normal((tokens, 1, 512)), jnp.bfloat16)
    rope = jnp.asarray(rng.standard_normal((tokens, 1, 64)), jnp.bfloat16)
    results = {}
    for impl in ("pallas", "xla"):
      cache = mc.init_cache(cfg)
      cache = mc.set_mla_kv_buffer(cache, 1, loc, nope, rope, implementation=impl)
      got = mc.get_mla_kv_buffer(cache, 1, loc, implementation=impl)
      cache = mc.move_kv_cache(cache, loc[::-1], loc, implementation=impl)
      cache = mc.move_kv_pages(cache, jnp.array([-1, 3, 10**6, 5]), jnp.array([2, -7, 1, 10**7]),
                               implementation=impl)
      results[impl] = (jax.device_get(got), jax.device_get(cache))
    (g_p, c_p), (g_x, c_x) = results["pallas"], results["xla"]
    # With duplicate targets the winner may differ; compare only rows written once.
    loc_np = np.asarray(loc)
    valid = (loc_np >= 0) & (loc_np < rows)
    vals, counts = np.unique(loc_np[valid], return_counts=True)
    once = set(vals[counts == 1].tolist())
    mask = np.array([int(v) in once for v in loc_np])
    # Each implementation's reads of rows written once, against the numpy model of the seed.
    model = numpy_model.NumpyPool(cfg)
    model.set_mla(1, loc_np, np.asarray(nope.astype(jnp.float32)),
                  np.asarray(rope.astype(jnp.float32)))
    want = model.get_mla(1, loc_np)
    bad = []
    for impl, got in (("pallas", g_p), ("xla", g_x)):
      for name, a, w in zip(("nope", "rope"), got, want):
        a, w = np.asarray(a).astype(np.float32), np.asarray(w).astype(np.float32)
        rows_bad = np.flatnonzero((a[mask] != w[mask]).any(axis=(1, 2)))
        if len(rows_bad):
          bad.append(f"{impl} get {name}: {len(rows_bad)} rows differ from the numpy model")
        if a[~valid].any():
          bad.append(f"{impl} get {name}: nonzero rows for invalid slots")
    # Informational: after the moves, rows differ where duplicate writers raced (any
    # winner is allowed) and wherever such rows were moved to.
    differ = sum(int((np.asarray(a).reshape(a.shape[0], -1).view(np.uint8)
                      != np.asarray(b).reshape(b.shape[0], -1).view(np.uint8)).any(axis=1).sum())
                 for a, b in zip(jax.tree.leaves(c_p), jax.tree.leaves(c_x)))
    print(f"  after moves: {differ} buffer rows differ between pallas and xla "
          f"({int((counts > 1).sum())} duplicate-written slots)")
    status = "ok" if not bad else "MISMATCH: " + "; ".join(bad)
    print(f"{cfg.quant_method}: hostile slots {status} ({int(valid.sum())} valid of {tokens})",
          flush=True)
    failures += bool(bad)
    failures += sum(hostile_decode(cfg, rng, s_q) for s_q in (1, 2))
  return failures


def hostile_decode(cfg, rng, s_q: int) -> int:
  """mla_decode with page ids outside the buffer (both signs, huge), zero, negative and
  huge lengths, 16 heads (s_q = 1 and 2 take different kernel paths): the kernel must read
  nothing outside the layer and equal XLA."""
  cache = mc.set_mla_kv_buffer(
      mc.init_cache(cfg), 0, jnp.arange(cfg.rows),
      jnp.asarray(rng.standard_normal((cfg.rows, 1, 512)), jnp.bfloat16),
      jnp.asarray(rng.standard_normal((cfg.rows, 1, 64)), jnp.bfloat16))
  npages = cfg.rows // cfg.page_size
  B, P = 16, 40
  table = rng.integers(0, npages, (B, P)).astype(np.int32)
  table[:, ::3] = npages + rng.integers(0, 10**6, (B, (P + 2) // 3))
  table[:, 1::5] = -rng.integers(1, 10**6, (B, (P + 3) // 5))
  table[3] = npages                               # a sequence of only bad pages
  lens = rng.integers(1, P * cfg.page_size, (B,)).astype(np.int32)
  lens[:3] = (0, -5, 2**31 - 1)
  q = jnp.asarray(rng.standard_normal((B, s_q, 16, 576)) * 0.1, jnp.bfloat16)
  out = {impl: jax.device_get(mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.05,
                                            implementation=impl))
         for impl in ("pallas", "xla")}
  (o_p, l_p), (o_x, l_x) = out["pallas"], out["xla"]
  o_p, o_x = np.asarray(o_p, np.float32), np.asarray(o_x, np.float32)
  err = np.sqrt(((o_p - o_x) ** 2).sum() / max((o_x ** 2).sum(), 1e-30))
  same_empty = np.array_equal(np.isneginf(l_p), np.isneginf(l_x))
  ok = err < 1e-2 and same_empty and np.all(o_p[np.isneginf(l_x)] == 0)
  print(f"{cfg.quant_method}: hostile mla_decode s_q={s_q} {'ok' if ok else 'MISMATCH'} "
        f"(relative RMS {err:.2e}, empty queries agree: {same_empty})", flush=True)
  return int(not ok)


if __name__ == "__main__":
  raise SystemExit(1 if main() else 0)
