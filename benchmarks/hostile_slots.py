"""Every Pallas kernel with hostile slots (negative, >= rows, duplicates), for
`compute-sanitizer --tool memcheck`: it must report 0 errors (`--decode-only`: mla_decode
only; `--wide-only`: its wide path alone; `--rope-only`: rope_set only; `--set-only`: the
set at small T, where per_token_head takes the one-token kernel). Also checks
results against the numpy model of the seed (rows written once) so a silent out-of-bounds
write shows up as a mismatch."""

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
  wide_only = "--wide-only" in sys.argv[1:]     # mla_decode at 128 query rows alone
  rope_only = "--rope-only" in sys.argv[1:]
  set_only = "--set-only" in sys.argv[1:]
  for cfg in (mc.DEEPSEEK_V3.replace(size=8192 - 64, layer_num=3),
              mc.DEEPSEEK_V3_FP8.replace(size=8192 - 64, layer_num=3)):
    if wide_only:
      failures += hostile_decode(cfg, rng, 2, H=64)
      continue
    if decode_only:
      failures += sum(hostile_decode(cfg, rng, s_q) for s_q in (1, 2))
      failures += hostile_decode(cfg, rng, 2, H=64)
      failures += hostile_decode(cfg, rng, 1, B=64)   # 2 splits (merged by XLA)
      continue
    failures += sum(hostile_set(cfg, rng, T) for T in (1, 3, 200))
    if set_only:
      continue
    failures += sum(hostile_rope_set(cfg, rng, T) for T in (1, 3, 300))
    if rope_only:
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


def hostile_set(cfg, rng, T: int) -> int:
  """set_mla_kv_buffer of T distinct tokens, a third of them with slots outside the layer
  (both signs, huge): the kernel writes nothing else and its cache bytes equal XLA's."""
  loc = rng.choice(cfg.rows, T, replace=False).astype(np.int32)
  loc[::3] = rng.choice([-1, -7, cfg.rows, cfg.rows + 10**6, 2**31 - 1], (T + 2) // 3)
  nope = jnp.asarray(rng.standard_normal((T, 1, 512)), jnp.bfloat16)
  rope = jnp.asarray(rng.standard_normal((T, 1, 64)), jnp.bfloat16)
  caches = [jax.device_get(mc.set_mla_kv_buffer(mc.init_cache(cfg), 1, jnp.asarray(loc), nope,
                                                rope, implementation=impl))
            for impl in ("pallas", "xla")]
  same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
             for a, b in zip(*map(jax.tree.leaves, caches)))
  print(f"{cfg.quant_method}: hostile set T={T} {'ok' if same else 'MISMATCH'}", flush=True)
  return not same


def hostile_rope_set(cfg, rng, T: int) -> int:
  """rope_set_mla_kv_buffer with slots outside the layer (both signs, huge) and positions
  outside the cos/sin table: the kernel must write nothing outside the layer and equal the
  XLA composition (cache bytes and q_out)."""
  from jax_mla_cache import rope
  H, table = 16, jnp.asarray(rope.rope_cos_sin_cache(512, 64))
  loc = rng.choice(cfg.rows, T, replace=False).astype(np.int32)
  loc[::3] = rng.choice([-1, -7, cfg.rows, cfg.rows + 10**6, 2**31 - 1], (T + 2) // 3)
  pos = rng.integers(-100, 700, T).astype(np.int32)
  args = [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
          for shape in ((T, H, 512), (T, H, 64), (T, 1, 512), (T, 1, 64))]
  out = {}
  for impl in ("pallas", "xla"):
    cache, q_out = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 1, loc, pos, *args, table,
                                             implementation=impl)
    out[impl] = jax.device_get((cache, q_out))
  (c_p, q_p), (c_x, q_x) = out["pallas"], out["xla"]
  # SPEC §8 lets the float32 rotation round differently: compare with its tolerances, and
  # require every row that no valid slot targets to stay zero.
  leaves_p, leaves_x = jax.tree.leaves(c_p), jax.tree.leaves(c_x)
  per_layer = len(leaves_p) // cfg.layer_num
  close, untouched = True, True
  for i, (a, b) in enumerate(zip(leaves_p, leaves_x)):
    targeted = np.zeros(cfg.rows, bool)
    if i // per_layer == 1:
      targeted[loc[(loc >= 0) & (loc < cfg.rows)]] = True
    a = np.asarray(a).astype(np.float32).reshape(cfg.rows, -1)
    b = np.asarray(b).astype(np.float32).reshape(cfg.rows, -1)
    close &= bool(np.allclose(a, b, rtol=2 ** -7, atol=1e-2))
    untouched &= not a[~targeted].any()
  q_err = float(np.abs(np.asarray(q_p, np.float32) - np.asarray(q_x, np.float32)).max())
  ok = close and untouched and q_err <= 0.0625
  print(f"{cfg.quant_method}: hostile rope_set T={T} {'ok' if ok else 'MISMATCH'} "
        f"(cache close: {close}, other rows zero: {untouched}, q_out max abs diff "
        f"{q_err:.3g})", flush=True)
  return int(not ok)


def hostile_decode(cfg, rng, s_q: int, H: int = 16, B: int = 16) -> int:
  """mla_decode with page ids outside the buffer (both signs, huge), zero, negative and
  huge lengths, H heads (16 heads at s_q = 1 and 2 take the registers / narrow paths; 64
  heads at s_q = 2, two 64-row M tiles, the wide path; B sequences: 16 make 8 splits on 132
  multiprocessors, 64 make 2): the kernel must read nothing outside the layer and equal
  XLA."""
  cache = mc.set_mla_kv_buffer(
      mc.init_cache(cfg), 0, jnp.arange(cfg.rows),
      jnp.asarray(rng.standard_normal((cfg.rows, 1, 512)), jnp.bfloat16),
      jnp.asarray(rng.standard_normal((cfg.rows, 1, 64)), jnp.bfloat16))
  npages = cfg.rows // cfg.page_size
  P = 40
  table = rng.integers(0, npages, (B, P)).astype(np.int32)
  table[:, ::3] = npages + rng.integers(0, 10**6, (B, (P + 2) // 3))
  table[:, 1::5] = -rng.integers(1, 10**6, (B, (P + 3) // 5))
  table[3] = npages                               # a sequence of only bad pages
  lens = rng.integers(1, P * cfg.page_size, (B,)).astype(np.int32)
  lens[:3] = (0, -5, 2**31 - 1)
  q = jnp.asarray(rng.standard_normal((B, s_q, H, 576)) * 0.1, jnp.bfloat16)
  out = {impl: jax.device_get(mc.mla_decode(cache, 0, q, table, lens, sm_scale=0.05,
                                            implementation=impl))
         for impl in ("pallas", "xla")}
  (o_p, l_p), (o_x, l_x) = out["pallas"], out["xla"]
  o_p, o_x = np.asarray(o_p, np.float32), np.asarray(o_x, np.float32)
  err = np.sqrt(((o_p - o_x) ** 2).sum() / max((o_x ** 2).sum(), 1e-30))
  same_empty = np.array_equal(np.isneginf(l_p), np.isneginf(l_x))
  ok = err < 1e-2 and same_empty and np.all(o_p[np.isneginf(l_x)] == 0)
  print(f"{cfg.quant_method}: hostile mla_decode B={B} s_q={s_q} H={H} "
        f"{'ok' if ok else 'MISMATCH'} "
        f"(relative RMS {err:.2e}, empty queries agree: {same_empty})", flush=True)
  return int(not ok)


if __name__ == "__main__":
  raise SystemExit(1 if main() else 0)
