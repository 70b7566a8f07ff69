"""Sharded caches over a JAX mesh: four layouts, every op computed per shard.

A `ShardedLayout` says how the per-layer buffers spread over one axis of a mesh;
`init_sharded_cache(config, layout)` builds a `ShardedMLAKVCache` (the plain
`MLAKVCache` of global arrays plus the static layout), and this module's ops take
it. Each op runs the ordinary op (`jax_mla_cache.dispatch`, `rope_write`,
`attention`, `offload`) on every shard under `jax.shard_map(..., check_vma=False)`,
so the XLA scatter or the Pallas kernel updates each device's shard in place; the
ops are jitted, donate the cache where they return it, and keep every buffer's
sharding. The ops that run an unsharded public op are generated from one table,
`OPS` (`ShardedOp`: the op, how each array argument and result spreads over a
layout, one layer or all); the host-offload pair is written out below it.

Layouts (`world` = size of `layout.axis`; `rows` = the logical config's rows):

* "data_parallel" -- each rank along the axis holds its own pool of `rows` rows
  (a DP-attention rank). Global buffers have `world * rows` rows sharded along
  the axis: rank k's pool is global rows `[k*rows, (k+1)*rows)`. Token arguments
  (`loc`, values, move pairs, offload indices) are a global batch of T tokens,
  `T % world == 0`, split along the axis: rank k owns tokens
  `[k*T/world, (k+1)*T/world)` and their `loc` values are *rank-local* rows of
  its own pool. `get_mla_kv_buffer` returns the batch sharded the same way.
* "pipeline" -- layers split into `world` contiguous stages (stage s holds layers
  `[s*L//world, (s+1)*L//world)`, as the engines' `get_pp_indices`); a layer's
  buffers live on its stage's devices (the mesh slice at index s of the axis,
  replicated over the other axes). `loc` is the ordinary row index. One JAX
  program cannot take arrays on disjoint device sets, so a stage's jitted step
  runs on `stage_view(cache, s)` (stage-local layer ids) and
  `with_stage(cache, s, view)` puts the result back; the ops of this module
  accept the whole pipeline cache eagerly and run one call per stage.
* "replicated" -- tensor-parallel replicas: MLA has one latent head, so every
  rank holds the whole cache and writes the same rows. `loc` is the ordinary
  row index; token arguments are replicated.
* "context_parallel" -- decode context parallelism: token rows are interleaved,
  logical row r lives on rank `r % world` at local row `r // world` (the global
  array holds rank k's rows at `[k*rows/world, (k+1)*rows/world)`). `loc` is the
  logical row, token arguments are replicated; each rank maps the tokens it does
  not own to slot -1, which the ops skip, and reads are combined across ranks
  (`mla_decode`: each rank attends the positions it holds, merged by lse).
  Page p's rows are local page p of every rank (local page size
  `page_size / world`), so page moves need no communication; a token move whose
  source and target live on different ranks goes through one all-reduce.
  Needs `page_size % world == 0` and `rows % world == 0`.

Stacked caches (layers under `jax.lax.scan`): `init_sharded_cache(config, layout,
stacked=True)` makes `ShardedMLAKVCache.cache` a `StackedMLAKVCache` (one buffer per plane
for every layer) for the data_parallel, replicated and context_parallel layouts. Its global
flat buffers are *rank-major*: the shard a rank holds is exactly its own stacked cache of
all layers, `(layer_num * local_rows, 1, width)` with layer l at local rows
`[l * local_rows, (l + 1) * local_rows)` (`local_rows` = the shard config's rows: `rows`
for data_parallel and replicated, `rows / world` for context_parallel). A global array of
`world * layer_num * local_rows` rows (replicated: `layer_num * rows`) is therefore *not*
layer-major over the whole mesh: read a layer through the ops or `unstack()`, not
`cache.cache.layer(l)`. Every op runs the unsharded op on each shard's stacked cache,
with `layer_id` a static int or a traced integer scalar (it enters the shard_map as a
replicated scalar argument, so every layer shares one trace): per-layer ops act on that
layer of each shard (a traced layer id outside `[0, layer_num)` writes nothing and reads
zeros / lse -inf), moves and the host tier act on every layer. Token arguments, results
and host copies are laid out as for the unstacked cache of the same layout (a host copy of
one loads into the other). Pipeline layouts take no stacked cache (ValueError): a stage's
devices hold only that stage's layers, so one buffer of every layer has no place to live.
Stack per stage instead: each stage's program keeps its own cache of its layers,
`init_sharded_cache(stage_config, ShardedLayout("replicated", layout.stage_mesh(s),
layout.axis), stacked=True)`, as `stage_view` gives an unstacked pipeline cache's stage.

Equivalent single-device code, per layout (plain mode, in-range slots)::

    data_parallel:    pools[k] = set(pools[k], loc[k*T/w:(k+1)*T/w], ...)   for each rank k
    pipeline:         the unsharded op (buffers placed per stage)
    replicated:       the unsharded op (on every rank)
    context_parallel: the unsharded op on the logical cache
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_mla_cache import attention, dispatch, offload, reference, rope_write
from jax_mla_cache.config import MLACacheConfig
from jax_mla_cache.dispatch import Implementation
from jax_mla_cache.state import (MLAKVCache, StackedMLAKVCache, check_stackable, init_cache,
                                 zeros_cache)
from pallas_kernels.mla_decode import finish_lse_merge

# The generated ops' signatures name `Implementation` (typing.get_type_hints resolves it here).
_ANNOTATION_NAMES = (Implementation,)

LayoutKind = Literal["data_parallel", "pipeline", "replicated", "context_parallel"]
LAYOUT_KINDS = ("data_parallel", "pipeline", "replicated", "context_parallel")


# ----------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """How a cache spreads over `mesh` along `axis` (module docstring).

  Three configs meet here. The *logical* config is what `loc` addresses and what
  `init_sharded_cache` takes (data_parallel: one rank's pool). The *storage*
  config describes the global arrays (`ShardedMLAKVCache.cache.config`). The
  *shard* config describes one device's shard, on which the ordinary ops run.
  """

  kind: LayoutKind
  mesh: Mesh
  axis: str

  def __post_init__(self):
    if self.kind not in LAYOUT_KINDS:
      raise ValueError(f"ShardedLayout: kind must be one of {LAYOUT_KINDS}, got {self.kind!r}")
    if not isinstance(self.mesh, Mesh):
      raise TypeError(f"ShardedLayout: mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
    if self.axis not in self.mesh.axis_names:
      raise ValueError(
          f"ShardedLayout: axis must be one of the mesh axes {self.mesh.axis_names}, got {self.axis!r}"
      )

  @property
  def world(self) -> int:
    """Ranks along `axis`."""
    return self.mesh.shape[self.axis]

  @property
  def row_split(self) -> bool:
    """Whether buffer rows are split along the axis (data_parallel, context_parallel)."""
    return self.kind in ("data_parallel", "context_parallel")

  @property
  def buffer_spec(self) -> P:
    return P(self.axis) if self.row_split else P()

  @property
  def token_spec(self) -> P:
    """How token arguments and results are laid out: a batch split along the axis
    (data_parallel) or replicated."""
    return P(self.axis) if self.kind == "data_parallel" else P()

  # -- configs
  def storage_config(self, config: MLACacheConfig) -> MLACacheConfig:
    """The global arrays' geometry for the logical `config`."""
    if self.kind == "data_parallel":
      return config.replace(size=self.world * config.rows - config.page_size)
    if self.kind == "context_parallel":
      if config.page_size % self.world or config.rows % self.world:
        raise ValueError(
            f"context_parallel over {self.world} ranks needs page_size and rows "
            f"(size + page_size) divisible by {self.world}, got page_size="
            f"{config.page_size}, rows={config.rows}"
        )
    return config

  def logical_config(self, storage: MLACacheConfig) -> MLACacheConfig:
    """Inverse of `storage_config`."""
    return self.shard_config(storage) if self.kind == "data_parallel" else storage

  def shard_config(self, storage: MLACacheConfig) -> MLACacheConfig:
    """One device's shard of the storage geometry."""
    if self.kind == "data_parallel":
      return storage.replace(size=storage.rows // self.world - storage.page_size)
    if self.kind == "context_parallel":
      page_size = storage.page_size // self.world
      return storage.replace(size=storage.rows // self.world - page_size, page_size=page_size)
    return storage

  # -- pipeline stages
  def stage_layers(self, stage: int, layer_num: int) -> range:
    """The layers of pipeline stage `stage` (contiguous; may be empty)."""
    return range(stage * layer_num // self.world, (stage + 1) * layer_num // self.world)

  def stage_of(self, layer_id: int, layer_num: int) -> int:
    return next(s for s in range(self.world) if layer_id in self.stage_layers(s, layer_num))

  def stage_mesh(self, stage: int) -> Mesh:
    """The mesh slice at index `stage` of the axis (the axis kept, of size 1)."""
    index = self.mesh.axis_names.index(self.axis)
    devices = np.take(self.mesh.devices, [stage], axis=index)
    return Mesh(devices, self.mesh.axis_names)

  def buffer_sharding(self, layer_id: int, layer_num: int) -> NamedSharding:
    """Where layer `layer_id`'s buffers live."""
    if self.kind == "pipeline":
      return NamedSharding(self.stage_mesh(self.stage_of(layer_id, layer_num)), P())
    return NamedSharding(self.mesh, self.buffer_spec)


# ----------------------------------------------------------------- state
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedMLAKVCache:
  """A cache of global sharded arrays (`cache`, storage geometry) and its layout.

  `cache` is an `MLAKVCache` (`buffers[layer][plane]`, each `(storage rows, 1, width)`) or,
  for a stacked cache (`init_sharded_cache(..., stacked=True)`), a `StackedMLAKVCache`
  (`buffers[plane]`, each `(layer_num * storage rows, 1, width)`, rank-major: rank k's shard
  is its own stacked cache of every layer, module docstring).
  """

  cache: MLAKVCache | StackedMLAKVCache
  layout: ShardedLayout = dataclasses.field(metadata=dict(static=True))

  @property
  def stacked(self) -> bool:
    """Whether `cache` is a `StackedMLAKVCache` (rank-major, module docstring)."""
    return isinstance(self.cache, StackedMLAKVCache)

  @property
  def config(self) -> MLACacheConfig:
    """The logical config (what `loc` addresses)."""
    return self.layout.logical_config(self.cache.config)

  @property
  def buffers(self):
    return self.cache.buffers

  def replace(self, cache: MLAKVCache | StackedMLAKVCache) -> "ShardedMLAKVCache":
    return dataclasses.replace(self, cache=cache)

  def layer_view(self, layer_id: int) -> "ShardedMLAKVCache":
    """Layer `layer_id` alone, as a one-layer sharded cache (`MLAKVCache.layer_view`).
    Unstacked caches only (the ops of a stacked one pass the layer id into every shard)."""
    if self.stacked:
      raise TypeError("ShardedMLAKVCache.layer_view: a stacked sharded cache has no one-layer "
                      "view (its ops take the layer id, static or traced, into every shard)")
    return self.replace(self.cache.layer_view(layer_id))

  def with_layer(self, layer_id: int, view: "ShardedMLAKVCache") -> "ShardedMLAKVCache":
    """A new state with layer `layer_id` taken from a `layer_view`."""
    return self.replace(self.cache.with_layer(layer_id, view.cache))

  def unstack(self) -> "ShardedMLAKVCache":
    """A stacked cache's contents as an unstacked cache of the same layout (a copy of every
    buffer, made shard by shard: `StackedMLAKVCache.unstack` of each rank's stacked cache,
    no communication). Layer l's global buffers then hold every rank's layer l as the
    unstacked layout does."""
    if not self.stacked:
      raise TypeError("ShardedMLAKVCache.unstack: the cache is not stacked")
    return self.replace(_restack(self.layout, self.cache, stacked=False))

  @classmethod
  def from_layers(cls, cache: "ShardedMLAKVCache") -> "ShardedMLAKVCache":
    """An unstacked sharded cache's contents as a stacked one of the same layout (a copy of
    every buffer, made shard by shard: each rank's layers become its stacked cache, the
    rank-major layout of the module docstring; no communication)."""
    _check_sharded(cache, "ShardedMLAKVCache.from_layers")
    if cache.stacked:
      raise TypeError("ShardedMLAKVCache.from_layers: the cache is already stacked")
    _check_stackable(cache.layout, "ShardedMLAKVCache.from_layers", cache.cache.config)
    return cache.replace(_restack(cache.layout, cache.cache, stacked=True))


def _check_stackable(layout: ShardedLayout, op: str,
                     storage: MLACacheConfig | None = None) -> None:
  """ValueError unless `layout` takes a stacked cache (not pipeline) and, given the
  `storage` config, every shard's layers start on a page (`state.check_stackable`)."""
  if layout.kind == "pipeline":
    raise ValueError(
        f"{op}: a pipeline layout takes no stacked cache: a stage's devices hold only that "
        "stage's layers, so one flat buffer of every layer has no place to live. Stack per "
        "stage instead: a cache of the stage's layers for each stage's program, "
        "init_sharded_cache(stage_config, ShardedLayout('replicated', "
        "layout.stage_mesh(s), layout.axis), stacked=True)")
  if storage is not None:
    check_stackable(layout.shard_config(storage), op)


def _restack(layout: ShardedLayout, storage: MLAKVCache | StackedMLAKVCache,
             stacked: bool) -> MLAKVCache | StackedMLAKVCache:
  """`storage`'s contents stacked (`stacked`) or unstacked, every shard on its own (the
  rank-major layout: a shard's stacked cache is its layers stacked)."""
  shard = layout.shard_config(storage.config)

  def body(buffers):
    if stacked:
      return StackedMLAKVCache.from_layers(MLAKVCache(buffers=buffers, config=shard)).buffers
    return StackedMLAKVCache(buffers=buffers, config=shard).unstack().buffers

  spec = layout.buffer_spec
  buffers = jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(spec,), out_specs=spec,
                                  check_vma=False))(storage.buffers)
  kind = StackedMLAKVCache if stacked else MLAKVCache
  return kind(buffers=buffers, config=storage.config)


def init_sharded_cache(config: MLACacheConfig, layout: ShardedLayout, *,
                       stacked: bool = False) -> ShardedMLAKVCache:
  """A zero-filled cache of logical geometry `config` laid out as `layout`.

  Args:
    config: the logical geometry (what `loc` addresses; data_parallel: one rank's pool).
    layout: the `ShardedLayout`.
    stacked: `cache` a `StackedMLAKVCache` (layers under `jax.lax.scan`: the ops take a
      traced `layer_id`), not with a pipeline layout (ValueError). Its global buffers are
      `(layer_num * storage rows, 1, width)`, rank-major: rank k's shard is its own stacked
      cache of all layers, `(layer_num * local_rows, 1, width)` (module docstring).
      Otherwise `cache` is an `MLAKVCache`: `layer_num` buffers per plane of
      `(storage rows, 1, width)` (storage rows: data_parallel `world * rows`, the others
      `rows`).
  """
  if not isinstance(layout, ShardedLayout):
    raise TypeError(f"init_sharded_cache: layout must be a ShardedLayout, got {type(layout).__name__}")
  storage = layout.storage_config(config)
  if stacked:
    _check_stackable(layout, "init_sharded_cache", storage)
    # (Zeros: the rank-major order needs no placement of its own.)
    cache = zeros_cache(storage, layout.buffer_sharding(0, storage.layer_num), stacked=True)
    return ShardedMLAKVCache(cache=cache, layout=layout)
  if layout.kind == "pipeline":
    one_layer = storage.replace(layer_num=1)
    buffers = tuple(
        init_cache(one_layer, sharding=layout.buffer_sharding(l, storage.layer_num)).buffers[0]
        for l in range(storage.layer_num)
    )
    cache = MLAKVCache(buffers=buffers, config=storage)
  else:
    cache = init_cache(storage, sharding=layout.buffer_sharding(0, storage.layer_num))
  return ShardedMLAKVCache(cache=cache, layout=layout)


def stage_view(cache: ShardedMLAKVCache, stage: int) -> ShardedMLAKVCache:
  """Pipeline stage `stage`'s layers as a cache of their own (layer ids stage-local),
  replicated over the stage's devices: what a stage's jitted step takes."""
  layout = cache.layout
  if layout.kind != "pipeline":
    raise ValueError(f"stage_view: needs a pipeline layout, got {layout.kind!r}")
  layers = layout.stage_layers(stage, cache.cache.config.layer_num)
  if not layers:
    raise ValueError(f"stage_view: pipeline stage {stage} holds no layers")
  view = MLAKVCache(
      buffers=cache.buffers[layers.start:layers.stop],
      config=cache.cache.config.replace(layer_num=len(layers)),
  )
  return ShardedMLAKVCache(view, ShardedLayout("replicated", layout.stage_mesh(stage), layout.axis))


def with_stage(cache: ShardedMLAKVCache, stage: int, view: ShardedMLAKVCache) -> ShardedMLAKVCache:
  """`cache` with stage `stage`'s layers taken from `view` (from `stage_view`)."""
  layers = cache.layout.stage_layers(stage, cache.cache.config.layer_num)
  buffers = list(cache.buffers)
  buffers[layers.start:layers.stop] = view.buffers
  return cache.replace(dataclasses.replace(cache.cache, buffers=tuple(buffers)))


def _stages(cache: ShardedMLAKVCache) -> list[int]:
  layer_num = cache.cache.config.layer_num
  return [s for s in range(cache.layout.world) if cache.layout.stage_layers(s, layer_num)]


def _to_stage(view: ShardedMLAKVCache, x: Any) -> Any:
  """Put a token argument on a stage's devices (activations travel between stages)."""
  if isinstance(x, (np.ndarray, jax.Array)):
    return jax.device_put(x, NamedSharding(view.layout.mesh, P()))
  return x


# ----------------------------------------------------------------- per shard
def _check_sharded(cache: Any, op: str) -> None:
  if not isinstance(cache, ShardedMLAKVCache):
    raise TypeError(f"{op}: cache must be a ShardedMLAKVCache, got {type(cache).__name__}")
  if cache.stacked:
    _check_stackable(cache.layout, op)


def _check_tokens(layout: ShardedLayout, tokens: int, name: str, op: str) -> None:
  if layout.kind == "data_parallel" and tokens % layout.world:
    raise ValueError(
        f"{op}: data_parallel splits {name} over {layout.world} ranks along its first "
        f"dimension, so that must be a multiple of {layout.world}, got {tokens}"
    )


def _local_cache(layout: ShardedLayout, storage: MLACacheConfig, buffers,
                 stacked: bool = False) -> MLAKVCache | StackedMLAKVCache:
  """The shard of `buffers` as an ordinary cache: an `MLAKVCache` of a tuple of layers, or
  with `stacked` a `StackedMLAKVCache` of every layer (`buffers` its tuple of planes)."""
  if stacked:
    return StackedMLAKVCache(buffers=tuple(buffers), config=layout.shard_config(storage))
  config = layout.shard_config(storage).replace(layer_num=len(buffers))
  return MLAKVCache(buffers=tuple(buffers), config=config)


def _every_layer(local: MLAKVCache | StackedMLAKVCache, loc: jax.Array) -> jax.Array:
  """Shard-local rows `loc` (T,) as the index of every buffer of `local.flat_buffers()`: `loc`
  itself (each buffer is one layer's), or for a stacked cache the rows of every layer,
  (layer_num * T,) layer by layer (`StackedMLAKVCache.every_layer`; -1 outside)."""
  if isinstance(local, StackedMLAKVCache):
    return local.every_layer(loc, local.config.rows)
  return loc


def _owned(layout: ShardedLayout, loc: jax.Array, rows: int) -> jax.Array:
  """context_parallel: whether this rank owns logical rows `loc`."""
  rank = lax.axis_index(layout.axis)
  return (loc >= 0) & (loc < rows) & (loc % layout.world == rank)


def _to_local(layout: ShardedLayout, loc: jax.Array, rows: int) -> jax.Array:
  """Rows as this shard addresses them; -1 (skipped) for rows it does not own."""
  if layout.kind != "context_parallel":
    return loc
  return jnp.where(_owned(layout, loc, rows), loc // layout.world, -1)


def _combine_owned(x: jax.Array, axis: str) -> jax.Array:
  """Sum over ranks where each element comes from one rank and is zero elsewhere.

  Summed as integer bit patterns: exact for every value (a float psum would turn
  -0.0 into +0.0)."""
  bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return lax.bitcast_convert_type(lax.psum(bits, axis), x.dtype)


# How an op's array arguments spread over the layout (`ShardedOp.arguments`):
SLOTS = "slots"
"""(T,) row indices, laid out like TOKENS. context_parallel: logical rows; each shard sees
the rows it owns as its local rows and the others as -1 (skipped)."""
PAGES = "pages"
"""(T,) page ids, laid out like TOKENS; no translation (context_parallel: page p is local
page p of every rank)."""
TOKENS = "tokens"
"""Per-token or per-sequence values, first dimension T (or B): split along the axis
(data_parallel) or replicated (the other layouts)."""
REPLICATED = "replicated"
"""The same array on every rank, whatever the layout (a RoPE table)."""
# What an op's results are (`ShardedOp.results`):
CACHE = "cache"
"""The updated buffers: the op returns the sharded cache."""
GATHERED = "gathered"
"""Rows read at the op's SLOTS, laid out like TOKENS. context_parallel: every rank reads
the rows it owns (the others read as zeros, SPEC: out-of-range reads are zeros) and the
ranks' results are summed bit-exactly (`_combine_owned`)."""
# A TOKENS result is laid out like the TOKENS arguments; every rank computes its own part
# (data_parallel) or the whole (the other layouts).


def _per_shard(layout: ShardedLayout, storage: MLACacheConfig, run: Callable,
               arguments: dict[str, str], results: tuple[str, ...], *,
               logical_slots: bool = False, stacked: bool = False) -> Callable:
  """`run` on every shard, under `jax.shard_map(..., check_vma=False)`.

  The returned function takes `(buffers, *arrays)`: a tuple of layers of global arrays (with
  `stacked`: the tuple of planes of a rank-major `StackedMLAKVCache`) and one array (or
  pytree) per entry of `arguments` (name -> SLOTS, PAGES, TOKENS or REPLICATED, in that
  order). Each shard calls `run(local, **arrays)` with its buffers as an ordinary
  `MLAKVCache` (storage geometry `layout.shard_config(storage)`; with `stacked`, a
  `StackedMLAKVCache` of every layer) and its part of the arrays, SLOTS made shard-local
  (`_to_local`) unless `logical_slots`. `run` returns one value per entry of `results`
  (CACHE: the local cache; TOKENS, GATHERED: arrays or pytrees); the function returns them
  laid out over the mesh (CACHE: the new buffers, as they came).
  """
  rows = storage.rows
  names = tuple(arguments)
  spec = {SLOTS: layout.token_spec, PAGES: layout.token_spec, TOKENS: layout.token_spec,
          REPLICATED: P(), CACHE: layout.buffer_spec, GATHERED: layout.token_spec}

  def body(buffers, *values):
    local = _local_cache(layout, storage, buffers, stacked)
    values = {
        name: _to_local(layout, x, rows) if arguments[name] == SLOTS and not logical_slots else x
        for name, x in zip(names, values)
    }
    outs = run(local, **values)
    combine = layout.kind == "context_parallel"
    return tuple(
        out.buffers if kind == CACHE
        else jax.tree.map(lambda x: _combine_owned(x, layout.axis), out)
        if kind == GATHERED and combine else out
        for kind, out in zip(results, outs, strict=True)
    )

  in_specs = (layout.buffer_spec,) + tuple(spec[arguments[name]] for name in names)
  out_specs = tuple(spec[kind] for kind in results)
  return jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


# ----------------------------------------------------------------- the table of ops
@dataclasses.dataclass(frozen=True)
class ShardedOp:
  """One op of this module: the unsharded op it runs on every shard and how its arguments
  and results spread over a layout. `sharded_op` generates the public function from it.

  Attributes:
    local: the unsharded public op (`jax_mla_cache.set_mla_kv_buffer`, ...). The sharded op
      takes its parameters (`cache` a `ShardedMLAKVCache`), carries its docstring below
      `doc`, and calls it on every shard: `local(shard, [layer,] **arrays, **static)`, with
      the shard's one layer (`per_layer`, `layer` 0) or all its layers as an ordinary
      `MLAKVCache`; on a stacked cache, the shard's `StackedMLAKVCache` of every layer and
      (`per_layer`) `layer` the layer id as a traced int scalar.
    arguments: the array parameters, name -> SLOTS, PAGES, TOKENS or REPLICATED (module
      constants). The first one's first dimension is the batch that data_parallel splits.
      Every other parameter but `cache` is static (jit-static, hashable).
    results: what `local` returns, one kind per value: CACHE, TOKENS or GATHERED.
    per_layer: the op touches layer `layer_id` only (a pipeline cache runs it on that
      layer's stage); otherwise every layer (a pipeline cache runs it on every stage).
    donates: whether the op donates `cache` (every op that returns it).
    doc: what the sharded op adds to the unsharded op's documentation.
    check: `check(config, arrays, static, op) -> arrays`: validates and normalizes the
      arrays against the logical config at trace time, before the shard_map (which would
      otherwise fail on a wrong shape with a less clear message).
    prepare: `prepare(cache, arguments)`: host-side checks before the jit, updating
      `arguments` in place (what a trace would lose: 64-bit host integers, a traced
      static).
    context_parallel: a replacement for `local` on context_parallel layouts, called as
      `fn(layout, storage_config, shard, **arrays, **static)` with logical SLOTS (a stacked
      cache's per-layer op: also `layer_id=`, the traced layer id; `shard` is then the
      shard's `StackedMLAKVCache`); or a string: why context_parallel is refused
      (NotImplementedError).
  """

  local: Callable
  arguments: dict[str, str]
  results: tuple[str, ...]
  per_layer: bool
  doc: str
  check: Callable | None = None
  prepare: Callable | None = None
  context_parallel: Callable | str | None = None

  @property
  def name(self) -> str:
    return self.local.__name__

  @property
  def donates(self) -> bool:
    return CACHE in self.results


def _check_writes(*inputs: tuple[str, str]) -> Callable:
  """`ShardedOp.check` of a write: `loc`, then (name, config width attribute) rows."""

  def check(config, arrays, static, op):
    loc = dispatch.check_loc(arrays["loc"], "loc", op)
    return dict(loc=loc, **{
        name: dispatch.check_rows_input(arrays[name], name, loc.shape[0], getattr(config, width), op)
        for name, width in inputs
    })

  return check


def _check_rope_set(config, arrays, static, op):
  names = ("loc", "positions", "q_nope", "q_rope", "k_nope", "k_rope", "cos_sin_cache")
  *values, _ = rope_write.check_inputs(
      config, *(arrays[name] for name in names), static["q_out_dtype"], op)
  return dict(zip(names, values))


def _prepare_rope_set(cache: ShardedMLAKVCache, arguments: dict) -> None:
  """rope_set_mla_kv_buffer's host-side step (as the unsharded op's): host positions of a
  64-bit or unsigned width clamped to the table before the jit narrows them."""
  arguments["positions"], arguments["cos_sin_cache"] = rope_write.host_positions(
      arguments["positions"], arguments["cos_sin_cache"])


def _check_loc(config, arrays, static, op):
  return dict(loc=dispatch.check_loc(arrays["loc"], "loc", op))


def _check_pair(config, arrays, static, op):
  names = tuple(arrays)  # (tgt_loc, src_loc) or (tgt_pages, src_pages)
  return dict(zip(names, dispatch.check_pair(*arrays.values(), op, names)))


def _prepare_decode(cache: ShardedMLAKVCache, arguments: dict) -> None:
  """mla_decode's host-side checks (`jax_mla_cache.mla_decode`), on the shard geometry."""
  arguments["sm_scale"] = attention.check_sm_scale(arguments["sm_scale"], "mla_decode")
  # The geometry the page table addresses: a rank's pool (data_parallel) or the logical
  # cache (context_parallel: logical pages, lengths up to P * page_size).
  view = MLAKVCache(buffers=(), config=cache.config)
  arguments["page_table"], arguments["seq_lens"] = attention.check_decode_args(
      view, arguments["q"], arguments["page_table"], arguments["seq_lens"], "mla_decode")


def _context_parallel_move(layout: ShardedLayout, storage: MLACacheConfig,
                           local: MLAKVCache | StackedMLAKVCache, *, tgt_loc, src_loc,
                           implementation) -> MLAKVCache | StackedMLAKVCache:
  """Token moves with interleaved rows: pairs whose two rows share an owner move
  locally (one kernel launch); the others read their source on its owner, meet
  through one all-reduce, and are written by the target's owner. All reads
  precede all writes (snapshot semantics, as `dispatch.move_kv_cache`). A stacked shard
  moves in every layer (`_every_layer`: one gather, all-reduce and scatter a plane)."""
  rows, world = storage.rows, layout.world
  tgt, src = tgt_loc, src_loc
  in_range = (tgt >= 0) & (tgt < rows) & (src >= 0) & (src < rows)
  same_owner = in_range & (tgt % world == src % world)
  crossing = in_range & ~same_owner
  read = _every_layer(local, _to_local(layout, jnp.where(crossing, src, -1), rows))
  travelling = tuple(_combine_owned(reference.gather_rows(b, read), layout.axis)
                     for b in local.flat_buffers())
  # Ties the reads to the buffers the in-place move takes: XLA then sees the reads
  # come first and needs no copy of the buffers to keep the old rows.
  travelling, buffers = lax.optimization_barrier((travelling, local.flat_buffers()))
  local = local.with_flat_buffers(buffers)
  local = dispatch.move_kv_cache(
      local, _to_local(layout, jnp.where(same_owner, tgt, -1), rows),
      _to_local(layout, jnp.where(same_owner, src, -1), rows), implementation=implementation)
  write = _every_layer(local, _to_local(layout, jnp.where(crossing, tgt, -1), rows))
  return local.with_flat_buffers(tuple(
      reference.scatter_rows(b, write, x) for b, x in zip(local.flat_buffers(), travelling)
  ))


def _context_parallel_decode(layout: ShardedLayout, storage: MLACacheConfig,
                             local: MLAKVCache | StackedMLAKVCache, *, q, page_table, seq_lens,
                             sm_scale, implementation, layer_id: Any = 0
                             ) -> tuple[jax.Array, jax.Array]:
  """mla_decode with interleaved rows: every rank attends the positions it holds, then the
  ranks' partial results are merged by their lse (two all-reduces of (B, s_q, H, R)).
  `local` is the layer alone (`layer_id` 0) or a stacked shard (`layer_id` traced).

  Position p of a sequence lives on rank p % world at local position p // world, in the
  same page-table column (local page size page_size / world), so rank k's part of query j
  is an ordinary decode over its first n = #{p = k (mod world), p <= seq_len - s_q + j}
  local positions. With s_q > 1 those counts differ per query by other than one, so each
  query runs as a sequence of its own (s_q = 1): the rank's rows are read once a query.
  """
  world = layout.world
  rank = lax.axis_index(layout.axis)
  B, s_q, H, W = q.shape
  R = storage.kv_lora_rank
  last = seq_lens[:, None] - s_q + jnp.arange(s_q, dtype=jnp.int32)[None, :] - rank
  visible = jnp.where(last >= 0, last // world + 1, 0)                         # (B, s_q)
  if s_q == 1:
    out, lse = attention.mla_decode(local, layer_id, q, page_table, visible[:, 0],
                                    sm_scale=sm_scale, implementation=implementation)
  else:
    out, lse = attention.mla_decode(
        local, layer_id, q.reshape(B * s_q, 1, H, W), jnp.repeat(page_table, s_q, axis=0),
        visible.reshape(B * s_q), sm_scale=sm_scale, implementation=implementation)
    out, lse = out.reshape(B, s_q, H, R), lse.reshape(B, s_q, H)
  top = lax.pmax(lse, layout.axis)
  top = jnp.where(jnp.isneginf(top), 0.0, top)
  weight = jnp.exp(lse - top)                              # 0 where a rank saw nothing
  total = lax.psum(weight, layout.axis)
  merged = lax.psum(weight[..., None] * out.astype(jnp.float32), layout.axis)
  out, lse = finish_lse_merge(top, total, merged)
  return out.astype(q.dtype), lse


_LAYOUT_ROWS = "rows as the layout defines them (module docstring)"

OPS: dict[str, ShardedOp] = {op.name: op for op in (
    ShardedOp(
        dispatch.set_mla_kv_buffer, dict(loc=SLOTS, cache_k_nope=TOKENS, cache_k_rope=TOKENS),
        (CACHE,), per_layer=True, check=_check_writes(
            ("cache_k_nope", "kv_lora_rank"), ("cache_k_rope", "qk_rope_head_dim")),
        doc=f"loc (T,): {_LAYOUT_ROWS}; cache_k_nope (T, 1, R), cache_k_rope (T, 1, Rr) "
            "split or replicated like `loc`."),
    ShardedOp(
        dispatch.set_kv_buffer, dict(loc=SLOTS, cache_k=TOKENS), (CACHE,), per_layer=True,
        check=_check_writes(("cache_k", "kv_cache_dim")),
        doc=f"loc (T,): {_LAYOUT_ROWS}; whole rows cache_k (T, 1, R+Rr) split or "
            "replicated like `loc`."),
    ShardedOp(
        rope_write.rope_set_mla_kv_buffer,
        dict(loc=SLOTS, positions=TOKENS, q_nope=TOKENS, q_rope=TOKENS, k_nope=TOKENS,
             k_rope=TOKENS, cos_sin_cache=REPLICATED),
        (CACHE, TOKENS), per_layer=True, check=_check_rope_set,
        prepare=_prepare_rope_set,
        doc="Every shard writes its rows (as `set_mla_kv_buffer`); q_out (T, H, R+Rr) "
            "follows the token layout: split along the axis (data_parallel) or replicated "
            "(the others, where every rank computes it)."),
    ShardedOp(
        dispatch.get_mla_kv_buffer, dict(loc=SLOTS), (GATHERED, GATHERED), per_layer=True,
        check=_check_loc,
        doc=f"loc (T,): {_LAYOUT_ROWS}. Returns (nope (T, 1, R), rope (T, 1, Rr)), split "
            "along the axis (data_parallel) or replicated (the others; context_parallel "
            "combines the owners' rows through one all-reduce)."),
    ShardedOp(
        dispatch.move_kv_cache, dict(tgt_loc=SLOTS, src_loc=SLOTS), (CACHE,), per_layer=False,
        check=_check_pair, context_parallel=_context_parallel_move,
        doc=f"tgt_loc, src_loc (T,): {_LAYOUT_ROWS}. context_parallel: a pair whose rows "
            "live on different ranks travels through one all-reduce."),
    ShardedOp(
        dispatch.move_kv_pages, dict(tgt_pages=PAGES, src_pages=PAGES), (CACHE,),
        per_layer=False, check=_check_pair,
        doc="Pages are logical pages (data_parallel: rank-local pages of each rank's pool; "
            "context_parallel: page p is local page p of every rank, so no communication)."),
    ShardedOp(
        attention.mla_decode, dict(q=TOKENS, page_table=TOKENS, seq_lens=TOKENS),
        (TOKENS, TOKENS), per_layer=True, prepare=_prepare_decode,
        context_parallel=_context_parallel_decode,
        doc="Each shard attends its own sequences. data_parallel: q (B, s_q, H, R+Rr), "
            "page_table (B, P) and seq_lens (B,) are a global batch split along the axis "
            "(B % world == 0); rank k's page ids address its own pool. replicated: every "
            "rank computes the whole batch. pipeline: runs on `layer_id`'s stage. "
            "context_parallel: the arrays are replicated and address the logical cache; "
            "each rank attends the positions it holds (p % world == rank) and the partial "
            "results are merged by their lse over the axis (s_q > 1: each query's positions "
            "read separately). Returns (out, lse) laid out like q."),
)}
"""The ops of this module that run an unsharded op on every shard, by name."""


def _program(op: ShardedOp, cache: ShardedMLAKVCache, arrays: dict[str, Any],
             static: tuple[tuple[str, Any], ...]):
  """The jitted body of `op` on a non-pipeline cache (a pipeline stage view included).

  `arrays`: the op's array arguments by name; for a per-layer op on a stacked cache also
  `layer_id`, an int scalar (traced here), which enters the shard_map replicated. `static`:
  the other arguments (an unstacked cache's per-layer op: `layer_id`, a Python int)."""
  layout, storage = cache.layout, cache.cache
  stacked = cache.stacked
  static = dict(static)
  layer_arg = arrays.get("layer_id")
  # In the parameters' order (jit hands a dict back with its keys sorted).
  arrays = {name: arrays[name] for name in op.arguments}
  if op.check is not None:
    arrays = op.check(cache.config, arrays, static, op.name)
  batch = next(iter(op.arguments))
  tokens = arrays[batch].shape[0]
  _check_tokens(layout, tokens, batch, op.name)
  if tokens == 0 and op.results == (CACHE,):
    return cache
  arguments = dict(op.arguments)
  if op.per_layer and stacked:
    # Every layer's rows are in the shard's stacked buffers: the layer id travels in.
    arguments["layer_id"] = REPLICATED
    arrays["layer_id"] = layer_arg
    buffers = storage.buffers
  elif op.per_layer:
    layer_id = static.pop("layer_id")
    buffers = (storage.layer(layer_id),)
  else:
    buffers = storage.buffers
  override = layout.kind == "context_parallel" and callable(op.context_parallel)
  if override:
    def run(local, **values):
      out = op.context_parallel(layout, storage.config, local, **values, **static)
      return out if len(op.results) > 1 else (out,)
  else:
    def run(local, **values):
      layer = ()
      if op.per_layer:
        layer = (values.pop("layer_id"),) if stacked else (0,)
      out = op.local(local, *layer, **values, **static)
      return out if len(op.results) > 1 else (out,)
  outs = _per_shard(layout, storage.config, run, arguments, op.results, logical_slots=override,
                    stacked=stacked)(buffers, *(arrays[n] for n in arguments))
  results = tuple(
      cache.replace(storage.replace_layer(layer_id, out[0]) if op.per_layer and not stacked
                    else dataclasses.replace(storage, buffers=out))
      if kind == CACHE else out
      for kind, out in zip(op.results, outs)
  )
  return results if len(results) > 1 else results[0]


def _sharded_signature(local: Callable) -> inspect.Signature:
  """`local`'s signature with `cache` (and the returned cache) a `ShardedMLAKVCache`."""
  signature = inspect.signature(local)
  parameters = [
      p.replace(annotation="ShardedMLAKVCache") if p.name == "cache" else p
      for p in signature.parameters.values()
  ]
  ret = signature.return_annotation
  if isinstance(ret, str):
    ret = ret.replace("MLAKVCache", "ShardedMLAKVCache")
  return signature.replace(parameters=parameters, return_annotation=ret)


def _docstring(op: ShardedOp) -> str:
  """The generated docstring: `op.doc`, how the arguments spread, the unsharded op's own."""
  kinds = {kind: ", ".join(n for n, k in op.arguments.items() if k == kind)
           for kind in (SLOTS, PAGES, TOKENS, REPLICATED)}
  layers = ("one layer, `layer_id` (a pipeline cache: on that layer's stage; a stacked cache: "
            "a static int or a traced integer scalar, e.g. under `jax.lax.scan`, a traced one "
            "outside [0, layer_num) writing nothing and reading zeros / lse -inf)"
            if op.per_layer else
            "every layer (a pipeline cache: every stage in turn; a stacked cache: every layer "
            "of each shard's stacked cache)")
  spread = (
      f"Every shard runs the unsharded op on its rows of {layers}. Split along the axis "
      "(data_parallel) or replicated (the other layouts): "
      + ", ".join(filter(None, (kinds[SLOTS], kinds[PAGES], kinds[TOKENS]))) + "."
      + (f" Replicated on every layout: {kinds[REPLICATED]}." if kinds[REPLICATED] else ""))
  unsharded = inspect.cleandoc(op.local.__doc__ or "")
  return "\n\n".join((
      f"`jax_mla_cache.{op.name}` on a sharded cache"
      + (" (donates `cache`)." if op.donates else " (reads `cache`, no donation)."),
      textwrap.fill(op.doc, 88, break_on_hyphens=False),
      textwrap.fill(spread, 88, break_on_hyphens=False),
      f"The unsharded op, `jax_mla_cache.{op.name}`::",
      textwrap.indent(unsharded, "    "),
  ))


def sharded_op(op: ShardedOp) -> Callable:
  """The public function of `op`: the unsharded op's parameters and a generated docstring.

  It checks and normalizes the arguments (`dispatch.bind_arguments`: a static int
  layer_id -- or, on a stacked cache, also a traced integer scalar --, 64-bit host indices
  narrowed without wrapping, the implementation order; then `op.prepare`) and runs the
  jitted `_program` (the cache donated where the op returns it); a pipeline cache runs it
  on the stage of `layer_id` (`op.per_layer`) or on every stage. A stacked cache's
  per-layer op passes `layer_id` to `_program` as an int32 array (a static int) or as it
  is (traced), not as a static: every layer shares one trace, and a scan's layer id works.
  """
  name, signature = op.name, _sharded_signature(op.local)
  jitted = jax.jit(functools.partial(_program, op), static_argnames=("static",),
                   donate_argnames=("cache",) if op.donates else ())

  def call(cache, *args, **kwargs):
    _check_sharded(cache, name)
    layout = cache.layout
    if layout.kind == "context_parallel" and isinstance(op.context_parallel, str):
      raise NotImplementedError(op.context_parallel)
    bound = dispatch.bind_arguments(signature, cache.cache, name, (cache, *args), kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["cache"]
    if op.prepare is not None:
      op.prepare(cache, arguments)
    arrays = {n: arguments.pop(n) for n in op.arguments}

    def run(target, arrays):
      """The jitted program on `target`; a per-layer op on the layer alone, put back after
      (`dispatch.on_layer`, as the unsharded ops do: every layer shares one trace), or on a
      stacked cache with the layer id an array argument."""
      if not op.per_layer:
        return jitted(target, arrays, tuple(arguments.items()))
      if target.stacked:
        layer_id = arguments.pop("layer_id")
        if not isinstance(layer_id, jax.core.Tracer):
          layer_id = np.int32(layer_id)              # (checked in [0, layer_num))
        return jitted(target, {**arrays, "layer_id": layer_id}, tuple(arguments.items()))

      def program(view, layer_id):
        return jitted(view, arrays, tuple({**arguments, "layer_id": layer_id}.items()))

      return dispatch.on_layer(program, target, arguments["layer_id"])

    if layout.kind != "pipeline":
      try:
        return run(cache, arrays)
      except ValueError as e:
        if "incompatible devices" not in str(e):
          raise
        placed = {n: sorted(d.id for d in a.devices()) for n, a in arrays.items()
                  if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)}
        raise ValueError(
            f"{name}: array arguments must be on the cache's mesh devices "
            f"{sorted(int(i) for i in layout.mesh.device_ids.flat)} or uncommitted (numpy arrays, or jax "
            f"arrays not placed with device_put); got {placed}") from None
    layer_num = cache.cache.config.layer_num
    stages = [layout.stage_of(arguments["layer_id"], layer_num)] if op.per_layer else _stages(cache)
    results = None
    for stage in stages:
      view = stage_view(cache, stage)
      if op.per_layer:
        arguments["layer_id"] -= layout.stage_layers(stage, layer_num).start
      out = run(view, jax.tree.map(functools.partial(_to_stage, view), arrays))
      results = out if len(op.results) > 1 else (out,)
      if op.results[0] == CACHE:
        cache = with_stage(cache, stage, results[0])
        results = (cache, *results[1:])
    return results if len(results) > 1 else results[0]

  call.__name__ = call.__qualname__ = name
  call.__module__ = __name__
  call.__doc__ = _docstring(op)
  call.__signature__ = signature
  call.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                          if p.annotation is not inspect.Parameter.empty}
  call.__annotations__["return"] = signature.return_annotation
  call.op = op
  call.jitted = jitted
  return call


set_mla_kv_buffer = sharded_op(OPS["set_mla_kv_buffer"])
set_kv_buffer = sharded_op(OPS["set_kv_buffer"])
rope_set_mla_kv_buffer = sharded_op(OPS["rope_set_mla_kv_buffer"])
get_mla_kv_buffer = sharded_op(OPS["get_mla_kv_buffer"])
move_kv_cache = sharded_op(OPS["move_kv_cache"])
move_kv_pages = sharded_op(OPS["move_kv_pages"])
mla_decode = sharded_op(OPS["mla_decode"])


# ----------------------------------------------------------------- host offload
# Not rows of `OPS`: a host copy is a nested per-layer pytree in host memory (the jit writes
# it there through `out_shardings`), a pipeline cache concatenates or splits it per stage,
# and the one-device `get_cpu_copy`'s `reuse` has no sharded counterpart. The per-shard
# programs are the same `_per_shard` as the table's.
@functools.lru_cache(maxsize=64)
def _gather_to_host(layout: ShardedLayout, storage: MLACacheConfig, chunk_size: int,
                    memory_kind: str | None, stacked: bool) -> Callable:
  def run(local, token_indices):
    return (offload.gather_chunks(local, token_indices, chunk_size=chunk_size),)

  gather = _per_shard(layout, storage, run, dict(token_indices=SLOTS), (GATHERED,),
                      stacked=stacked)
  out = NamedSharding(layout.mesh, layout.token_spec, memory_kind=memory_kind)
  return jax.jit(lambda buffers, idx: gather(buffers, idx)[0], out_shardings=out)


def get_cpu_copy(
    cache: ShardedMLAKVCache,
    token_indices: Sequence[int] | jax.Array,
    *,
    chunk_size: int = offload.OFFLOAD_CHUNK_TOKENS,
    memory_kind: str | None = "auto",
) -> offload.HostCopy:
  """`offload.get_cpu_copy` on a sharded cache.

  token_indices (T,) are rows as the layout defines them. The copy lies in the
  host memory of the devices that gathered it: data_parallel, split along the
  axis like the batch (each rank's `chunk_size`-token chunks side by side);
  replicated and context_parallel, replicated (the latter after one all-reduce,
  so it can be loaded into rows of any owner); pipeline, each layer on its stage.
  The copy is nested (`copy[layer][chunk][plane]`, (n, 1, width) each; `HostCopy`), for a
  stacked cache too: the same copy as the unstacked cache of the same layout and contents
  (either loads into either).
  """
  op = "get_cpu_copy"
  _check_sharded(cache, op)
  idx = offload.check_token_indices(token_indices, "token_indices", op)
  if chunk_size <= 0:
    raise ValueError(f"{op}: chunk_size must be positive, got {chunk_size}")
  layout, storage = cache.layout, cache.cache
  tokens = int(idx.shape[0])
  if layout.kind == "pipeline":
    copies = [get_cpu_copy(view, _to_stage(view, idx), chunk_size=chunk_size,
                           memory_kind=memory_kind)
              for view in map(functools.partial(stage_view, cache), _stages(cache))]
    return offload.HostCopy(chunks=sum((c.chunks for c in copies), ()),
                            token_count=tokens, chunk_size=chunk_size, origin=layout)
  _check_tokens(layout, tokens, "token_indices", op)
  if tokens == 0:
    return offload.HostCopy(chunks=tuple(() for _ in range(storage.config.layer_num)),
                            token_count=0, chunk_size=chunk_size, origin=layout)
  if memory_kind == "auto":
    memory_kind = offload.host_memory_kind(layout.mesh.devices.flat[0])
  gather = _gather_to_host(layout, storage.config, chunk_size, memory_kind, cache.stacked)
  return offload.HostCopy(chunks=gather(storage.buffers, idx), token_count=tokens,
                          chunk_size=chunk_size, origin=layout)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _load_chunks(cache: ShardedMLAKVCache, chunks, idx: jax.Array) -> ShardedMLAKVCache:
  layout, storage = cache.layout, cache.cache
  chunks = jax.device_put(chunks, jax.memory.Space.Device)

  def run(local, chunks, token_indices):
    return (offload.scatter_chunks(local, chunks, token_indices),)

  scatter = _per_shard(layout, storage.config, run, dict(chunks=TOKENS, token_indices=SLOTS),
                       (CACHE,), stacked=cache.stacked)
  (new,) = scatter(storage.buffers, chunks, idx)
  return cache.replace(dataclasses.replace(storage, buffers=new))


def load_cpu_copy(
    cache: ShardedMLAKVCache,
    host_copy: offload.HostCopy,
    token_indices: Sequence[int] | jax.Array,
) -> ShardedMLAKVCache:
  """`offload.load_cpu_copy` on a sharded cache (donates `cache`): writes a copy
  from this module's `get_cpu_copy` (same layout; of a stacked or an unstacked cache) into
  rows `token_indices` (T,), rows as the layout defines them, of every layer."""
  op = "load_cpu_copy"
  _check_sharded(cache, op)
  idx = offload.check_token_indices(token_indices, "token_indices", op)
  layout, storage = cache.layout, cache.cache
  if isinstance(host_copy, offload.HostCopy) and host_copy.stacked:
    raise ValueError(
        f"{op}: this host copy came from the one-device get_cpu_copy (stacked layers); a "
        "sharded cache loads copies made by jax_mla_cache.sharding.get_cpu_copy")
  offload.check_host_copy(storage, host_copy, idx, op)
  if host_copy.origin != layout:
    # (Checked before any stage runs: a pipeline cache's stages donate one by one.)
    came = ("a one-device cache" if host_copy.origin is None else
            f"a {host_copy.origin.kind} cache over devices "
            f"{host_copy.origin.mesh.device_ids.tolist()}")
    raise ValueError(
        f"{op}: the host copy came from {came}, this cache is {layout.kind} over devices "
        f"{layout.mesh.device_ids.tolist()}: a sharded copy's chunks are laid out for its "
        "own layout (rows would land permuted); load it into a cache of the same layout")
  if idx.shape[0] == 0:
    return cache
  if layout.kind == "pipeline":
    for stage in _stages(cache):
      view = stage_view(cache, stage)
      layers = layout.stage_layers(stage, storage.config.layer_num)
      part = dataclasses.replace(host_copy, chunks=host_copy.chunks[layers.start:layers.stop],
                                 origin=view.layout)
      cache = with_stage(cache, stage, load_cpu_copy(view, part, _to_stage(view, idx)))
    return cache
  _check_tokens(layout, int(idx.shape[0]), "token_indices", op)
  return _load_chunks(cache, host_copy.chunks, idx)
