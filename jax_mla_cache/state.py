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


def init_cache(
    config: MLACacheConfig,
    *,
    device: Any = None,
    sharding: jax.sharding.Sharding | None = None,
) -> MLAKVCache:
  """A zero-filled cache for `config`.

  Args:
    config: the cache geometry and storage mode.
    device: optional device to place the buffers on (default: JAX's default).
    sharding: optional sharding for every buffer (see `jax_mla_cache.sharding`
      for the supported layouts); exclusive with `device`.
  """
  if device is not None and sharding is not None:
    raise ValueError("init_cache: pass device or sharding, not both")
  placement = sharding if sharding is not None else device

  def zeros(shape, dtype):
    if placement is None:
      return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=_as_sharding(placement))()

  buffers = tuple(
      tuple(zeros(shape, dtype) for shape, dtype in config.buffer_shapes())
      for _ in range(config.layer_num)
  )
  return MLAKVCache(buffers=buffers, config=config)


def _as_sharding(placement: Any) -> jax.sharding.Sharding:
  if isinstance(placement, jax.sharding.Sharding):
    return placement
  return jax.sharding.SingleDeviceSharding(placement)


def cache_spec(config: MLACacheConfig) -> MLAKVCache:
  """A cache of `jax.ShapeDtypeStruct` leaves (for `jax.eval_shape`/AOT lowering)."""
  buffers = tuple(
      tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in config.buffer_shapes())
      for _ in range(config.layer_num)
  )
  return MLAKVCache(buffers=buffers, config=config)
