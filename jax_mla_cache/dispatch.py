"""The functional API: validation, implementation choice, and the jitted ops.

Every op takes the immutable `MLAKVCache` and returns a new one. The public
functions are jitted with the cache donated, so eager calls update in place too;
inside a user's jitted step they inline (donate the cache at *that* boundary).

`implementation`:
  * None      -- "pallas" on NVIDIA GPUs with compute capability >= 9.0 (Hopper,
                 Blackwell), "xla" everywhere else.
  * "xla"     -- plain XLA scatter/gather (`jax_mla_cache.reference`).
  * "pallas"  -- the Mosaic GPU kernels of `pallas_kernels`: real kernels when
                 lowering for CUDA (also deviceless AOT lowering on a CPU host),
                 the same kernels in Pallas interpret mode when lowering for CPU.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache import reference
from jax_mla_cache.state import MLAKVCache

Implementation = Literal["xla", "pallas"] | None
IMPLEMENTATIONS = ("xla", "pallas")


# ----------------------------------------------------------------- choice
@functools.cache
def _default_implementation() -> str:
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return "xla"
  if device.platform != "gpu":
    return "xla"
  capability = getattr(device, "compute_capability", None)
  try:
    major = int(str(capability).split(".")[0])
  except ValueError:
    return "xla"
  # CUDA reports "9.0"; ROCm's "gfx..." fails the int() above.
  return "pallas" if major >= 9 else "xla"


def resolve_implementation(implementation: Implementation) -> str:
  """The implementation an op will run: `implementation`, or the device's best."""
  if implementation is None:
    return _default_implementation()
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
    )
  return implementation


def _kernels():
  import pallas_kernels  # imported lazily: the XLA path needs no Pallas

  return pallas_kernels


def _public(jitted: Callable) -> Callable:
  """The public op: checks the cache type and turns index lists into arrays before
  the jitted function (whose own checks run at trace time, before anything runs)."""
  name = jitted.__name__.lstrip("_")

  @functools.wraps(jitted)
  def op(cache, *args, **kwargs):
    _check_cache(cache, name)
    args = tuple(np.asarray(a) if isinstance(a, (list, tuple, range)) else a for a in args)
    return jitted(cache, *args, **kwargs)

  op.__name__ = op.__qualname__ = name
  op.jitted = jitted
  return op


# ----------------------------------------------------------------- validation
def _check_cache(cache: Any, op: str) -> None:
  if not isinstance(cache, MLAKVCache):
    raise TypeError(f"{op}: cache must be an MLAKVCache, got {type(cache).__name__}")


def check_layer_id(cache: MLAKVCache, layer_id: Any, op: str) -> int:
  """`layer_id` as a Python int in [0, layer_num); a static value is required."""
  if isinstance(layer_id, jax.core.Tracer):
    raise TypeError(
        f"{op}: layer_id must be a static Python int (each layer is its own buffer), "
        "got a traced value"
    )
  try:
    layer_id = operator.index(layer_id)
  except TypeError:
    raise TypeError(
        f"{op}: layer_id must be an int, got {type(layer_id).__name__} {layer_id!r}"
    ) from None
  if not 0 <= layer_id < cache.config.layer_num:
    raise ValueError(
        f"{op}: layer_id must be in [0, {cache.config.layer_num}), got {layer_id}"
    )
  return layer_id


