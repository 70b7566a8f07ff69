"""The functional API: validation, implementation choice, and the jitted ops.

Every op takes the immutable `MLAKVCache` and returns a new one. The public
functions are jitted with the cache donated, so eager calls update in place too;
inside a user's jitted step they inline (donate the cache at *that* boundary).

`implementation`:
  * None      -- the device's best that covers the call: on NVIDIA GPUs with compute
                 capability >= 9.0 (Hopper, Blackwell) the Pallas kernels, falling through
                 to XLA (with a warning, once per op and reason) for what they do not cover
                 (row widths, buffer geometries, `jax.vmap`; README "Kernel limits");
                 "xla" everywhere else. It always works.
  * "xla"     -- plain XLA scatter/gather (`jax_mla_cache.reference`).
  * "pallas"  -- the Mosaic GPU kernels of `pallas_kernels`: real kernels when
                 lowering for CUDA (also deviceless AOT lowering on a CPU host),
                 the same kernels in Pallas interpret mode when lowering for CPU.
                 What they do not cover raises `pallas_kernels.Unsupported` (a
                 NotImplementedError) at trace time, before anything runs.
"""

from __future__ import annotations

import functools
import inspect
import operator
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax.custom_batching import custom_vmap

from jax_mla_cache import reference
from jax_mla_cache.config import PLAIN_DTYPES
from jax_mla_cache.state import MLAKVCache, StackedMLAKVCache
from pallas_kernels import exact

Implementation = Literal["xla", "pallas"] | None
IMPLEMENTATIONS = ("xla", "pallas")
INDEX_ARGUMENTS = frozenset({"loc", "tgt_loc", "src_loc", "tgt_pages", "src_pages"})
"""Parameters of the public ops that hold row or page indices."""
READ_DTYPES = PLAIN_DTYPES
"""The dtypes `get_mla_kv_buffer` returns (its `dst_dtype`), on every implementation."""


class FallbackWarning(UserWarning):
  """The default implementation fell through from the Pallas kernels to XLA."""


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


def implementation_order(implementation: Implementation | tuple[str, ...]) -> tuple[str, ...]:
  """The implementations an op tries, in order.

  None: the device's best, then "xla" for what it does not cover; "xla" or "pallas": that
  one alone. A tuple (an order resolved before) is returned as it is.
  """
  if isinstance(implementation, tuple) and implementation and all(
      name in IMPLEMENTATIONS for name in implementation):
    return implementation
  if implementation is None:
    best = _default_implementation()
    return (best,) if best == "xla" else (best, "xla")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
    )
  return (implementation,)


def resolve_implementation(implementation: Implementation) -> str:
  """The implementation an op tries first: `implementation`, or the device's best."""
  return implementation_order(implementation)[0]


def _kernels():
  import pallas_kernels  # imported lazily: the XLA path needs no Pallas

  return pallas_kernels


_WARNED: set[tuple[str, str]] = set()


def _warn_fallback(op: str, reason: str) -> None:
  """Warn once per op and reason that the default implementation runs XLA instead."""
  if (op, reason) in _WARNED:
    return
  _WARNED.add((op, reason))
  warnings.warn(
      f"{op}: the Pallas kernels do not cover this call ({reason}); running it with "
      "implementation='xla' (pass implementation='xla' to choose it explicitly; README "
      "'Kernel limits')",
      FallbackWarning, stacklevel=2,
  )


def _run(op: str, order: tuple[str, ...], call: Callable[..., Any], *args: Any) -> Any:
  """`call(backend, *args)` with the first implementation of `order` that covers it.

  An implementation that does not cover the call raises `pallas_kernels.Unsupported` at
  trace time (the kernels' width and geometry limits); the next one in `order` runs then,
  with a `FallbackWarning` (once per op and reason). With nothing left to fall to (an
  explicit "pallas"), the error says what the kernels do not cover. `jax.vmap` takes the
  same path in the kernels' batching rule (`_no_vmap_kernels`). `args` are arrays (or
  pytrees of them); everything static is closed over by `call`.
  """
  for i, impl in enumerate(order):
    rest = order[i + 1:]
    if impl == "xla":
      return call(reference, *args)
    kernels = _kernels()
    try:
      return _no_vmap_kernels(op, call, rest)(*args)
    except kernels.Unsupported as e:
      if not rest:
        raise kernels.Unsupported(
            f"{op}: implementation='pallas' does not cover this call: {e} (README 'Kernel "
            "limits'; implementation=None falls back to XLA)") from e
      _warn_fallback(op, str(e))
  raise AssertionError("unreachable: every order ends with a working implementation")


