"""Paged MLA decode attention that reads the cache in place (SPEC §7).

`mla_decode(cache, layer_id, q, page_table, seq_lens, *, sm_scale)` is the absorbed
("weight-absorbed", FlashMLA-style) decode attention of DeepSeek-V2/V3: it runs in the
latent space over the layer's cached rows, addressed through a page table, and never
gathers them into a copy (the Pallas kernel; the XLA reference does gather).

Equivalent plain JAX (plain bf16 cache, one sequence b, query j, head h)::

    n = min(seq_lens[b], P * page_size)
    pos = arange(P * page_size)
    rows = page_table[b, pos // page_size] * page_size + pos % page_size
    k = kv[rows, 0].astype(f32)                     # (P*page_size, R+Rr); v = k[:, :R]
    s = sm_scale * k @ q[b, j, h].astype(f32)
    s = where((pos <= n - s_q + j) & page_in_range, s, -inf)
    out[b, j, h] = softmax(s) @ k[:, :R];  lse[b, j, h] = logsumexp(s)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_mla_cache import dispatch
from jax_mla_cache.state import MLAKVCache
from pallas_kernels import exact

F32 = jnp.float32
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------- reference
def positions_rows(page_table: jax.Array, page_size: int, rows: int):
  """Rows of every position of every sequence, and whether its page is in range.

  page_table (B, P) int -> (rows (B, P*page_size) int32 with -1 where the page id is
  outside [0, rows // page_size), valid (B, P*page_size) bool).
  """
  n_pages = rows // page_size
  ok = (page_table >= 0) & (page_table < n_pages)
  pages = jnp.where(ok, page_table, 0).astype(jnp.int32)
  offsets = jnp.arange(page_size, dtype=jnp.int32)
  B, P = page_table.shape
  row = (pages[:, :, None] * page_size + offsets).reshape(B, P * page_size)
  valid = jnp.broadcast_to(ok[:, :, None], (B, P, page_size)).reshape(B, P * page_size)
  return jnp.where(valid, row, -1), valid


def mla_decode_reference(
    buffers: tuple[jax.Array, ...], q: jax.Array, page_table: jax.Array, seq_lens: jax.Array,
    *, sm_scale: float, page_size: int, kv_lora_rank: int,
) -> tuple[jax.Array, jax.Array]:
  """SPEC §7 in plain XLA: gather the row of every position by the page table (zeros for
  masked pages and positions past the length), then a masked softmax in float32.
  `buffers`: `(kv,)` plain or `(nope, scale, rope)` per_token_head.

  q (B, s_q, H, R+Rr); page_table (B, P) int32; seq_lens (B,) int32.
  Returns (out (B, s_q, H, R) q.dtype, lse (B, s_q, H) float32).
  """
  from jax_mla_cache import reference

  B, s_q, H, W = q.shape
  R = kv_lora_rank
  rows = buffers[0].shape[0]
  L = page_table.shape[1] * page_size
  row, valid = positions_rows(page_table, page_size, rows)
  lens = jnp.clip(seq_lens, 0, L).astype(jnp.int32)
  pos = jnp.arange(L, dtype=jnp.int32)
  # Positions past the length read zeros, not the rows their pages hold there (stale or
  # garbage rows: they enter the value product with weight 0, and 0 x NaN is NaN).
  flat = jnp.where(pos[None, :] < lens[:, None], row, -1).reshape(-1)
  if len(buffers) == 3:
    nope, scale, rope = (reference.gather_rows(x, flat) for x in buffers)
    k = jnp.concatenate([nope.astype(F32), rope.astype(F32)], -1) * scale.astype(F32)
  else:
    k = reference.gather_rows(buffers[0], flat).astype(F32)
  k = k.reshape(B, L, W)
  limit = lens[:, None] - s_q + jnp.arange(s_q, dtype=jnp.int32)[None, :]      # (B, s_q)
  visible = (pos[None, None, :] <= limit[:, :, None]) & valid[:, None, :]      # (B, s_q, L)
  s = jnp.einsum("bjhd,bld->bjhl", q.astype(F32), k, precision=lax.Precision.HIGHEST)
  s = jnp.where(visible[:, :, None, :], s * jnp.float32(sm_scale), -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m_safe)
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("bjhl,blr->bjhr", p, k[..., :R], precision=lax.Precision.HIGHEST)
  has = l > 0
  out = jnp.where(has[..., None], out / jnp.where(has, l, 1.0)[..., None], 0.0)
  lse = jnp.where(has, m_safe[..., 0] + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
  return out.astype(q.dtype), lse


# ----------------------------------------------------------------- validation
def _check_integers(x: Any, name: str, op: str):
  if not hasattr(x, "dtype"):
    x = np.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {x.dtype}")
  return x


def _lengths_to_int32(lengths: Any, max_len: int) -> jax.Array:
  """Sequence lengths clamped to [0, max_len] in their own width, then int32 (a 64-bit
  length never wraps)."""
  if isinstance(lengths, (np.ndarray, np.generic)):
    return jnp.asarray(np.clip(lengths, 0, max_len).astype(np.int32))
  with jax.enable_x64(True):
    return jnp.clip(lengths, 0, max_len).astype(jnp.int32)


def check_sm_scale(sm_scale: Any, op: str) -> float:
  """`sm_scale` as a finite Python float (it is static: part of what compiles), or a
  TypeError / ValueError naming it."""
  if isinstance(sm_scale, jax.core.Tracer):
    raise TypeError(f"{op}: sm_scale must be a Python float (static), got a traced value")
  if isinstance(sm_scale, (str, bytes)) or np.ndim(sm_scale) != 0:
    raise TypeError(f"{op}: sm_scale must be a float, got {type(sm_scale).__name__} "
                    f"{sm_scale!r}")
  try:
    value = float(sm_scale)
  except (TypeError, ValueError):
    raise TypeError(f"{op}: sm_scale must be a float, got {type(sm_scale).__name__} "
                    f"{sm_scale!r}") from None
  if not np.isfinite(value):
    raise ValueError(f"{op}: sm_scale must be finite, got {value}")
  return value


def check_decode_args(cache: MLAKVCache, q, page_table, seq_lens, op: str):
  """Check `mla_decode`'s arrays against `cache.config` (only its geometry is read) and
  return (page_table int32 (B, P), seq_lens int32 (B,)): page ids outside int32 become -1
  (masked), lengths are clamped to [0, P * page_size] in their own width. Run it on host
  values before a jit: inside one a numpy int64 array is already narrowed to int32."""
  cfg = cache.config
  if not hasattr(q, "shape") or not hasattr(q, "dtype"):
    raise TypeError(f"{op}: q must be an array, got {type(q).__name__}")
  W = cfg.kv_cache_dim
  if q.ndim != 4 or q.shape[-1] != W:
    raise ValueError(f"{op}: q must have shape (B, s_q, H, {W}) (R+Rr = {cfg.kv_lora_rank}+"
                     f"{cfg.qk_rope_head_dim}), got {tuple(q.shape)}")
  if jnp.dtype(q.dtype) not in Q_DTYPES:
    raise TypeError(f"{op}: q must be bfloat16, float16 or float32, got {q.dtype}")
  B = q.shape[0]
  for name, x, ndim in (("page_table", page_table, 2), ("seq_lens", seq_lens, 1)):
    shape = getattr(x, "shape", np.shape(x))
    if len(shape) != ndim or shape[0] != B:
      want = "(B, P)" if ndim == 2 else "(B,)"
      raise ValueError(f"{op}: {name} must have shape {want} with B = q.shape[0] = {B}, "
                       f"got {tuple(shape)}")
  if np.shape(page_table)[1] == 0:
    raise ValueError(f"{op}: page_table must have at least one column, got shape "
                     f"{tuple(np.shape(page_table))}")
  max_len = np.shape(page_table)[1] * cfg.page_size
  # Page ids beyond int32 become -1; every id outside [0, rows // page_size) is masked by
  # the reference and the kernel alike.
  page_table = jnp.asarray(exact.index_to_int32(_check_integers(page_table, "page_table", op)))
  seq_lens = _lengths_to_int32(_check_integers(seq_lens, "seq_lens", op), max_len)
  return page_table, seq_lens


# ----------------------------------------------------------------- the op
@functools.partial(jax.jit, static_argnames=("layer_id", "sm_scale", "implementation"))
def _mla_decode(cache, layer_id, q, page_table, seq_lens, *, sm_scale, implementation=None):
  op = "mla_decode"
  cfg = cache.config
  page_table, seq_lens = check_decode_args(cache, q, page_table, seq_lens, op)
  q = exact.as_stored(q)   # q's own values, not a jitted producer's unrounded ones
  args = dict(sm_scale=sm_scale, page_size=cfg.page_size, kv_lora_rank=cfg.kv_lora_rank)

  def attend(backend, buffers, q, page_table, seq_lens):
    if backend is dispatch.reference:
      return mla_decode_reference(buffers, q, page_table, seq_lens, **args)
    from pallas_kernels import mla_decode as kernel
    return kernel.mla_decode(buffers, q, page_table, seq_lens, **args)

  return dispatch._run(op, dispatch.implementation_order(implementation), attend,
                       cache.layer(layer_id), q, page_table, seq_lens)


def mla_decode(
    cache: MLAKVCache,
    layer_id: int,
    q: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """Paged absorbed-MLA decode attention over layer `layer_id`'s cache (SPEC §7).

  Args:
    cache: the state (read, not donated): an `MLAKVCache` or a `StackedMLAKVCache`.
    layer_id: static layer index (a `StackedMLAKVCache` also takes a traced one).
    q: (B, s_q, H, R+Rr) absorbed queries `[q_nope @ W_UK | rope(q_rope)]`, bf16 or f16
      (f32 on the XLA path). The kernel needs q in the cache's dtype (plain) or in
      `model_dtype` (per_token_head).
    page_table: (B, P) integer page ids; position p of sequence b is row
      `page_table[b, p // page_size] * page_size + p % page_size`. Ids outside
      `[0, rows // page_size)` (any integer width) are masked out and never read.
    seq_lens: (B,) tokens of each sequence in the cache, its s_q newest included;
      clamped to `[0, P * page_size]`.
    sm_scale: the softmax scale, a Python float (static).
    implementation: None (the Mosaic GPU kernel on sm_90+ when it takes the shapes,
      else XLA with a one-time `FallbackWarning`), "xla" or "pallas" (raises
      `pallas_kernels.Unsupported`, a NotImplementedError, when the kernel does not take
      the call).
  Returns:
    (out (B, s_q, H, R) in q.dtype, lse (B, s_q, H) float32, natural log). Query j of a
    sequence sees positions `0 .. seq_lens - s_q + j`; one with none visible gets out 0
    and lse -inf.
  """
  dispatch.check_cache(cache, "mla_decode", stacked=True)
  layer_id = dispatch.check_layer_id(cache, layer_id, "mla_decode")
  sm_scale = check_sm_scale(sm_scale, "mla_decode")
  # Host integers are range-checked here, in their own width: inside the jit a numpy
  # int64 array would already have been narrowed to int32 (2**32 + 5 -> 5).
  page_table, seq_lens = check_decode_args(cache, q, page_table, seq_lens, "mla_decode")
  return dispatch.on_layer(_mla_decode, cache, layer_id, q, page_table, seq_lens,
                           pages_at=1, sm_scale=sm_scale, implementation=implementation)