def check_loc(loc: Any, name: str, op: str) -> jax.Array:
  """A rank-1 integer index array, as int32. (T,) and (T, 1) are accepted."""
  if not hasattr(loc, "shape") or not hasattr(loc, "dtype"):
    loc = np.asarray(loc)
  if not jnp.issubdtype(loc.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {loc.dtype}")
  if loc.ndim == 2 and loc.shape[1] == 1:
    loc = loc.reshape(-1)
  if loc.ndim != 1:
    raise ValueError(f"{op}: {name} must have shape (T,), got {tuple(loc.shape)}")
  return jnp.asarray(loc).astype(jnp.int32)


def check_rows_input(x: Any, name: str, tokens: int, width: int, op: str) -> jax.Array:
  """A (T, 1, width) float array."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a float dtype, got {x.dtype}")
  if tuple(x.shape) != (tokens, 1, width):
    raise ValueError(
        f"{op}: {name} must have shape (T, 1, {width}) = {(tokens, 1, width)} "
        f"(T = len(loc) = {tokens}), got {tuple(x.shape)}"
    )
  return x


def check_dtype(dtype: Any, name: str, op: str):
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{op}: {name} must be a dtype, got {dtype!r}") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be a float dtype, got {dtype}")
  return dtype


# ----------------------------------------------------------------- writes
def _write_layer(
    cache: MLAKVCache, layer_id: int, loc: jax.Array, nope: jax.Array, rope: jax.Array,
    impl: str, sanitize: bool = False,
) -> MLAKVCache:
  buffers = cache.layer(layer_id)
  if loc.shape[0] == 0:
    return cache
  backend = reference if impl == "xla" else _kernels()
  if cache.config.quantized:
    new = backend.set_rows_per_token_head(*buffers, loc, nope, rope, sanitize=sanitize)
  else:
    new = (backend.set_rows(buffers[0], loc, nope, rope, sanitize=sanitize),)
  return cache.replace_layer(layer_id, new)


@functools.partial(
    jax.jit, static_argnames=("layer_id", "implementation", "sanitize"),
    donate_argnames=("cache",)
)
def _set_mla_kv_buffer(
    cache: MLAKVCache,
    layer_id: int,
    loc: jax.Array,
    cache_k_nope: jax.Array,
    cache_k_rope: jax.Array,
    *,
    implementation: Implementation = None,
    sanitize: bool = False,
) -> MLAKVCache:
  """Write token rows `[nope | rope]` of one layer at slots `loc` (donates `cache`).

  Args:
    cache: the state (donated: do not use it after the call).
    layer_id: static layer index.
    loc: (T,) integer slots; slots outside [0, rows) are skipped.
    cache_k_nope: (T, 1, kv_lora_rank), any float dtype.
    cache_k_rope: (T, 1, qk_rope_head_dim), any float dtype.
    implementation: None, "xla" or "pallas" (module docstring).
    sanitize: SPEC §9, for padded rows of garbage: NaN is stored as 0; plain mode stores
      values beyond `dtype`'s range (+-inf included) as its largest finite value with
      their sign; per_token_head replaces +-inf by the input dtype's largest finite
      value before quantizing and clamps rope quotients to `model_dtype`'s range. Rows
      whose values are finite (and fit the storage dtype) are stored exactly as without.
  Returns:
    The new state. Plain mode casts to `dtype` (fp8 saturating); per_token_head
    quantizes as SPEC §3.

  Equivalent plain JAX (plain mode, in-range slots)::

      kv = cache.buffers[layer_id][0]
      kv = kv.at[loc].set(jnp.concatenate([nope, rope], -1).astype(kv.dtype))
  """
  op = "set_mla_kv_buffer"
  _check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  tokens = loc.shape[0]
  nope = check_rows_input(cache_k_nope, "cache_k_nope", tokens, cfg.kv_lora_rank, op)
  rope = check_rows_input(cache_k_rope, "cache_k_rope", tokens, cfg.qk_rope_head_dim, op)
  return _write_layer(cache, layer_id, loc, nope, rope, resolve_implementation(implementation),
                      bool(sanitize))


@functools.partial(
    jax.jit, static_argnames=("layer_id", "implementation", "sanitize"),
    donate_argnames=("cache",)
)
def _set_kv_buffer(
    cache: MLAKVCache,
    layer_id: int,
    loc: jax.Array,
    cache_k: jax.Array,
    *,
    implementation: Implementation = None,
    sanitize: bool = False,
) -> MLAKVCache:
  """Write whole rows `cache_k` (T, 1, R+Rr) of one layer at `loc` (donates `cache`).

  The same as `set_mla_kv_buffer(cache, layer_id, loc, cache_k[..., :R], cache_k[..., R:],
  sanitize=sanitize)`.
  """
  op = "set_kv_buffer"
  _check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  cache_k = check_rows_input(cache_k, "cache_k", loc.shape[0], cfg.kv_cache_dim, op)
  nope, rope = cache_k[..., : cfg.kv_lora_rank], cache_k[..., cfg.kv_lora_rank:]
  return _write_layer(cache, layer_id, loc, nope, rope, resolve_implementation(implementation),
                      bool(sanitize))


# ----------------------------------------------------------------- reads
@functools.partial(jax.jit, static_argnames=("layer_id", "dst_dtype", "implementation"))
def _get_mla_kv_buffer(
    cache: MLAKVCache,
    layer_id: int,
    loc: jax.Array,
    dst_dtype: Any = None,
    *,
    implementation: Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """Gather (and dequantize) token rows of one layer.

  Args:
    cache: the state (not donated).
    layer_id: static layer index.
    loc: (T,) integer slots; out-of-range slots read as zeros.
    dst_dtype: output dtype; default `dtype` in plain mode, `model_dtype` in
      per_token_head mode (the seed defaults to the fp8 dtype there, which would
      re-quantize without the scale: a trap we avoid).
  Returns:
    (nope (T, 1, kv_lora_rank), rope (T, 1, qk_rope_head_dim)) in dst_dtype.
  """
  op = "get_mla_kv_buffer"
  _check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  dst_dtype = cfg.default_read_dtype if dst_dtype is None else check_dtype(dst_dtype, "dst_dtype", op)
  tokens = loc.shape[0]
  if tokens == 0:
    return (jnp.zeros((0, 1, cfg.kv_lora_rank), dst_dtype),
            jnp.zeros((0, 1, cfg.qk_rope_head_dim), dst_dtype))
  impl = resolve_implementation(implementation)
  backend = reference if impl == "xla" else _kernels()
  buffers = cache.layer(layer_id)
  if cfg.quantized:
    return backend.get_rows_per_token_head(*buffers, loc, dst_dtype=dst_dtype)
  return backend.get_rows(buffers[0], loc, kv_lora_rank=cfg.kv_lora_rank, dst_dtype=dst_dtype)


# ----------------------------------------------------------------- moves
def _check_pair(tgt: Any, src: Any, op: str, names=("tgt_loc", "src_loc")):
  tgt = check_loc(tgt, names[0], op)
  src = check_loc(src, names[1], op)
  if tgt.shape != src.shape:
    raise ValueError(
        f"{op}: {names[0]} and {names[1]} must have the same length, got "
        f"{tgt.shape[0]} and {src.shape[0]}"
    )
  return tgt, src


def _kernel_moves(cache: MLAKVCache) -> bool:
  """Whether the move kernels take this cache: the per_token_head scale buffer (4-byte
  rows) is read in aligned 16-byte windows, so its rows must be a multiple of 4; other
  sizes move through XLA."""
  return not cache.config.quantized or cache.config.rows % 4 == 0


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnames=("cache",))
def _move_kv_cache(
    cache: MLAKVCache,
    tgt_loc: jax.Array,
    src_loc: jax.Array,
    *,
    implementation: Implementation = None,
) -> MLAKVCache:
  """Move token rows in every layer and buffer: `rows[tgt[i]] = old_rows[src[i]]`.

  All reads happen before any write (overlapping sets are safe); pairs with an
  out-of-range index are skipped; empty is a no-op. Donates `cache`.
  """
  op = "move_kv_cache"
  _check_cache(cache, op)
  tgt, src = _check_pair(tgt_loc, src_loc, op)
  if tgt.shape[0] == 0:
    return cache
  impl = resolve_implementation(implementation)
  backend = reference if impl == "xla" or not _kernel_moves(cache) else _kernels()
  return cache.with_flat_buffers(tuple(backend.move_rows(cache.flat_buffers(), tgt, src)))


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnames=("cache",))
def _move_kv_pages(
    cache: MLAKVCache,
    tgt_pages: jax.Array,
    src_pages: jax.Array,
    *,
    implementation: Implementation = None,
) -> MLAKVCache:
  """Copy whole pages (`page_size` rows) in every layer and buffer.

  `pages[tgt[i]] = old_pages[src[i]]`, snapshot semantics as `move_kv_cache`;
  pages not wholly inside the buffer are skipped. vLLM's copy_blocks. Donates `cache`.
  """
  op = "move_kv_pages"
  _check_cache(cache, op)
  tgt, src = _check_pair(tgt_pages, src_pages, op, ("tgt_pages", "src_pages"))
  if tgt.shape[0] == 0:
    return cache
  impl = resolve_implementation(implementation)
  backend = reference if impl == "xla" or not _kernel_moves(cache) else _kernels()
  moved = backend.move_pages(cache.flat_buffers(), tgt, src, page_size=cache.config.page_size)
  return cache.with_flat_buffers(tuple(moved))


set_mla_kv_buffer = _public(_set_mla_kv_buffer)
set_kv_buffer = _public(_set_kv_buffer)
get_mla_kv_buffer = _public(_get_mla_kv_buffer)
move_kv_cache = _public(_move_kv_cache)
move_kv_pages = _public(_move_kv_pages)