def _no_vmap_kernels(op: str, call: Callable[..., Any], rest: tuple[str, ...]) -> Callable:
  """`call` on the kernels, with a batching rule: the kernels have none of their own (in
  interpret mode JAX would fail inside a `pure_callback`). Under `jax.vmap` the rule runs
  the rest of the order (the default implementation: XLA, vmapped, with a warning), or,
  for an explicit "pallas", raises `Unsupported` saying what to do instead."""
  kernels = _kernels()
  run = custom_vmap(lambda *args: call(kernels, *args))

  @run.def_vmap
  def rule(axis_size, in_batched, *args):
    del axis_size
    reason = "jax.vmap: the kernels have no batching rule"
    if not rest:
      raise kernels.Unsupported(
          f"{op}: implementation='pallas' does not support {reason}; pass one flat batch "
          "(concatenate the slots and rows of the batch into one call), or use "
          "implementation='xla'")
    _warn_fallback(op, reason)
    in_axes = tuple(jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched)))
    out = jax.vmap(lambda *a: _run(op, rest, call, *a), in_axes=in_axes)(*args)
    return out, jax.tree.map(lambda _: True, out)

  return run


def host_indices(value: Any) -> Any:
  """Index arguments on the host before the jit: lists become arrays (an empty one int32),
  and numpy integer arrays narrow to int32 here (the jit would truncate int64 without
  jax_enable_x64, wrapping 2**32 + 5 onto row 5; `exact.index_to_int32` maps values
  outside int32 to -1 instead, a row every op skips)."""
  if isinstance(value, (list, tuple, range)):
    value = np.asarray(value) if len(value) else np.zeros((0,), np.int32)
  if isinstance(value, (np.ndarray, np.generic)) and np.issubdtype(value.dtype, np.integer):
    return exact.index_to_int32(value)
  return value


