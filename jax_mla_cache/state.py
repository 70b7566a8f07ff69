"""The immutable pytree state of an MLA KV cache.

`MLAKVCache` is a registered dataclass: its leaves are the per-layer buffers and
its config is static metadata, so it passes through `jax.jit` (and can be donated)
like any pytree. Every op returns a new state; under a donating jit the kernels
update the buffers in place.

Layout per layer (SPEC §1-2), `rows = size + page_size`:

* plain:          `(kv,)`                   kv    (rows, 1, R+Rr) `dtype`
* per_token_head: `(nope, scale, rope)`     nope  (rows, 1, R)    float8_e4m3fn
                                            scale (rows, 1, 1)    float32
                                            rope  (rows, 1, Rr)   `model_dtype`
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_mla_cache.config import MLACacheConfig
from pallas_kernels import exact

LayerBuffers = tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAKVCache:
  """KV cache state: `buffers[layer]` is that layer's tuple of buffers."""

  buffers: tuple[LayerBuffers, ...]
  config: MLACacheConfig = dataclasses.field(metadata=dict(static=True))

  @property
  def layer_num(self) -> int:
    return len(self.buffers)

  def layer(self, layer_id: int) -> LayerBuffers:
    """The buffers of one layer (a tuple; see the module docstring)."""
    return self.buffers[layer_id]

  def replace_layer(self, layer_id: int, new: LayerBuffers) -> "MLAKVCache":
    """A new state with layer `layer_id`'s buffers replaced."""
    buffers = list(self.buffers)
    buffers[layer_id] = tuple(new)
    return dataclasses.replace(self, buffers=tuple(buffers))

  def layer_view(self, layer_id: int) -> "MLAKVCache":
    """Layer `layer_id` alone, as a one-layer cache (layer 0; its config has layer_num=1).

    The public per-layer ops run their jitted cores on this view and put the result back
    with `with_layer`: every layer of a model then shares one trace and one lowered
    function of each op (a core jitted over the whole cache with a static layer_id is
    traced and lowered again for every layer).
    """
    return MLAKVCache(buffers=(self.buffers[layer_id],),
                      config=self.config.replace(layer_num=1))

  def with_layer(self, layer_id: int, view: "MLAKVCache") -> "MLAKVCache":
    """A new state with layer `layer_id`'s buffers taken from a `layer_view`."""
    return self.replace_layer(layer_id, view.buffers[0])

  def flat_buffers(self) -> tuple[jax.Array, ...]:
    """All buffers, layer-major: layer 0's buffers, then layer 1's, ..."""
    return tuple(b for layer in self.buffers for b in layer)

  def with_flat_buffers(self, flat: tuple[jax.Array, ...]) -> "MLAKVCache":
    """Inverse of `flat_buffers`."""
    per = len(self.buffers[0]) if self.buffers else 0
    buffers = tuple(tuple(flat[i * per:(i + 1) * per]) for i in range(len(self.buffers)))
    return dataclasses.replace(self, buffers=buffers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedMLAKVCache:
  """KV cache state with all layers in one buffer per plane, for models that run their
  layers under `jax.lax.scan`: the per-layer ops then take a traced `layer_id`.

  `buffers` holds one array per plane (plain: `(kv,)`; per_token_head: `(nope, scale,
  rope)`, as a layer of `MLAKVCache`), each `(layer_num * rows, 1, width)`: layer l owns
  rows `[l * rows, (l + 1) * rows)`. The per-layer ops (`set_mla_kv_buffer`,
  `set_kv_buffer`, `get_mla_kv_buffer`, `rope_set_mla_kv_buffer`, `mla_decode`) take slots
  and page ids of the layer as with `MLAKVCache` and add the layer's offset themselves
  (slots outside the layer are skipped, page ids outside it masked, and a traced
  `layer_id` outside `[0, layer_num)` skips every write and reads nothing); the moves
  (`move_kv_cache`, `move_kv_pages`) act on every layer. The buffers stay flat on purpose:
  a `(layer_num, rows, ...)` carry reshaped inside a scan body made XLA:CPU copy it every
  iteration (a layout change), a flat one is updated in place. `size` must be a multiple
  of `page_size` (so is `rows`: every layer starts on a page of the stacked buffers).

  The host tier (`get_cpu_copy` / `load_cpu_copy`) takes it too (the same `HostCopy` as
  the contents unstacked). `jax_mla_cache.sharding.init_sharded_cache(config, layout,
  stacked=True)` shards one (data_parallel, replicated, context_parallel: every rank's shard
  is its own stacked cache). Not supported on this state (convert with `unstack` /
  `from_layers`, which copy): `MLATokenToKVPool`.
  """

  buffers: LayerBuffers
  config: MLACacheConfig = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    check_stackable(self.config, "StackedMLAKVCache")
    if self.config.layer_num * self.config.rows >= 2**31:
      raise ValueError(
          f"StackedMLAKVCache: layer_num x rows = {self.config.layer_num} x "
          f"{self.config.rows} must stay below 2**31 (the ops index the stacked rows with "
          "int32); use an MLAKVCache, whose layers are separate buffers")

  @property
  def layer_num(self) -> int:
    return self.config.layer_num

  @classmethod
  def from_layers(cls, cache: MLAKVCache) -> "StackedMLAKVCache":
    """The same contents, stacked (a copy of every buffer)."""
    planes = zip(*cache.buffers)
    return cls(buffers=tuple(jnp.concatenate(p, axis=0) for p in planes),
               config=cache.config)

  def unstack(self) -> MLAKVCache:
    """The same contents as an `MLAKVCache` (a copy of every buffer)."""
    return MLAKVCache(buffers=tuple(self.layer(l) for l in range(self.layer_num)),
                      config=self.config)

  def layer(self, layer_id: int) -> LayerBuffers:
    """Layer `layer_id`'s rows of each plane (static slices: copies, for inspection)."""
    rows = self.config.rows
    return tuple(b[layer_id * rows:(layer_id + 1) * rows] for b in self.buffers)

  def layer_view(self, layer_id: Any = None) -> MLAKVCache:
    """Every layer as the one layer of an `MLAKVCache` of `layer_num * rows` rows (no copy):
    what the per-layer ops run their cores on, with indices moved by `layer_rows` /
    `layer_pages` (`layer_id` is not needed: the view is the same for every layer)."""
    del layer_id
    size = self.layer_num * self.config.rows - self.config.page_size
    return MLAKVCache(buffers=(tuple(self.buffers),),
                      config=self.config.replace(layer_num=1, size=size))

  def with_layer(self, layer_id: Any, view: MLAKVCache) -> "StackedMLAKVCache":
    """A new state with the buffers of a `layer_view`."""
    del layer_id
    return dataclasses.replace(self, buffers=tuple(view.buffers[0]))

  def flat_buffers(self) -> tuple[jax.Array, ...]:
    """All buffers: the planes, each holding every layer (`MLAKVCache.flat_buffers`' twin)."""
    return tuple(self.buffers)

  def with_flat_buffers(self, flat: tuple[jax.Array, ...]) -> "StackedMLAKVCache":
    """Inverse of `flat_buffers`."""
    return dataclasses.replace(self, buffers=tuple(flat))

  def layer_rows(self, layer_id: Any, loc: jax.Array) -> jax.Array:
    """Slots `loc` (int32 (T,)) of layer `layer_id` (an int or an integer scalar, traced or
    not) as rows of the stacked buffers: -1 (skipped by every op) where the slot is outside
    `[0, rows)` or the layer outside `[0, layer_num)`."""
    return _in_layer(layer_id, loc, self.config.rows, self.layer_num)

  def layer_pages(self, layer_id: Any, pages: jax.Array) -> jax.Array:
    """Page ids (int32, any shape) of layer `layer_id` as pages of the stacked buffers; -1
    (masked) where the id is outside `[0, rows // page_size)` or the layer outside
    `[0, layer_num)`."""
    return _in_layer(layer_id, pages, self.config.rows // self.config.page_size,
                     self.layer_num)

  def every_layer(self, index: jax.Array, per_layer: int) -> jax.Array:
    """Indices (int32 (T,)) valid in `[0, per_layer)` in every layer: (layer_num * T,) of
    the stacked buffers, layer by layer; -1 where outside (a move's pairs for all layers)."""
    return exact.every_block(index, per_layer, self.layer_num)


def check_stackable(cfg: MLACacheConfig, op: str) -> None:
  """ValueError unless layers of `cfg` can be stacked: `rows` a multiple of `page_size`, so
  that every layer starts on a page of the stacked buffers (`mla_decode` and
  `move_kv_pages` address a layer's pages there)."""
  if cfg.rows % cfg.page_size:
    whole = -(-cfg.size // cfg.page_size) * cfg.page_size
    raise ValueError(
        f"{op}: a stacked cache needs rows = size + page_size = {cfg.rows} to be a multiple "
        f"of page_size = {cfg.page_size}, so that every layer starts on a page of the "
        f"stacked buffers (mla_decode and move_kv_pages address a layer's pages there); "
        f"use size={whole} (or {whole - cfg.page_size}), or an MLAKVCache")


def _in_layer(layer_id: Any, index: jax.Array, per_layer: int, layer_num: int) -> jax.Array:
  """`index + layer_id * per_layer` in int32 (no overflow: `StackedMLAKVCache` keeps
  layer_num x rows below 2**31), -1 where the index or the layer is out of range."""
  index = jnp.asarray(index)
  ok = (index >= 0) & (index < per_layer)
  if isinstance(layer_id, int):
    base = layer_id * per_layer
  else:
    layer = jnp.asarray(layer_id)
    ok = ok & (layer >= 0) & (layer < layer_num)   # (compared in its own width)
    base = jnp.clip(layer, 0, layer_num - 1).astype(jnp.int32) * per_layer
  return jnp.where(ok, index.astype(jnp.int32) + base, -1).astype(jnp.int32)


def init_cache(
    config: MLACacheConfig,
    *,
    device: Any = None,
    sharding: jax.sharding.Sharding | None = None,
    stacked: bool = False,
) -> MLAKVCache | StackedMLAKVCache:
  """A zero-filled cache for `config`.

  Args:
    config: the cache geometry and storage mode.
    device: optional device to place the buffers on (default: JAX's default).
    sharding: optional sharding for every buffer (see `jax_mla_cache.sharding`
      for the supported layouts); exclusive with `device`.
    stacked: a `StackedMLAKVCache` (every layer in one buffer per plane, for layers run
      under `jax.lax.scan`) instead of an `MLAKVCache`; not with `sharding` (a sharded
      stacked cache: `jax_mla_cache.sharding.init_sharded_cache(config, layout,
      stacked=True)`).
  """
  if not isinstance(config, MLACacheConfig):
    raise TypeError(f"init_cache: config must be an MLACacheConfig, got "
                    f"{type(config).__name__}")
  if device is not None and not isinstance(device, jax.Device):
    raise TypeError(f"init_cache: device must be a jax.Device (e.g. jax.devices()[0]) or "
                    f"None, got {type(device).__name__} {device!r}")
  if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
    raise TypeError(f"init_cache: sharding must be a jax.sharding.Sharding or None, got "
                    f"{type(sharding).__name__} {sharding!r}")
  if device is not None and sharding is not None:
    raise ValueError("init_cache: pass device or sharding, not both")
  if stacked and sharding is not None:
    raise ValueError("init_cache: a stacked cache is not shardable here; use "
                     "jax_mla_cache.sharding.init_sharded_cache(config, layout, stacked=True), "
                     "whose rank-major layout the sharded ops take")
  return zeros_cache(config, sharding if sharding is not None else device, stacked=stacked)


def zeros_cache(config: MLACacheConfig, placement: Any = None, *, stacked: bool = False
                ) -> MLAKVCache | StackedMLAKVCache:
  """`init_cache` without its checks: zero-filled buffers on `placement` (None, a device or a
  sharding). Also what `jax_mla_cache.sharding` builds its rank-major stacked caches with."""

  def zeros(shape, dtype):
    if placement is None:
      return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=_as_sharding(placement))()

  return _build(config, zeros, stacked)


def _build(config: MLACacheConfig, make: Any, stacked: bool) -> MLAKVCache | StackedMLAKVCache:
  """A cache of `make(shape, dtype)` leaves: per layer and plane, or (`stacked`) per plane
  holding every layer."""
  if stacked:
    return StackedMLAKVCache(
        buffers=tuple(make((config.layer_num * shape[0], *shape[1:]), dtype)
                      for shape, dtype in config.buffer_shapes()),
        config=config)
  buffers = tuple(
      tuple(make(shape, dtype) for shape, dtype in config.buffer_shapes())
      for _ in range(config.layer_num)
  )
  return MLAKVCache(buffers=buffers, config=config)


def _as_sharding(placement: Any) -> jax.sharding.Sharding:
  if isinstance(placement, jax.sharding.Sharding):
    return placement
  return jax.sharding.SingleDeviceSharding(placement)


def cache_spec(config: MLACacheConfig, *, stacked: bool = False
               ) -> MLAKVCache | StackedMLAKVCache:
  """A cache of `jax.ShapeDtypeStruct` leaves (for `jax.eval_shape`/AOT lowering); with
  `stacked`, a `StackedMLAKVCache`'s."""
  return _build(config, jax.ShapeDtypeStruct, stacked)
