"""Paged MLA decode attention that reads the cache in place (Mosaic GPU, Hopper wgmma).

Public function (arrays in, arrays out)::

    mla_decode(buffers, q, page_table, seq_lens, *, sm_scale, page_size, kv_lora_rank,
               num_splits=None, config=None) -> (out, lse)

* ``buffers``: the layer's cache buffers: ``(kv,)`` plain, kv (rows, 1, R+Rr) bf16/f16; or
  ``(nope, scale, rope)`` per_token_head: nope (rows, 1, R) float8_e4m3fn, scale (rows, 1, 1)
  float32, rope (rows, 1, Rr) bf16/f16.
* ``q`` (B, s_q, H, R+Rr): absorbed queries, the cache's dtype (plain) or the rope plane's
  dtype (per_token_head).
* ``page_table`` (B, P) int32, ``seq_lens`` (B,) int32 (SPEC §7: position p of sequence b is
  row ``page_table[b, p // page_size] * page_size + p % page_size``).
* Returns ``out`` (B, s_q, H, R) in q.dtype and ``lse`` (B, s_q, H) float32 (natural log).

Semantics are SPEC §7 (see ``jax_mla_cache.attention.mla_decode_reference``): keys are the
whole rows, values their first R columns; per_token_head keys/values are dequantized by
the row's scale, which the kernels fold into the scores and the softmax weights instead of
dequantizing (they read 644 bytes per token instead of 1152). Query j of a sequence sees
positions ``0 .. seq_lens - s_q + j``. Page ids outside ``[0, rows // page_size)`` are
replaced by page 0 before the kernel (so every copy stays inside the buffer) and their
positions are masked out of the softmax.

Three kernel paths, tried in this order (the first that takes the call runs; each module's
``takes`` says why not):

1. ``mla_decode_registers`` -- per_token_head with at most 16 query rows: as narrow, but the
   score and value products take the fp8 block from registers, converted as it is loaded
   (no converted tile in shared memory).
2. ``mla_decode_narrow`` -- at most 32 query rows (s_q x H) per sequence, e.g. DeepSeek-V3's
   16 heads per GPU under 8-way tensor parallelism: the tokens are the wgmma M dimension and
   the query rows its N (S^T = K Q^T, out^T = V^T P^T), so nothing is padded to 64 rows and
   the score product is computed once.
3. ``mla_decode_wide`` -- any number of query rows: the query rows are the M dimension in
   tiles of 64 (the compute-bound case: H=128).

All: one program per (M tile, split, sequence) whose TMA copies follow the page table
(compute warpgroup 1 in the registers and narrow paths, 0 in the wide path; no producer
warpgroup) and two wgmma compute warpgroups; online softmax; flash-decoding splits
(ranges computed on the device from seq_lens) merged here by their lse.
``DecodeConfig(path=...)`` forces one path (benchmarks and tests).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import F32

FP8_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BLOCK_KV = 64       # tokens per KV block
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MASKED = 1 << 30    # added to positions that must stay invisible
PATHS = ("registers", "narrow", "wide")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static tiling of the decode kernels.

  Attributes:
    stages: KV blocks in flight (shared-memory ring depth); None: the path's own (2 for
      "narrow" and "wide"; "registers": the deepest ring that fits, at most 4).
    num_sms: multiprocessors to fill when choosing the split count (None: the device's).
    path: one of `PATHS` to force it (None: the first that takes the call).
  """

  stages: int | None = None
  num_sms: int | None = None
  path: str | None = None


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static shapes of one call, shared by the kernel paths."""

  B: int
  s_q: int
  H: int
  R: int
  Rr: int
  P: int
  page_size: int
  rows: int
  quantized: bool
  dtype: jnp.dtype

  @property
  def QR(self) -> int:
    """Query rows per sequence."""
    return self.s_q * self.H

  @property
  def max_blocks(self) -> int:
    return max(1, -(-self.P * self.page_size // BLOCK_KV))


def check_supported(buffers, q, *, page_size: int, kv_lora_rank: int) -> str | None:
  """None when a kernel path handles this call, else a reason (for the dispatch fall-through)."""
  qd = jnp.dtype(q.dtype)
  if qd not in Q_DTYPES:
    return f"q dtype {qd} (the kernel takes bf16 or f16)"
  if len(buffers) == 3:
    store = jnp.dtype(buffers[2].dtype)
    what = "rope plane"
  else:
    store = jnp.dtype(buffers[0].dtype)
    what = "cache"
  if store != qd:
    return f"q dtype {qd} differs from the {what}'s {store}"
  R, Rr = kv_lora_rank, q.shape[-1] - kv_lora_rank
  if R <= 0 or Rr <= 0 or R % 128 or Rr % 64:
    return f"row widths R={R}, Rr={Rr} (the kernel needs R % 128 == 0 and Rr % 64 == 0)"
  if not (page_size % BLOCK_KV == 0 or (BLOCK_KV % page_size == 0 and page_size % 8 == 0)):
    return f"page_size {page_size} (the kernel needs 8, 16, 32 or a multiple of 64)"
  if len(buffers) == 3 and page_size < 32:
    # A page's scales arrive by one TMA copy into shared memory, whose destination must be
    # 128-byte aligned: 32 float32 scales or more (seen on the H200 as a misaligned address
    # with page_size 16).
    return f"page_size {page_size} with per_token_head (the kernel needs 32 or a multiple of 64)"
  return None


def split_count(batch: int, m_tiles: int, max_blocks: int, num_sms: int) -> int:
  """Programs per (sequence, M tile): enough to fill `num_sms` in about one wave."""
  per_split = batch * m_tiles
  if per_split >= num_sms // 2:
    return 1
  return int(max(1, min(num_sms // per_split, max_blocks)))


def num_sms(config: DecodeConfig) -> int:
  """Multiprocessors to fill: the config's, the GPU's, or an H100/H200's 132."""
  if config.num_sms is not None:
    return config.num_sms
  try:
    device = jax.devices()[0]
    if device.platform == "gpu":
      return int(device.core_count)
  except (RuntimeError, AttributeError):
    pass
  return 132