class HostIndices:
  """A jitted model step whose index arguments `names` (page tables, positions, lengths)
  pass through `host_indices` before the jit: a numpy int64 page id 2**32 + 3 becomes -1
  (masked, its rows skipped) instead of the jit's silent truncation to page 3. Calls,
  ``.lower`` and ``.trace`` go to the jitted function with the narrowed arguments;
  traced and device arrays pass as they are."""

  def __init__(self, jitted: Callable, names: tuple[str, ...]):
    self.jitted = jitted
    self.names = names
    self._signature = inspect.signature(jitted)
    functools.update_wrapper(self, jitted)

  def _narrow(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    bound = self._signature.bind(*args, **kwargs)
    for name in self.names:
      if name in bound.arguments:
        bound.arguments[name] = host_indices(bound.arguments[name])
    return bound.args, bound.kwargs

  def __call__(self, *args, **kwargs):
    args, kwargs = self._narrow(args, kwargs)
    return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    args, kwargs = self._narrow(args, kwargs)
    return self.jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    args, kwargs = self._narrow(args, kwargs)
    return self.jitted.trace(*args, **kwargs)


def host_index_arguments(*names: str) -> Callable[[Callable], HostIndices]:
  """Decorator: `HostIndices(jitted, names)`."""
  return lambda jitted: HostIndices(jitted, names)


def bind_arguments(
    signature: inspect.Signature, cache: MLAKVCache, op: str, args: tuple, kwargs: dict
) -> inspect.BoundArguments:
  """The arguments of a public op, checked and normalized before its jitted function.

  `layer_id` becomes a Python int (checked here: a traced or unhashable value would
  otherwise fail inside `jax.jit` as a non-hashable static argument), index arguments
  pass through `host_indices`, other lists become numpy arrays, and `implementation`
  becomes its resolved order. `args` include the cache.
  """
  try:
    bound = signature.bind(*args, **kwargs)
  except TypeError as e:
    raise TypeError(f"{op}: {e} (signature: {op}{signature})") from None
  arguments = bound.arguments
  if "layer_id" in arguments:
    arguments["layer_id"] = check_layer_id(cache, arguments["layer_id"], op)
  for name, value in arguments.items():
    if name in INDEX_ARGUMENTS:
      arguments[name] = host_indices(value)
    elif name != "implementation" and isinstance(value, (list, tuple, range)):
      arguments[name] = np.asarray(value)
  if "implementation" in signature.parameters:
    arguments["implementation"] = implementation_order(arguments.get("implementation"))
  return bound


def _public(jitted: Callable) -> Callable:
  """The public op: checks the cache type and normalizes the arguments
  (`bind_arguments`) before the jitted function, whose own checks run at trace time,
  before anything runs. A per-layer op (one with `layer_id`) runs the jitted function on
  the layer alone and puts the returned cache back (`on_layer`): every layer of a cache
  then shares one trace, one lowered function inside a model's jit and one executable
  outside it. `op.jitted` still takes a whole cache and its layer_id."""
  name = jitted.__name__.lstrip("_")
  signature = inspect.signature(jitted)
  signature = signature.replace(parameters=[     # (private parameters: `_on_every_layer`'s)
      p for p in signature.parameters.values() if not p.name.startswith("_")])
  per_layer = "layer_id" in signature.parameters
  assert not per_layer or list(signature.parameters)[:2] == ["cache", "layer_id"], name

  @functools.wraps(jitted)
  def op(cache, *args, **kwargs):
    check_cache(cache, name, stacked=True)
    bound = bind_arguments(signature, cache, name, (cache, *args), kwargs)
    if not per_layer:
      if isinstance(cache, StackedMLAKVCache):
        return _on_every_layer(jitted, cache, bound)
      return jitted(*bound.args, **bound.kwargs)
    return on_layer(jitted, cache, bound.args[1], *bound.args[2:], **bound.kwargs)

  op.__name__ = op.__qualname__ = name
  op.__signature__ = signature
  op.jitted = jitted
  return op


def on_layer(core: Callable, cache: Any, layer_id: Any, *args, pages_at: int | None = None,
             **kwargs) -> Any:
  """``core(view, 0, *args, **kwargs)`` on the layer alone (``view =
  cache.layer_view(layer_id)``), each cache it returns put back into `cache`
  (`with_layer_results`): how every public per-layer op runs its jitted core, so that all
  layers of a cache share one trace of it (and outside a jit one executable). `cache` is
  an `MLAKVCache`, a `sharding.ShardedMLAKVCache` (the same two methods) or a
  `StackedMLAKVCache`, whose view is every layer at once: the layer's indices are moved
  into it first -- ``args[0]``, the slots, or with `pages_at` ``args[pages_at]``, the page
  ids (`StackedMLAKVCache.layer_rows` / `layer_pages`; `layer_id` may be traced)."""
  if isinstance(cache, StackedMLAKVCache):
    args = list(args)
    if pages_at is None:
      op = core.__name__.lstrip("_")
      args[0] = cache.layer_rows(layer_id, check_loc(args[0], "loc", op))
    else:
      args[pages_at] = cache.layer_pages(layer_id, args[pages_at])
  view = cache.layer_view(layer_id)
  if isinstance(view, MLAKVCache):   # (a sharded view is checked shard by shard)
    check_buffers(view, getattr(core, "__name__", "op").lstrip("_"),
                  "every layer" if isinstance(cache, StackedMLAKVCache) else f"layer {layer_id}")
  return with_layer_results(cache, layer_id, core(view, 0, *args, **kwargs))


def _on_every_layer(jitted: Callable, cache: StackedMLAKVCache,
                    bound: inspect.BoundArguments) -> StackedMLAKVCache:
  """A move (`move_kv_cache`, `move_kv_pages`) of a `StackedMLAKVCache`: the op on the
  stacked view with its private `_layers`, so that every layer (a block of the stacked
  buffers) moves the pairs (the backends' `layers`)."""
  bound.arguments["cache"] = cache.layer_view()
  return cache.with_layer(None, jitted(*bound.args, **bound.kwargs, _layers=cache.layer_num))


def with_layer_results(cache: Any, layer_id: int, out: Any) -> Any:
  """A per-layer op's results on `cache.layer_view(layer_id)` with each returned cache
  (the view: of `cache`'s type, or an `MLAKVCache` for a `StackedMLAKVCache`) put back
  into `cache` (`with_layer`); other results unchanged."""
  view_type = MLAKVCache if isinstance(cache, StackedMLAKVCache) else type(cache)
  if isinstance(out, view_type):
    return cache.with_layer(layer_id, out)
  if isinstance(out, tuple):
    return tuple(with_layer_results(cache, layer_id, x) for x in out)
  return out


# ----------------------------------------------------------------- validation
def check_cache(cache: Any, op: str, *, stacked: bool = False) -> None:
  """Raise a TypeError naming `op` unless `cache` is an `MLAKVCache` (or, with `stacked`,
  a `StackedMLAKVCache`)."""
  if isinstance(cache, StackedMLAKVCache) and not stacked:
    raise TypeError(f"{op}: a StackedMLAKVCache is not supported here (convert it with "
                    "cache.unstack(), a copy)")
  if not isinstance(cache, (MLAKVCache, StackedMLAKVCache)):
    raise TypeError(f"{op}: cache must be an MLAKVCache, got {type(cache).__name__}")
  if isinstance(cache, MLAKVCache) and len(cache.buffers) != cache.config.layer_num:
    raise ValueError(f"{op}: the cache holds {len(cache.buffers)} layers of buffers, its "
                     f"config layer_num={cache.config.layer_num}")


@functools.lru_cache(maxsize=64)
def _expected_buffers(config, stacked: bool) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
  """(shape, dtype) of each buffer of one layer of `config` (a stacked cache: of the one
  buffer per plane that holds every layer)."""
  rows = config.layer_num if stacked else 1
  return tuple(((rows * shape[0], *shape[1:]), jnp.dtype(dtype))
               for shape, dtype in config.buffer_shapes())


def check_buffers(cache: MLAKVCache | StackedMLAKVCache, op: str,
                  where: str | None = None) -> None:
  """ValueError unless the buffers have the shapes and dtypes of `cache.config` (a state
  built by hand with other buffers would let the kernels, which bound indices by the
  config, write past a smaller buffer). Run where an op touches the buffers, on what it
  touches: `on_layer` checks the one layer's view of a per-layer op, the moves and the
  host tier every layer (their work is per layer anyway), after `check_cache`, which only
  counts the layers: a 61-layer check on every eager per-layer call cost ~0.1-0.3 ms."""
  cfg = cache.config
  stacked = isinstance(cache, StackedMLAKVCache)
  want = _expected_buffers(cfg, stacked)
  layers = (tuple(cache.buffers),) if stacked else cache.buffers   # (counted: check_cache)
  for l, buffers in enumerate(layers):
    if len(buffers) == len(want) and all(
        getattr(b, "shape", None) == shape and getattr(b, "dtype", None) == dtype
        for b, (shape, dtype) in zip(buffers, want)):
      continue
    where = where or ("every layer" if stacked else f"layer {l}")
    got = [f"{getattr(b, 'dtype', type(b).__name__)}{list(getattr(b, 'shape', ()))}"
           for b in buffers]
    raise ValueError(
        f"{op}: the cache's buffers ({where}) are {got}, its config needs "
        f"{[f'{d.name}{list(sh)}' for sh, d in want]} (a state built by hand must match "
        "its MLACacheConfig; use init_cache)")


def check_layer_id(cache: MLAKVCache | StackedMLAKVCache, layer_id: Any, op: str) -> Any:
  """`layer_id` as a Python int in [0, layer_num); a static value is required (any
  concrete integer scalar, e.g. np.int64 or a concrete jnp.int32, is taken as its int),
  except for a `StackedMLAKVCache`, which also takes a traced integer scalar (returned as
  is; the ops skip every index of a layer outside [0, layer_num))."""
  if isinstance(cache, StackedMLAKVCache) and isinstance(layer_id, jax.core.Tracer):
    if layer_id.shape != () or not jnp.issubdtype(layer_id.dtype, jnp.integer):
      raise TypeError(f"{op}: layer_id must be an integer scalar, got "
                      f"{layer_id.aval.str_short()}")
    return layer_id
  if isinstance(layer_id, jax.core.Tracer):
    raise TypeError(
        f"{op}: layer_id must be a static Python int (each layer is its own buffer), "
        f"got a traced value {layer_id.aval.str_short()} (pass the layer number as a "
        "Python int, not as an argument of a jitted function; a StackedMLAKVCache, "
        "init_cache(..., stacked=True), or a sharded one, "
        "sharding.init_sharded_cache(..., stacked=True), takes a traced one)"
    )
  if isinstance(layer_id, (bool, np.bool_)) or getattr(layer_id, "dtype", None) == bool:
    raise TypeError(f"{op}: layer_id must be an int, got a bool {layer_id!r}")
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
  """A rank-1 integer index array, as int32. (T,) and (T, 1) are accepted.

  Any integer dtype: values outside int32's range (64-bit or unsigned indices) become -1,
  which every op skips, instead of wrapping onto a real row (`exact.index_to_int32`).
  """
  if not hasattr(loc, "shape") or not hasattr(loc, "dtype"):
    loc = np.asarray(loc)
  if not jnp.issubdtype(loc.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {loc.dtype}")
  if loc.ndim == 2 and loc.shape[1] == 1:
    loc = loc.reshape(-1)
  if loc.ndim != 1:
    raise ValueError(f"{op}: {name} must have shape (T,), got {tuple(loc.shape)}")
  return jnp.asarray(exact.index_to_int32(loc))


def check_rows_input(x: Any, name: str, tokens: int, width: int, op: str) -> jax.Array:
  """A (T, 1, width) float array, with exactly the values of its dtype (`exact.as_stored`:
  a jitted producer's excess precision does not reach the quantization)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a float dtype, got {x.dtype}")
  if tuple(x.shape) != (tokens, 1, width):
    raise ValueError(
        f"{op}: {name} must have shape (T, 1, {width}) = {(tokens, 1, width)} "
        f"(T = len(loc) = {tokens}), got {tuple(x.shape)}"
    )
  return exact.as_stored(x)


def check_dtype(dtype: Any, name: str, op: str):
  """A dtype of `READ_DTYPES` (float64 is refused on every implementation: the kernels
  cannot produce it and XLA would silently return float32 without jax_enable_x64)."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{op}: {name} must be a dtype, got {dtype!r}") from None
  if dtype not in READ_DTYPES:
    raise TypeError(
        f"{op}: {name} must be a float dtype of {', '.join(d.name for d in READ_DTYPES)}, "
        f"got {dtype}"
    )
  return dtype


# ----------------------------------------------------------------- writes
def _write_layer(
    cache: MLAKVCache, layer_id: int, loc: jax.Array, nope: jax.Array, rope: jax.Array,
    implementation: Implementation | tuple[str, ...], op: str, sanitize: bool = False,
) -> MLAKVCache:
  if loc.shape[0] == 0:
    return cache
  quantized = cache.config.quantized

  def write(backend, buffers, loc, nope, rope):
    if quantized:
      return backend.set_rows_per_token_head(*buffers, loc, nope, rope, sanitize=sanitize)
    return (backend.set_rows(buffers[0], loc, nope, rope, sanitize=sanitize),)

  new = _run(op, implementation_order(implementation), write, cache.layer(layer_id), loc,
             nope, rope)
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
    layer_id: static layer index (a `StackedMLAKVCache` also takes a traced integer scalar).
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
  check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  tokens = loc.shape[0]
  nope = check_rows_input(cache_k_nope, "cache_k_nope", tokens, cfg.kv_lora_rank, op)
  rope = check_rows_input(cache_k_rope, "cache_k_rope", tokens, cfg.qk_rope_head_dim, op)
  return _write_layer(cache, layer_id, loc, nope, rope, implementation, op, bool(sanitize))


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
  check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  cache_k = check_rows_input(cache_k, "cache_k", loc.shape[0], cfg.kv_cache_dim, op)
  nope, rope = cache_k[..., : cfg.kv_lora_rank], cache_k[..., cfg.kv_lora_rank:]
  return _write_layer(cache, layer_id, loc, nope, rope, implementation, op, bool(sanitize))


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
    layer_id: static layer index (a `StackedMLAKVCache` also takes a traced integer scalar).
    loc: (T,) integer slots; out-of-range slots read as zeros.
    dst_dtype: output dtype; default `dtype` in plain mode, `model_dtype` in
      per_token_head mode (the seed defaults to the fp8 dtype there, which would
      re-quantize without the scale: a trap we avoid).
  Returns:
    (nope (T, 1, kv_lora_rank), rope (T, 1, qk_rope_head_dim)) in dst_dtype.
  """
  op = "get_mla_kv_buffer"
  check_cache(cache, op)
  cfg = cache.config
  layer_id = check_layer_id(cache, layer_id, op)
  loc = check_loc(loc, "loc", op)
  dst_dtype = cfg.default_read_dtype if dst_dtype is None else check_dtype(dst_dtype, "dst_dtype", op)
  tokens = loc.shape[0]
  if tokens == 0:
    return (jnp.zeros((0, 1, cfg.kv_lora_rank), dst_dtype),
            jnp.zeros((0, 1, cfg.qk_rope_head_dim), dst_dtype))

  def read(backend, buffers, loc):
    if cfg.quantized:
      return backend.get_rows_per_token_head(*buffers, loc, dst_dtype=dst_dtype)
    return backend.get_rows(buffers[0], loc, kv_lora_rank=cfg.kv_lora_rank, dst_dtype=dst_dtype)

  return _run(op, implementation_order(implementation), read, cache.layer(layer_id), loc)


# ----------------------------------------------------------------- moves
def check_pair(tgt: Any, src: Any, op: str, names=("tgt_loc", "src_loc")):
  """The (target, source) index arrays of a move, each through `check_loc`: two int32 (T,)
  arrays of one length. `names` are the parameter names the errors quote."""
  tgt = check_loc(tgt, names[0], op)
  src = check_loc(src, names[1], op)
  if tgt.shape != src.shape:
    raise ValueError(
        f"{op}: {names[0]} and {names[1]} must have the same length, got "
        f"{tgt.shape[0]} and {src.shape[0]}"
    )
  return tgt, src


@functools.partial(jax.jit, static_argnames=("implementation", "_layers"),
                   donate_argnames=("cache",))
def _move_kv_cache(
    cache: MLAKVCache,
    tgt_loc: jax.Array,
    src_loc: jax.Array,
    *,
    implementation: Implementation = None,
    _layers: int = 1,
) -> MLAKVCache:
  """Move token rows in every layer and buffer: `rows[tgt[i]] = old_rows[src[i]]`.

  All reads happen before any write (overlapping sets are safe); pairs with an
  out-of-range index are skipped; empty is a no-op. Donates `cache`.
  """
  op = "move_kv_cache"
  check_cache(cache, op)
  check_buffers(cache, op)
  tgt, src = check_pair(tgt_loc, src_loc, op)
  if tgt.shape[0] == 0:
    return cache

  def move(backend, buffers, tgt, src):
    return tuple(backend.move_rows(buffers, tgt, src, layers=_layers))

  moved = _run(op, implementation_order(implementation), move, cache.flat_buffers(), tgt, src)
  return cache.with_flat_buffers(moved)


@functools.partial(jax.jit, static_argnames=("implementation", "_layers"),
                   donate_argnames=("cache",))
def _move_kv_pages(
    cache: MLAKVCache,
    tgt_pages: jax.Array,
    src_pages: jax.Array,
    *,
    implementation: Implementation = None,
    _layers: int = 1,
) -> MLAKVCache:
  """Copy whole pages (`page_size` rows) in every layer and buffer.

  `pages[tgt[i]] = old_pages[src[i]]`, snapshot semantics as `move_kv_cache`;
  pages not wholly inside the buffer are skipped. vLLM's copy_blocks. Donates `cache`.
  """
  op = "move_kv_pages"
  check_cache(cache, op)
  check_buffers(cache, op)
  tgt, src = check_pair(tgt_pages, src_pages, op, ("tgt_pages", "src_pages"))
  if tgt.shape[0] == 0:
    return cache
  page_size = cache.config.page_size

  def move(backend, buffers, tgt, src):
    return tuple(backend.move_pages(buffers, tgt, src, page_size=page_size, layers=_layers))

  moved = _run(op, implementation_order(implementation), move, cache.flat_buffers(), tgt, src)
  return cache.with_flat_buffers(moved)


set_mla_kv_buffer = _public(_set_mla_kv_buffer)
set_kv_buffer = _public(_set_kv_buffer)
get_mla_kv_buffer = _public(_get_mla_kv_buffer)
move_kv_cache = _public(_move_kv_cache)
move_kv_pages = _public(_move_kv_pages)
