"""Plain XLA implementation of every cache op: the reference and the portable backend.

Array-level functions (buffers in, buffers out), as the Pallas kernels in
`pallas_kernels/`; `jax_mla_cache.dispatch` picks between them. Numerics follow
SPEC §3 bit for bit, subnormals included, on every backend (`pallas_kernels.exact`):

    amax  = max(|nope|)                          (f32, per token row)
    scale = max(amax, 1e-26) * float32(1/448)    (a multiply, as PyTorch does)
    q     = clip(nope / scale, -448, 448) -> float8_e4m3fn   (true f32 division, RNE)
    rope' = (rope / scale) -> model_dtype                    (true f32 division, RNE)

Out-of-range rows (negative or >= rows, whatever the integer type) are skipped on writes
and read as zeros. Every write and move costs O(T) on every backend (`_write_rows`: XLA:CPU
has no float8 scatter, so fp8 rows are written there by a host callback in place).

`sanitize=True` on the writes (SPEC §9): NaN is stored as 0; plain storage stores values
beyond its dtype's largest finite value (+-inf included) as that value with their sign;
per_token_head replaces +-inf by the input dtype's largest finite value before quantizing
and clamps a rope quotient beyond `model_dtype`'s range to its largest finite value.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jax.experimental.buffer_callback import buffer_callback

from pallas_kernels import exact

F32 = jnp.float32
FP8_MAX = 448.0
AMAX_FLOOR = np.float32(1e-26)
INV_FP8_MAX = np.float32(1.0) / np.float32(FP8_MAX)


def cast_to_storage(x: jax.Array, dtype) -> jax.Array:
  """Cast to a storage dtype; fp8 saturates at the format's max finite value.

  Rounding is round-to-nearest-even; NaN stays NaN (SPEC §3, plain fp8 storage).
  """
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(F32), -limit, limit).astype(dtype)
  return x.astype(dtype)


def finite_max(dtype) -> float:
  """The largest finite value of a float dtype."""
  return float(jnp.finfo(dtype).max)


def sanitize_f32(x: jax.Array, limit: float) -> jax.Array:
  """SPEC §9 on float32 values: NaN -> 0, values beyond +-limit (+-inf included) -> +-limit;
  values within the limit unchanged (the kernels' `pallas_kernels.common.sanitize_f32`)."""
  return jnp.where(jnp.isnan(x), jnp.float32(0), jnp.clip(x, -limit, limit))


def quantize_per_token_head(
    nope: jax.Array, rope: jax.Array, rope_dtype, *, sanitize: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Quantize token rows as SPEC §3 (and §9 with `sanitize`, module docstring).

  Args:
    nope: (T, 1, R) any float dtype.
    rope: (T, 1, Rr) any float dtype.
    rope_dtype: storage dtype of the scaled rope (the model dtype).
    sanitize: NaN -> 0 and +-inf -> the input dtype's largest finite value before
      quantizing; rope quotients clamped to rope_dtype's largest finite value.
  Returns:
    (q (T,1,R) float8_e4m3fn, scale (T,1,1) float32, rope_stored (T,1,Rr) rope_dtype).
  """
  nope32, rope32 = nope.astype(F32), rope.astype(F32)
  if sanitize:
    nope32 = sanitize_f32(nope32, finite_max(nope.dtype))
    rope32 = sanitize_f32(rope32, finite_max(rope.dtype))
  amax = jnp.max(jnp.abs(nope32), axis=-1, keepdims=True)
  scale = jnp.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX
  q = jnp.clip(exact.divide(nope32, scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  rope_scaled = exact.divide(rope32, scale)
  if sanitize:
    limit = finite_max(rope_dtype)
    rope_scaled = jnp.clip(rope_scaled, -limit, limit)
  return q, scale, rope_scaled.astype(rope_dtype)


def dequantize_per_token_head(
    q: jax.Array, scale: jax.Array, rope_stored: jax.Array, dst_dtype
) -> tuple[jax.Array, jax.Array]:
  """Inverse of `quantize_per_token_head`: (nope (T,1,R), rope (T,1,Rr)) in dst_dtype
  (an fp8 dst_dtype saturates, like every cast to fp8 here)."""
  nope = cast_to_storage(exact.multiply(q.astype(F32), scale), dst_dtype)
  rope = cast_to_storage(exact.multiply(rope_stored.astype(F32), scale), dst_dtype)
  return nope, rope


def _masked(loc: jax.Array, rows: int) -> jax.Array:
  """Map every index outside [0, rows) to `rows`, which scatter/gather modes drop/fill.

  JAX would otherwise wrap negative indices (numpy semantics) onto real rows; 64-bit
  indices are narrowed without wrapping first (`exact.index_to_int32`).
  """
  loc = exact.index_to_int32(loc)
  return jnp.where((loc >= 0) & (loc < rows), loc, rows)


def _is_fp8(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _write_rows(buf: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
  """`buf[idx[i]] = values[i]` with `idx` from `_masked` (index `rows`: dropped); in place
  when `buf` is donated, O(T) on every backend.

  XLA:CPU supports no float8 scatter (nor dynamic-update-slice): it converts the whole
  buffer to f16 and back around one (a 1-row write into a 262144-row fp8 cache took 0.5-1 s),
  and a uint8 view does not help there (the same-width bitcast-convert is a pass over the
  whole buffer too). So on CPU fp8 rows are written by a host callback on the buffer
  itself (`jax.experimental.buffer_callback`, aliased: no copy). Lowering an fp8 write for
  several platforms at once is therefore unsupported (buffer callbacks lower for one).
  """
  if not _is_fp8(buf.dtype):
    return buf.at[idx].set(values, mode="drop")

  def xla_write(buf, idx, values):
    return buf.at[idx].set(values, mode="drop")

  def host_write(buf, idx, values):
    write = buffer_callback(_write_rows_on_host, jax.ShapeDtypeStruct(buf.shape, buf.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return write(buf, idx, values)

  return lax.platform_dependent(buf, idx, values, cpu=host_write, default=xla_write)


def _write_rows_on_host(ctx, out, buf, idx, values) -> None:
  """The CPU callback of `_write_rows`: `out` is `buf` (aliased); writes the raw bytes."""
  del ctx, buf
  out = np.asarray(out).view(np.uint8)
  idx = np.asarray(idx)
  keep = idx < out.shape[0]
  out[idx[keep]] = np.asarray(values).view(np.uint8)[keep]


def scatter_rows(buf: jax.Array, loc: jax.Array, values: jax.Array) -> jax.Array:
  """`buf[loc[i]] = values[i]` for in-range `loc`; others skipped (values cast to buf.dtype)."""
  return _write_rows(buf, _masked(loc, buf.shape[0]), values.astype(buf.dtype))


def gather_rows(buf: jax.Array, loc: jax.Array) -> jax.Array:
  """`buf[loc]`, zeros where `loc` is out of range."""
  return _read_rows(buf, _masked(loc, buf.shape[0]))


def _read_rows(buf: jax.Array, idx: jax.Array) -> jax.Array:
  """`buf[idx]` with `idx` from `_masked` (index `rows`: zeros).

  float8 rows are gathered as uint8: XLA:CPU would otherwise convert the buffer to f16 for
  the gather (fused into it, so O(T), but a whole-buffer convert in the HLO all the same).
  The buffer goes through an optimization barrier together with `idx`: in a loop body
  that reads the buffer without writing it (a `lax.scan` over layers), XLA would hoist the
  whole-buffer uint8 view out of the loop as a copy of the buffer on every call (CPU:
  36 ms instead of 0.3 at 131072 rows); tied to the loop-variant indices it stays fused
  into the gather.
  """
  if not _is_fp8(buf.dtype):
    return buf.at[idx].get(mode="fill", fill_value=0)
  buf, idx = lax.optimization_barrier((buf, idx))
  bits = lax.bitcast_convert_type(buf, jnp.uint8)
  return lax.bitcast_convert_type(bits.at[idx].get(mode="fill", fill_value=0), buf.dtype)


# ----------------------------------------------------------------- row ops
def set_rows(kv: jax.Array, loc: jax.Array, nope: jax.Array, rope: jax.Array, *,
             sanitize: bool = False) -> jax.Array:
  """Plain storage: write `[nope | rope]` cast to `kv.dtype` at rows `loc`.

  kv (rows,1,R+Rr); loc (T,) int; nope (T,1,R); rope (T,1,Rr). `sanitize`: module docstring.
  """
  def cast(x):
    if sanitize:
      x = sanitize_f32(x.astype(F32), finite_max(kv.dtype))
    return cast_to_storage(x, kv.dtype)

  return scatter_rows(kv, loc, jnp.concatenate([cast(nope), cast(rope)], axis=-1))


def set_rows_per_token_head(
    nope_buf: jax.Array, scale_buf: jax.Array, rope_buf: jax.Array,
    loc: jax.Array, nope: jax.Array, rope: jax.Array, *, sanitize: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """per_token_head storage: quantize (SPEC §3, §9 with `sanitize`) and write the three
  buffers."""
  q, scale, rope_stored = quantize_per_token_head(nope, rope, rope_buf.dtype,
                                                  sanitize=sanitize)
  return (
      scatter_rows(nope_buf, loc, q),
      scatter_rows(scale_buf, loc, scale),
      scatter_rows(rope_buf, loc, rope_stored),
  )


def get_rows(
    kv: jax.Array, loc: jax.Array, *, kv_lora_rank: int, dst_dtype
) -> tuple[jax.Array, jax.Array]:
  """Plain storage: gather rows `loc` as (nope (T,1,R), rope (T,1,Rr)) in dst_dtype."""
  rows = cast_to_storage(gather_rows(kv, loc), dst_dtype)
  return rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]


def get_rows_per_token_head(
    nope_buf: jax.Array, scale_buf: jax.Array, rope_buf: jax.Array, loc: jax.Array,
    *, dst_dtype,
) -> tuple[jax.Array, jax.Array]:
  """per_token_head storage: gather and dequantize rows `loc`."""
  return dequantize_per_token_head(
      gather_rows(nope_buf, loc), gather_rows(scale_buf, loc), gather_rows(rope_buf, loc),
      dst_dtype,
  )


# ----------------------------------------------------------------- moves
def move_rows(
    buffers: Sequence[jax.Array], tgt_loc: jax.Array, src_loc: jax.Array, *, layers: int = 1
) -> tuple[jax.Array, ...]:
  """`b[tgt[i]] = old_b[src[i]]` for every buffer (all reads before any write).

  A pair is skipped when either index is out of range. `layers`: each buffer is that many
  equal blocks of rows (a stacked cache's layers), every block moving the pairs (indices
  of a block).
  """
  if layers != 1 and buffers:
    per_layer = exact.block_rows(buffers[0].shape[0], layers)
    tgt_loc, src_loc = (exact.every_block(x, per_layer, layers) for x in (tgt_loc, src_loc))
  out = []
  for buf in buffers:
    rows = buf.shape[0]
    src = _masked(src_loc, rows)
    tgt = jnp.where(src < rows, _masked(tgt_loc, rows), rows)
    out.append(_write_rows(buf, tgt, _read_rows(buf, src)))
  return tuple(out)


def move_pages(
    buffers: Sequence[jax.Array], tgt_pages: jax.Array, src_pages: jax.Array, *,
    page_size: int, layers: int = 1,
) -> tuple[jax.Array, ...]:
  """Whole-page moves with the same snapshot semantics as `move_rows` (`layers`: page ids
  of each block of rows; a block's rows need not be a multiple of `page_size`)."""
  if not buffers:
    return ()
  per_layer = exact.block_rows(buffers[0].shape[0], layers)
  tgt, src = (exact.every_block_pages(x, page_size, per_layer, layers)
              for x in (tgt_pages, src_pages))
  return move_rows(buffers, tgt, src)