def _path(name: str):
  if name not in PATHS:
    raise ValueError(f"DecodeConfig.path must be one of {PATHS} or None, got {name!r}")
  return importlib.import_module(f"pallas_kernels.mla_decode_{name}")


def make_meta(page_table, seq_lens, *, n_pages: int, page_size: int):
  """The kernels' one page-table operand (B, P + 2) int32 (`mla_decode_parts.PageTable`)
  from the user's page table (B, P) and lengths (B,), in one XLA fusion. Any integer
  dtype: ids are range-checked before any narrowing, so 64-bit ids cannot wrap into
  range."""
  P = page_table.shape[1]
  pages = jnp.where((page_table >= 0) & (page_table < n_pages), page_table, -1)
  lens = jnp.clip(seq_lens, 0, P * page_size)
  under = jnp.arange(P)[None, :] * page_size < lens[:, None]
  n_masked = jnp.sum((pages < 0) & under, axis=1)
  return jnp.concatenate([pages.astype(jnp.int32), lens.astype(jnp.int32)[:, None],
                          n_masked.astype(jnp.int32)[:, None]], axis=1)


def mla_decode(buffers, q, page_table, seq_lens, *, sm_scale: float, page_size: int,
               kv_lora_rank: int, num_splits: int | None = None,
               config: DecodeConfig | None = None):
  """Paged absorbed-MLA decode attention over one layer's cache (module docstring).

  Args:
    buffers: ``(kv,)`` or ``(nope, scale, rope)`` (rows, 1, width) cache buffers.
    q: (B, s_q, H, R+Rr) bf16/f16.
    page_table: (B, P) int32; entries outside [0, rows // page_size) are masked.
    seq_lens: (B,) int32; clamped to [0, P * page_size].
    sm_scale: softmax scale (a Python float).
    page_size: tokens per page.
    kv_lora_rank: R.
    num_splits: programs per sequence and M tile (None: `split_count`).
    config: `DecodeConfig` (None: defaults).
  Returns:
    (out (B, s_q, H, R) q.dtype, lse (B, s_q, H) float32).
  Raises:
    common.Unsupported: no kernel path takes the call (the reason says why).
  """
  config = config or DecodeConfig()
  reason = check_supported(buffers, q, page_size=page_size, kv_lora_rank=kv_lora_rank)
  if reason is not None:
    raise common.Unsupported(reason)
  B, s_q, H, W = q.shape
  rows = buffers[0].shape[0]
  geo = Geometry(B=B, s_q=s_q, H=H, R=kv_lora_rank, Rr=W - kv_lora_rank,
                 P=page_table.shape[1], page_size=page_size, rows=rows,
                 quantized=len(buffers) == 3, dtype=jnp.dtype(q.dtype))
  order = (config.path,) if config.path else PATHS
  reasons = []
  for name in order:
    module = _path(name)
    why = module.takes(geo, config)
    if why is None:
      break
    reasons.append(f"{name}: {why}")
  else:
    raise common.Unsupported("; ".join(reasons))

  meta = make_meta(page_table, seq_lens, n_pages=rows // page_size, page_size=page_size)
  if geo.quantized:
    nope, scale, rope = buffers
    operands = (nope.reshape(rows, geo.R), scale.reshape(rows), rope.reshape(rows, geo.Rr))
  else:
    operands = (buffers[0].reshape(rows, W),)
  out, lse = module.run(geo, config, operands, q.reshape(B, geo.QR, W), meta,
                        sm_scale=float(sm_scale),
                        num_splits=num_splits)
  return out.reshape(B, s_q, H, geo.R), lse.reshape(B, s_q, H)


UNROLLED_SPLITS = 8   # `combine` merges up to this many splits with elementwise ops only


def finish_lse_merge(m, den, num, per_row=lambda x: x[..., None]):
  """The last step of merging partial attention results by their lse: from the largest lse
  `m` (0 where every part saw nothing), the weights' sum `den` = sum_s exp(lse_s - m) and
  the weighted sum `num` = sum_s exp(lse_s - m) out_s (float32), returns (num / den, 0 where
  den is 0; lse = m + ln den, -inf there). `per_row` broadcasts a (.., Q) value against
  `num`. Used by `combine` (splits) and the context-parallel merge over ranks."""
  has = den > 0
  merged = num * per_row(jnp.where(has, 1.0 / jnp.where(has, den, 1.0), 0.0))
  return merged, jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)


