"""`rope_set_mla_kv_buffer`: the decode write of one layer in one launch (SPEC §8).

Rotates `q_rope` and `k_rope` by the positions' rows of a cos/sin table, writes the latent
row `[k_nope | rope(k_rope)]` at the slots `loc` (cast, or quantized per token as SPEC §3)
and returns the absorbed query `q_out = [q_nope | rope(q_rope)]` that `mla_decode`-style
attention takes. `implementation="pallas"` (the default on sm_90+ GPUs) is one Mosaic GPU
kernel (`pallas_kernels.rope_set`); `"xla"` is the unfused composition, the reference:

    k_rot = rope.apply_rope(k_rope, positions, cos_sin_cache, is_neox=is_neox)   # float32
    cache = set_mla_kv_buffer(cache, layer_id, loc, k_nope, k_rot, sanitize=sanitize)
    q_out = concatenate([q_nope, rope.apply_rope(q_rope, ...)], -1).astype(q_out_dtype)

(with `sanitize`, k_rope's NaN / +-inf first become 0 / +-its dtype's largest finite value).
The fused kernel equals it: stored nope bytes and scales bit for bit, rotated values within
one unit in the last place of their stored dtype (an FMA may round the float32 rotation
differently). `unfused_rope_set_mla_kv_buffer` is that composition with any implementation
of the set (the benchmark's baseline: XLA RoPE + our set kernel + a concatenate).

Positions outside the table `[0, max_position)` are clamped to it (as `rope.apply_rope`);
integer positions and slots of any width are clamped / range-checked before they are
narrowed to int32, so 64-bit values never wrap.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache import dispatch, reference, rope
from jax_mla_cache.config import MODEL_DTYPES
from jax_mla_cache.state import MLAKVCache
from pallas_kernels import exact

F32 = jnp.float32
OP = "rope_set_mla_kv_buffer"


# ----------------------------------------------------------------- validation
def _narrow_slots(loc: Any, rows: int, op: str) -> jax.Array:
  """`loc` as int32 (T,), every slot outside [0, rows) mapped to -1 (skipped) while still in
  its own integer width, so a 64-bit 2**32 + 5 cannot wrap onto row 5."""
  if not hasattr(loc, "dtype"):
    loc = np.asarray(loc)
  if jnp.issubdtype(loc.dtype, jnp.integer) and jnp.dtype(loc.dtype) != jnp.int32:
    keep = (loc >= 0) & (loc < rows)
    loc = jnp.where(keep, loc.astype(jnp.int32), jnp.int32(-1))
  return dispatch.check_loc(loc, "loc", op)


def _narrow_positions(positions: Any, tokens: int, max_position: int, op: str) -> jax.Array:
  """`positions` as int32 (T,); wider integer types are clamped to the table first."""
  if not hasattr(positions, "dtype"):
    positions = np.asarray(positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"{op}: positions must have an integer dtype, got {positions.dtype}")
  if tuple(positions.shape) != (tokens,):
    raise ValueError(f"{op}: positions must have shape (T,) = ({tokens},) (T = len(loc)), "
                     f"got {tuple(positions.shape)}")
  if jnp.dtype(positions.dtype) != jnp.int32:
    positions = jnp.clip(positions, 0, max_position - 1).astype(jnp.int32)
  return jnp.asarray(positions)


def _check_heads(x: Any, name: str, tokens: int, heads: int | None, width: int, op: str):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a float dtype, got {x.dtype}")
  shape = tuple(x.shape)
  if len(shape) != 3 or shape[0] != tokens or shape[2] != width or shape[1] < 1 or (
      heads is not None and shape[1] != heads):
    want = f"(T, {'H' if heads is None else heads}, {width})"
    raise ValueError(f"{op}: {name} must have shape {want} (T = len(loc) = {tokens}), "
                     f"got {shape}")
  return exact.as_stored(x)


def check_inputs(config, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache,
                 q_out_dtype, op: str = OP):
  """Validate and normalize the op's arguments for a cache of `config` (SPEC §5: errors
  name the argument). Returns (loc int32, positions int32, q_nope, q_rope, k_nope, k_rope,
  cos_sin_cache float32, q_out_dtype)."""
  R, Rr = config.kv_lora_rank, config.qk_rope_head_dim
  loc = _narrow_slots(loc, config.rows, op)
  T = loc.shape[0]
  if not hasattr(cos_sin_cache, "shape") or not hasattr(cos_sin_cache, "dtype"):
    cos_sin_cache = np.asarray(cos_sin_cache)
  if (cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != Rr or cos_sin_cache.shape[0] < 1
      or not jnp.issubdtype(cos_sin_cache.dtype, jnp.floating)):
    raise ValueError(f"{op}: cos_sin_cache must be a float array of shape (max_position, "
                     f"{Rr}) ([cos | sin] rows), got {cos_sin_cache.dtype}"
                     f"{list(cos_sin_cache.shape)}")
  positions = _narrow_positions(positions, T, cos_sin_cache.shape[0], op)
  q_nope = _check_heads(q_nope, "q_nope", T, None, R, op)
  q_rope = _check_heads(q_rope, "q_rope", T, q_nope.shape[1], Rr, op)
  k_nope = dispatch.check_rows_input(k_nope, "k_nope", T, R, op)
  k_rope = dispatch.check_rows_input(k_rope, "k_rope", T, Rr, op)
  if q_out_dtype is None:
    q_out_dtype = jnp.dtype(q_rope.dtype)
  q_out_dtype = dispatch.check_dtype(q_out_dtype, "q_out_dtype", op)
  if q_out_dtype not in MODEL_DTYPES:
    raise TypeError(f"{op}: q_out_dtype must be one of {[d.name for d in MODEL_DTYPES]}, "
                    f"got {q_out_dtype}")
  return (loc, positions, q_nope, q_rope, k_nope, k_rope,
          jnp.asarray(cos_sin_cache).astype(F32), q_out_dtype)


def _host_int32(x: Any, fix) -> Any:
  """A host (numpy / list) integer argument that is not int32, fixed by `fix` and narrowed
  on the host: jit would truncate a 64-bit host array to int32 (x64 off) before any check."""
  if isinstance(x, (list, tuple, range)):
    x = np.asarray(x)
  if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.integer) and x.dtype != np.int32:
    return fix(x).astype(np.int32)
  return x


def host_positions(positions: Any, cos_sin_cache: Any) -> tuple[Any, Any]:
  """(positions, cos_sin_cache) on the host before the jit: a list table becomes a numpy
  array, and host positions of another integer width than int32 are clamped to the table
  in their own width, then narrowed (the jit would wrap int64 2**32 + 3 to 3). Device
  arrays pass as they are (they are clamped inside the op)."""
  if isinstance(cos_sin_cache, (list, tuple)):
    cos_sin_cache = np.asarray(cos_sin_cache)
  if hasattr(cos_sin_cache, "shape") and len(cos_sin_cache.shape) == 2:
    last = max(cos_sin_cache.shape[0] - 1, 0)
    positions = _host_int32(positions, lambda x: np.clip(x, 0, last))
  return positions, cos_sin_cache


# ----------------------------------------------------------------- the op
def _unfused(cache, layer_id, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache,
             is_neox, q_out_dtype, sanitize, implementation):
  """The composition of SPEC §8 on validated arguments (module docstring)."""
  if sanitize:
    k_rope = reference.sanitize_f32(k_rope.astype(F32), reference.finite_max(k_rope.dtype))
  k_rot = rope.apply_rope(k_rope, positions, cos_sin_cache, is_neox=is_neox)
  cache = dispatch.set_mla_kv_buffer(cache, layer_id, loc, k_nope, k_rot,
                                     implementation=implementation, sanitize=sanitize)
  q_rot = rope.apply_rope(q_rope, positions, cos_sin_cache, is_neox=is_neox)
  return cache, jnp.concatenate([q_nope.astype(q_out_dtype), q_rot.astype(q_out_dtype)], -1)


_STATIC = ("layer_id", "is_neox", "q_out_dtype", "sanitize", "implementation", "fused")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _rope_set(
    cache: MLAKVCache, layer_id: int, loc: jax.Array, positions: jax.Array,
    q_nope: jax.Array, q_rope: jax.Array, k_nope: jax.Array, k_rope: jax.Array,
    cos_sin_cache: jax.Array, *, is_neox: bool, q_out_dtype: Any, sanitize: bool,
    implementation: dispatch.Implementation, fused: bool,
) -> tuple[MLAKVCache, jax.Array]:
  layer_id = dispatch.check_layer_id(cache, layer_id, OP)
  loc, positions, q_nope, q_rope, k_nope, k_rope, table, out_dtype = check_inputs(
      cache.config, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache, q_out_dtype)
  T, H = q_nope.shape[:2]
  if T == 0:
    return cache, jnp.zeros((0, H, cache.config.kv_cache_dim), out_dtype)
  impl = dispatch.resolve_implementation(implementation)
  if fused and impl == "pallas":
    from pallas_kernels import rope_set  # imported lazily: the XLA path needs no Pallas
    if rope_set.unsupported_reason(cache.config.kv_lora_rank,
                                   cache.config.qk_rope_head_dim) is None:
      new, q_out = rope_set.rope_set_rows(
          cache.layer(layer_id), loc, positions, q_nope, q_rope, k_nope, k_rope, table,
          is_neox=is_neox, q_out_dtype=out_dtype, sanitize=sanitize)
      return cache.replace_layer(layer_id, new), q_out
    # Row widths the fused kernel has no layout for: the composition, with the set kernel.
  return _unfused(cache, layer_id, loc, positions, q_nope, q_rope, k_nope, k_rope, table,
                  is_neox, out_dtype, sanitize, impl)


def _call(fused: bool, cache, layer_id, loc, positions, q_nope, q_rope, k_nope, k_rope,
          cos_sin_cache, is_neox, q_out_dtype, sanitize, implementation):
  dispatch.check_cache(cache, OP, stacked=True)
  loc = _host_int32(loc, lambda x: np.where((x >= 0) & (x < cache.config.rows), x, -1))
  positions, cos_sin_cache = host_positions(positions, cos_sin_cache)
  layer_id = dispatch.check_layer_id(cache, layer_id, OP)
  return dispatch.on_layer(_rope_set, cache, layer_id, loc, positions, q_nope, q_rope, k_nope,
                           k_rope, cos_sin_cache, is_neox=bool(is_neox),
                           q_out_dtype=q_out_dtype, sanitize=bool(sanitize),
                           implementation=implementation, fused=fused)


def rope_set_mla_kv_buffer(
    cache: MLAKVCache, layer_id: int, loc: Any, positions: Any, q_nope: jax.Array,
    q_rope: jax.Array, k_nope: jax.Array, k_rope: jax.Array, cos_sin_cache: Any, *,
    is_neox: bool = False, q_out_dtype: Any = None, sanitize: bool = False,
    implementation: dispatch.Implementation = None,
) -> tuple[MLAKVCache, jax.Array]:
  """Fused RoPE + query assembly + latent-row write of one layer (donates `cache`).

  Args:
    cache: the state (donated: do not use it after the call).
    layer_id: static layer index (a `StackedMLAKVCache` also takes a traced integer scalar).
    loc: (T,) integer slots; slots outside [0, rows) are skipped (64-bit ones included).
    positions: (T,) integer token positions; clamped to [0, max_position).
    q_nope: (T, H, R) the absorbed query's latent part (`q_nope @ W_UK`), any float dtype.
    q_rope: (T, H, Rr) the query's rope part, not yet rotated, any float dtype.
    k_nope: (T, 1, R) the latent KV, any float dtype.
    k_rope: (T, 1, Rr) the key's rope part, not yet rotated, any float dtype.
    cos_sin_cache: (max_position, Rr) float table, [cos | sin] per position (vLLM/SGLang
      convention; build it with `jax_mla_cache.rope`). Keep it on the device
      (`jnp.asarray` once): a numpy table is copied to the device on every eager call.
    is_neox: rotate halves (x[i], x[i + Rr/2]) (True) or adjacent pairs (x[2i], x[2i+1])
      kept interleaved (False: GPT-J style, DeepSeek checkpoints in SGLang/vLLM).
    q_out_dtype: bf16 / f16 / f32; default q_rope.dtype.
    sanitize: SPEC §9 for the stored row (`set_mla_kv_buffer`); k_rope's NaN / +-inf become
      0 / +-its dtype's largest finite value before the rotation. q_out is not sanitized.
    implementation: None, "xla" or "pallas" (`jax_mla_cache.dispatch`).
  Returns:
    (new cache, q_out (T, H, R + Rr) = [q_nope | rope(q_rope)] in q_out_dtype).

  Equivalent plain JAX: the module docstring's composition.
  """
  return _call(True, cache, layer_id, loc, positions, q_nope, q_rope, k_nope, k_rope,
               cos_sin_cache, is_neox, q_out_dtype, sanitize, implementation)


_SIGNATURE = inspect.signature(rope_set_mla_kv_buffer)


@functools.wraps(rope_set_mla_kv_buffer)   # (its signature)
def unfused_rope_set_mla_kv_buffer(*args, **kwargs) -> tuple[MLAKVCache, jax.Array]:
  bound = _SIGNATURE.bind(*args, **kwargs)
  bound.apply_defaults()
  return _call(False, **bound.arguments)


unfused_rope_set_mla_kv_buffer.__name__ = "unfused_rope_set_mla_kv_buffer"
unfused_rope_set_mla_kv_buffer.__qualname__ = "unfused_rope_set_mla_kv_buffer"
unfused_rope_set_mla_kv_buffer.__doc__ = """The unfused composition (XLA RoPE,
`set_mla_kv_buffer` with `implementation`, a concatenate): `rope_set_mla_kv_buffer`'s
reference and the benchmark's baseline. Same arguments (its signature) and results."""
