"""Sharded caches over a JAX mesh: four layouts, every op computed per shard.

A `ShardedLayout` says how the per-layer buffers spread over one axis of a mesh;
`init_sharded_cache(config, layout)` builds a `ShardedMLAKVCache` (the plain
`MLAKVCache` of global arrays plus the static layout), and this module's ops take
it. Each op runs the ordinary op of `jax_mla_cache.dispatch` (or of `offload`)
on every shard under `jax.shard_map(..., check_vma=False)`, so the XLA scatter or
the Pallas kernel updates each device's shard in place; the ops are jitted with
the cache donated and keep every buffer's sharding.

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
  not own to slot -1, which the ops skip, and reads are combined across ranks.
  Page p's rows are local page p of every rank (local page size
  `page_size / world`), so page moves need no communication; a token move whose
  source and target live on different ranks goes through one all-reduce.
  Needs `page_size % world == 0` and `rows % world == 0`.

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
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_mla_cache import attention, dispatch, offload, reference, rope_write
from jax_mla_cache.config import MLACacheConfig
from jax_mla_cache.state import MLAKVCache, init_cache

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
  """A cache of global sharded arrays (`cache`, storage geometry) and its layout."""

  cache: MLAKVCache
  layout: ShardedLayout = dataclasses.field(metadata=dict(static=True))

  @property
  def config(self) -> MLACacheConfig:
    """The logical config (what `loc` addresses)."""
    return self.layout.logical_config(self.cache.config)

  @property
  def buffers(self):
    return self.cache.buffers

  def replace(self, cache: MLAKVCache) -> "ShardedMLAKVCache":
    return dataclasses.replace(self, cache=cache)


def init_sharded_cache(config: MLACacheConfig, layout: ShardedLayout) -> ShardedMLAKVCache:
  """A zero-filled cache of logical geometry `config` laid out as `layout`."""
  if not isinstance(layout, ShardedLayout):
    raise TypeError(f"init_sharded_cache: layout must be a ShardedLayout, got {type(layout).__name__}")
  storage = layout.storage_config(config)
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


def _check_tokens(layout: ShardedLayout, tokens: int, name: str, op: str) -> None:
  if layout.kind == "data_parallel" and tokens % layout.world:
    raise ValueError(
        f"{op}: data_parallel splits {name} over {layout.world} ranks, so its length must "
        f"be a multiple of {layout.world}, got {tokens}"
    )


def _shard_map(layout: ShardedLayout, body: Callable, in_specs, out_specs) -> Callable:
  return jax.shard_map(
      body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
  )


def _local_cache(layout: ShardedLayout, storage: MLACacheConfig, buffers) -> MLAKVCache:
  """The shard of `buffers` (a tuple of layers) as an ordinary cache."""
  config = layout.shard_config(storage).replace(layer_num=len(buffers))
  return MLAKVCache(buffers=tuple(buffers), config=config)


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


def _public(jitted: Callable, *, per_layer: bool) -> Callable:
  """The public op: checks and normalizes the arguments (`dispatch.bind_arguments`: a
  static int layer_id, 64-bit host indices narrowed without wrapping, the implementation
  order), then runs `jitted`; a pipeline cache runs it on the stage of `layer_id`
  (`per_layer`) or on every stage."""
  name = jitted.__name__
  signature = inspect.signature(jitted)

  @functools.wraps(jitted)
  def op(cache, *args, **kwargs):
    _check_sharded(cache, name)
    bound = dispatch.bind_arguments(signature, cache.cache, name, (cache, *args), kwargs)
    args, kwargs = bound.args[1:], bound.kwargs
    if cache.layout.kind != "pipeline":
      return jitted(cache, *args, **kwargs)
    layer_num = cache.cache.config.layer_num
    if per_layer:
      layer_id = args[0]
      stage = cache.layout.stage_of(layer_id, layer_num)
      view = stage_view(cache, stage)
      local_id = layer_id - cache.layout.stage_layers(stage, layer_num).start
      rest = tuple(_to_stage(view, a) for a in args[1:])
      out = jitted(view, local_id, *rest, **kwargs)
      if isinstance(out, tuple) and out and isinstance(out[0], ShardedMLAKVCache):
        return (with_stage(cache, stage, out[0]), *out[1:])  # (cache, q_out)
      return with_stage(cache, stage, out) if isinstance(out, ShardedMLAKVCache) else out
    for stage in _stages(cache):
      view = stage_view(cache, stage)
      view = jitted(view, *(_to_stage(view, a) for a in args), **kwargs)
      cache = with_stage(cache, stage, view)
    return cache

  op.jitted = jitted
  return op


# ----------------------------------------------------------------- writes and reads
_WRITE_INPUTS = {
    "set_mla_kv_buffer": (("cache_k_nope", "kv_lora_rank"), ("cache_k_rope", "qk_rope_head_dim")),
    "set_kv_buffer": (("cache_k", "kv_cache_dim"),),
}


def _write(cache, op, layer_id, loc, values, implementation, sanitize):
  layout, storage = cache.layout, cache.cache
  layer_id = dispatch.check_layer_id(storage, layer_id, op)
  loc = dispatch.check_loc(loc, "loc", op)
  tokens = loc.shape[0]
  _check_tokens(layout, tokens, "loc", op)
  values = tuple(
      dispatch.check_rows_input(v, name, tokens, getattr(storage.config, width), op)
      for v, (name, width) in zip(values, _WRITE_INPUTS[op])
  )
  local_op = getattr(dispatch, op)
  rows = storage.config.rows

  def body(layer, loc, *values):
    local = _local_cache(layout, storage.config, (layer,))
    local = local_op(local, 0, _to_local(layout, loc, rows), *values,
                     implementation=implementation, sanitize=sanitize)
    return local.layer(0)

  spec, token = layout.buffer_spec, layout.token_spec
  in_specs = (spec, token) + (token,) * len(values)
  new = _shard_map(layout, body, in_specs, spec)(storage.layer(layer_id), loc, *values)
  return cache.replace(storage.replace_layer(layer_id, new))


@functools.partial(
    jax.jit, static_argnames=("layer_id", "implementation", "sanitize"),
    donate_argnames=("cache",)
)
def set_mla_kv_buffer(
    cache: ShardedMLAKVCache,
    layer_id: int,
    loc: jax.Array,
    cache_k_nope: jax.Array,
    cache_k_rope: jax.Array,
    *,
    implementation: dispatch.Implementation = None,
    sanitize: bool = False,
) -> ShardedMLAKVCache:
  """`dispatch.set_mla_kv_buffer` on a sharded cache (donates `cache`).

  loc (T,): rows as the layout defines them (module docstring); cache_k_nope
  (T, 1, R), cache_k_rope (T, 1, Rr), split or replicated like `loc`.
  """
  return _write(cache, "set_mla_kv_buffer", layer_id, loc, (cache_k_nope, cache_k_rope),
                implementation, sanitize)


@functools.partial(
    jax.jit, static_argnames=("layer_id", "implementation", "sanitize"),
    donate_argnames=("cache",)
)
def set_kv_buffer(
    cache: ShardedMLAKVCache,
    layer_id: int,
    loc: jax.Array,
    cache_k: jax.Array,
    *,
    implementation: dispatch.Implementation = None,
    sanitize: bool = False,
) -> ShardedMLAKVCache:
  """`dispatch.set_kv_buffer` on a sharded cache: whole rows cache_k (T, 1, R+Rr)."""
  return _write(cache, "set_kv_buffer", layer_id, loc, (cache_k,), implementation, sanitize)


@functools.partial(
    jax.jit, static_argnames=("layer_id", "is_neox", "q_out_dtype", "sanitize", "implementation"),
    donate_argnames=("cache",)
)
def rope_set_mla_kv_buffer(
    cache: ShardedMLAKVCache,
    layer_id: int,
    loc: jax.Array,
    positions: jax.Array,
    q_nope: jax.Array,
    q_rope: jax.Array,
    k_nope: jax.Array,
    k_rope: jax.Array,
    cos_sin_cache: jax.Array,
    *,
    is_neox: bool = False,
    q_out_dtype: Any = None,
    sanitize: bool = False,
    implementation: dispatch.Implementation = None,
) -> tuple[ShardedMLAKVCache, jax.Array]:
  """`rope_write.rope_set_mla_kv_buffer` on a sharded cache (donates `cache`).

  Every shard writes its rows (as `set_mla_kv_buffer`); q_out (T, H, R+Rr) follows the
  token layout: split along the axis (data_parallel) or replicated (the others, where
  every rank computes it). cos_sin_cache is replicated.
  """
  op = "rope_set_mla_kv_buffer"
  layout, storage = cache.layout, cache.cache
  layer_id = dispatch.check_layer_id(storage, layer_id, op)
  loc, positions, q_nope, q_rope, k_nope, k_rope, table, out_dtype = rope_write.check_inputs(
      cache.config, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache, q_out_dtype)
  _check_tokens(layout, loc.shape[0], "loc", op)
  rows = storage.config.rows

  def body(layer, loc, *values):
    local = _local_cache(layout, storage.config, (layer,))
    local, q_out = rope_write.rope_set_mla_kv_buffer(
        local, 0, _to_local(layout, loc, rows), *values, is_neox=is_neox,
        q_out_dtype=out_dtype, sanitize=sanitize, implementation=implementation)
    return local.layer(0), q_out

  spec, token = layout.buffer_spec, layout.token_spec
  new, q_out = _shard_map(layout, body, (spec,) + (token,) * 6 + (P(),), (spec, token))(
      storage.layer(layer_id), loc, positions, q_nope, q_rope, k_nope, k_rope, table)
  return cache.replace(storage.replace_layer(layer_id, new)), q_out


@functools.partial(jax.jit, static_argnames=("layer_id", "dst_dtype", "implementation"))
def get_mla_kv_buffer(
    cache: ShardedMLAKVCache,
    layer_id: int,
    loc: jax.Array,
    dst_dtype: Any = None,
    *,
    implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """`dispatch.get_mla_kv_buffer` on a sharded cache: (nope (T,1,R), rope (T,1,Rr)),
  split along the axis (data_parallel) or replicated (the others)."""
  op = "get_mla_kv_buffer"
  layout, storage = cache.layout, cache.cache
  layer_id = dispatch.check_layer_id(storage, layer_id, op)
  loc = dispatch.check_loc(loc, "loc", op)
  _check_tokens(layout, loc.shape[0], "loc", op)
  rows = storage.config.rows

  def body(layer, loc):
    local = _local_cache(layout, storage.config, (layer,))
    out = dispatch.get_mla_kv_buffer(
        local, 0, _to_local(layout, loc, rows), dst_dtype, implementation=implementation)
    if layout.kind != "context_parallel":
      return out
    owned = _owned(layout, loc, rows)[:, None, None]
    return tuple(_combine_owned(jnp.where(owned, x, jnp.zeros_like(x)), layout.axis) for x in out)

  spec, token = layout.buffer_spec, layout.token_spec
  return _shard_map(layout, body, (spec, token), (token, token))(storage.layer(layer_id), loc)


# ----------------------------------------------------------------- moves
def _context_parallel_move(layout, storage, local, tgt, src, implementation):
  """Token moves with interleaved rows: pairs whose two rows share an owner move
  locally (one kernel launch); the others read their source on its owner, meet
  through one all-reduce, and are written by the target's owner. All reads
  precede all writes (snapshot semantics, as `dispatch.move_kv_cache`)."""
  rows, world = storage.config.rows, layout.world
  in_range = (tgt >= 0) & (tgt < rows) & (src >= 0) & (src < rows)
  same_owner = in_range & (tgt % world == src % world)
  crossing = in_range & ~same_owner
  read = jnp.where(crossing, src, -1)
  travelling = tuple(
      _combine_owned(reference.gather_rows(b, _to_local(layout, read, rows)), layout.axis)
      for b in local.flat_buffers()
  )
  # Ties the reads to the buffers the in-place move takes: XLA then sees the reads
  # come first and needs no copy of the buffers to keep the old rows.
  travelling, buffers = lax.optimization_barrier((travelling, local.flat_buffers()))
  local = local.with_flat_buffers(buffers)
  local = dispatch.move_kv_cache(
      local, _to_local(layout, jnp.where(same_owner, tgt, -1), rows),
      _to_local(layout, jnp.where(same_owner, src, -1), rows), implementation=implementation)
  write = _to_local(layout, jnp.where(crossing, tgt, -1), rows)
  return local.with_flat_buffers(tuple(
      reference.scatter_rows(b, write, x) for b, x in zip(local.flat_buffers(), travelling)
  ))


def _move(cache, op, tgt, src, implementation):
  layout, storage = cache.layout, cache.cache
  names = ("tgt_loc", "src_loc") if op == "move_kv_cache" else ("tgt_pages", "src_pages")
  tgt, src = dispatch._check_pair(tgt, src, op, names)
  _check_tokens(layout, tgt.shape[0], names[0], op)
  if tgt.shape[0] == 0:
    return cache

  def body(buffers, tgt, src):
    local = _local_cache(layout, storage.config, buffers)
    if op == "move_kv_cache" and layout.kind == "context_parallel":
      return _context_parallel_move(layout, storage, local, tgt, src, implementation).buffers
    # Pages need no translation: page p is local page p of every rank (context_parallel).
    return getattr(dispatch, op)(local, tgt, src, implementation=implementation).buffers

  spec, token = layout.buffer_spec, layout.token_spec
  new = _shard_map(layout, body, (spec, token, token), spec)(storage.buffers, tgt, src)
  return cache.replace(dataclasses.replace(storage, buffers=new))


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnames=("cache",))
def move_kv_cache(
    cache: ShardedMLAKVCache,
    tgt_loc: jax.Array,
    src_loc: jax.Array,
    *,
    implementation: dispatch.Implementation = None,
) -> ShardedMLAKVCache:
  """`dispatch.move_kv_cache` on a sharded cache (every layer; donates `cache`)."""
  return _move(cache, "move_kv_cache", tgt_loc, src_loc, implementation)


@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnames=("cache",))
def move_kv_pages(
    cache: ShardedMLAKVCache,
    tgt_pages: jax.Array,
    src_pages: jax.Array,
    *,
    implementation: dispatch.Implementation = None,
) -> ShardedMLAKVCache:
  """`dispatch.move_kv_pages` on a sharded cache (every layer; donates `cache`).

  Pages are logical pages (data_parallel: rank-local pages of each rank's pool)."""
  return _move(cache, "move_kv_pages", tgt_pages, src_pages, implementation)


# ----------------------------------------------------------------- host offload
@functools.lru_cache(maxsize=64)
def _gather_to_host(layout: ShardedLayout, storage: MLACacheConfig, chunk_size: int,
                    memory_kind: str | None) -> Callable:
  rows = storage.rows

  def body(buffers, idx):
    local = _local_cache(layout, storage, buffers)
    chunks = offload._gather_chunks(local, _to_local(layout, idx, rows), chunk_size=chunk_size)
    if layout.kind == "context_parallel":  # rows a rank does not own gather as zeros
      chunks = jax.tree.map(lambda x: _combine_owned(x, layout.axis), chunks)
    return chunks

  token = layout.token_spec
  gather = _shard_map(layout, body, (layout.buffer_spec, token), token)
  out = NamedSharding(layout.mesh, token, memory_kind=memory_kind)
  return jax.jit(lambda buffers, idx: gather(buffers, idx), out_shardings=out)


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
  """
  op = "get_cpu_copy"
  _check_sharded(cache, op)
  idx = offload._as_indices(token_indices, "token_indices", op)
  if chunk_size <= 0:
    raise ValueError(f"{op}: chunk_size must be positive, got {chunk_size}")
  layout, storage = cache.layout, cache.cache
  tokens = int(idx.shape[0])
  if layout.kind == "pipeline":
    copies = [get_cpu_copy(view, _to_stage(view, idx), chunk_size=chunk_size,
                           memory_kind=memory_kind)
              for view in map(functools.partial(stage_view, cache), _stages(cache))]
    return offload.HostCopy(chunks=sum((c.chunks for c in copies), ()),
                            token_count=tokens, chunk_size=chunk_size)
  _check_tokens(layout, tokens, "token_indices", op)
  if tokens == 0:
    return offload.HostCopy(chunks=tuple(() for _ in storage.buffers), token_count=0,
                            chunk_size=chunk_size)
  if memory_kind == "auto":
    memory_kind = offload.host_memory_kind(layout.mesh.devices.flat[0])
  gather = _gather_to_host(layout, storage.config, chunk_size, memory_kind)
  return offload.HostCopy(chunks=gather(storage.buffers, idx), token_count=tokens,
                          chunk_size=chunk_size)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _load_chunks(cache: ShardedMLAKVCache, chunks, idx: jax.Array) -> ShardedMLAKVCache:
  layout, storage = cache.layout, cache.cache
  rows = storage.config.rows
  chunks = jax.device_put(chunks, jax.memory.Space.Device)

  def body(buffers, chunks, idx):
    local = _local_cache(layout, storage.config, buffers)
    return offload._scatter_chunks(local, chunks, _to_local(layout, idx, rows)).buffers

  spec, token = layout.buffer_spec, layout.token_spec
  new = _shard_map(layout, body, (spec, token, token), spec)(storage.buffers, chunks, idx)
  return cache.replace(dataclasses.replace(storage, buffers=new))


def load_cpu_copy(
    cache: ShardedMLAKVCache,
    host_copy: offload.HostCopy,
    token_indices: Sequence[int] | jax.Array,
) -> ShardedMLAKVCache:
  """`offload.load_cpu_copy` on a sharded cache (donates `cache`): writes a copy
  from this module's `get_cpu_copy` (same layout) into rows `token_indices`."""
  op = "load_cpu_copy"
  _check_sharded(cache, op)
  idx = offload._as_indices(token_indices, "token_indices", op)
  layout, storage = cache.layout, cache.cache
  if isinstance(host_copy, offload.HostCopy) and host_copy.stacked:
    raise ValueError(
        f"{op}: this host copy came from the one-device get_cpu_copy (stacked layers); a "
        "sharded cache loads copies made by jax_mla_cache.sharding.get_cpu_copy")
  offload.check_host_copy(storage, host_copy, idx, op)
  if idx.shape[0] == 0:
    return cache
  if layout.kind == "pipeline":
    for stage in _stages(cache):
      view = stage_view(cache, stage)
      layers = layout.stage_layers(stage, storage.config.layer_num)
      part = dataclasses.replace(host_copy, chunks=host_copy.chunks[layers.start:layers.stop])
      cache = with_stage(cache, stage, load_cpu_copy(view, part, _to_stage(view, idx)))
    return cache
  _check_tokens(layout, int(idx.shape[0]), "token_indices", op)
  return _load_chunks(cache, host_copy.chunks, idx)


set_mla_kv_buffer = _public(set_mla_kv_buffer, per_layer=True)
set_kv_buffer = _public(set_kv_buffer, per_layer=True)
get_mla_kv_buffer = _public(get_mla_kv_buffer, per_layer=True)
rope_set_mla_kv_buffer = _public(rope_set_mla_kv_buffer, per_layer=True)
move_kv_cache = _public(move_kv_cache, per_layer=False)
move_kv_pages = _public(move_kv_pages, per_layer=False)


# ----------------------------------------------------------------- decode attention
@functools.partial(jax.jit, static_argnames=("layer_id", "sm_scale", "implementation"))
def _mla_decode(cache, layer_id, q, page_table, seq_lens, *, sm_scale, implementation):
  op = "mla_decode"
  layout, storage = cache.layout, cache.cache
  if layout.kind == "context_parallel":
    raise NotImplementedError(
        f"{op}: context_parallel caches interleave a sequence's rows over the ranks; "
        "combining the ranks' partial attention is not implemented (use data_parallel, "
        "replicated or pipeline layouts)")
  layer_id = dispatch.check_layer_id(storage, layer_id, op)
  _check_tokens(layout, q.shape[0] if hasattr(q, "shape") else 0, "q's batch", op)

  def body(layer, q, page_table, seq_lens):
    local = _local_cache(layout, storage.config, (layer,))
    return attention.mla_decode(local, 0, q, page_table, seq_lens, sm_scale=sm_scale,
                                implementation=implementation)

  spec, token = layout.buffer_spec, layout.token_spec
  return _shard_map(layout, body, (spec, token, token, token), (token, token))(
      storage.layer(layer_id), q, page_table, seq_lens)


def _mla_decode_public(cache, layer_id, q, page_table, seq_lens, *, sm_scale,
                       implementation: dispatch.Implementation = None):
  """`jax_mla_cache.mla_decode` on a sharded cache: each shard attends its own sequences.

  data_parallel: q (B, s_q, H, R+Rr), page_table (B, P) and seq_lens (B,) are a global
  batch split along the axis (B % world == 0); rank k's page ids address its own pool.
  replicated: every rank computes the whole batch. pipeline: runs on `layer_id`'s stage.
  Returns (out, lse) laid out like q. context_parallel raises NotImplementedError.
  """
  _check_sharded(cache, "mla_decode")
  if isinstance(sm_scale, jax.core.Tracer):
    raise TypeError("mla_decode: sm_scale must be a Python float (static), got a traced value")
  config = cache.layout.shard_config(cache.cache.config)
  page_table, seq_lens = attention._check_decode_args(
      MLAKVCache(buffers=(), config=config), q, page_table, seq_lens, "mla_decode")
  return _public(_mla_decode, per_layer=True)(
      cache, layer_id, q, page_table, seq_lens, sm_scale=float(sm_scale),
      implementation=implementation)


mla_decode = _mla_decode_public