def combine(out, lse, dtype, *, rows_last: bool = False, transpose: bool = True):
  """Merge the splits' partial results by their lse.

  Args:
    out: (B, S, Q, R) partial outputs, or (B, S, R, Q) with ``rows_last``.
    lse: (B, S, Q) float32 (natural log; -inf for a split that saw nothing).
    dtype: the result's dtype.
    transpose: with ``rows_last``, return (B, Q, R) (else (B, R, Q), as out came).
  Returns:
    (out (B, Q, R) dtype, lse (B, Q) float32).
  """
  S = out.shape[1]
  swap = rows_last and transpose
  if S == 1:
    merged = out[:, 0]
    return (merged.swapaxes(1, 2) if swap else merged), lse[:, 0]

  def per_row(x):   # (B, Q) -> broadcastable against one split's (B, Q, R) / (B, R, Q)
    return x[:, None, :] if rows_last else x[..., None]

  # merged = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max_s lse_s).
  if S <= UNROLLED_SPLITS:
    # The splits unrolled: the max, the weights, their sum and the weighted sum are all
    # elementwise, so XLA fuses the merge into one pass over `out` (reductions over S are
    # separate small kernels, ~1.2 us each on the H200).
    parts = [lse[:, s] for s in range(S)]
    m = functools.reduce(jnp.maximum, parts)
    m = jnp.where(jnp.isneginf(m), 0.0, m)                   # every split empty: weights 0
    weights = [jnp.exp(part - m) for part in parts]
    den = functools.reduce(jnp.add, weights)
    num = functools.reduce(jnp.add, (per_row(w) * out[:, s].astype(F32)
                                     for s, w in enumerate(weights)))
  else:
    m = lse.max(axis=1)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    weights = jnp.exp(lse - m[:, None])
    den = weights.sum(axis=1)
    # A float32 multiply + reduce rather than an einsum, which XLA may lower to a dot at its
    # default (not full float32) precision.
    split_rows = weights[:, :, None, :] if rows_last else weights[..., None]
    num = (split_rows * out.astype(F32)).sum(axis=1)
  merged, total = finish_lse_merge(m, den, num, per_row)
  if swap:
    merged = merged.swapaxes(1, 2)
  return merged.astype(dtype), total
