"""Host tier: copy token rows of every layer to host memory and back.

`get_cpu_copy` gathers rows `token_indices` of every layer and buffer, in chunks
of `chunk_size` tokens (the seed's `offload_chunk_page_num`, 1024), into host
memory (the `pinned_host` memory kind where the device has one; H200 offers
`device` and `pinned_host` only). It returns at once: the transfer runs
asynchronously and the arrays block when read. `load_cpu_copy` writes such a copy
back into the same or other rows. The round trip is bit-exact (raw stored bytes:
fp8 codes and scales, no requantization).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache import reference
from jax_mla_cache.dispatch import check_buffers, check_cache, check_loc, host_indices
from jax_mla_cache.state import MLAKVCache, StackedMLAKVCache

OFFLOAD_CHUNK_TOKENS = 1024
"""The seed's `offload_chunk_page_num`: tokens per host chunk."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostCopy:
  """Rows of every layer and buffer in host memory, in chunks of `chunk_size` tokens.

  Two layouts:

  * stacked (what `get_cpu_copy` makes for a cache on one device): `stacked[chunk][buffer]`
    is one (layer_num, n, 1, width) array holding that chunk's rows of that buffer for
    every layer, so a chunk moves in one transfer per buffer kind (one for a plain cache,
    three for per_token_head) instead of one per layer.
  * nested (sharded caches, `jax_mla_cache.sharding`, stacked or not):
    `chunks[layer][chunk][buffer]` arrays of (n, 1, width).

  `n <= chunk_size` (the last chunk holds the remainder). `copy[layer]` gives that
  layer's chunks like the seed's nested lists (numpy arrays for a stacked copy).
  `origin`: the `sharding.ShardedLayout` of the cache a sharded copy came from (None: a
  one-device cache's); its chunks are laid out for that layout only, so it loads into a
  cache of the same layout (checked).
  """

  chunks: tuple[tuple[tuple[jax.Array, ...], ...], ...]
  token_count: int = dataclasses.field(metadata=dict(static=True))
  chunk_size: int = dataclasses.field(metadata=dict(static=True))
  stacked: tuple[tuple[jax.Array, ...], ...] = ()
  origin: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def __getitem__(self, layer_id: int):
    if self.stacked:
      return tuple(tuple(x[layer_id] for x in kinds) for kinds in self._stacked_numpy)
    return self.chunks[layer_id]

  @functools.cached_property
  def _stacked_numpy(self) -> tuple[tuple[np.ndarray, ...], ...]:
    """The stacked chunks as numpy arrays, fetched once per copy (indexing is for
    inspection; the device path never uses it)."""
    return tuple(tuple(np.asarray(x) for x in kinds) for kinds in self.stacked)

  def __len__(self) -> int:
    return self.stacked[0][0].shape[0] if self.stacked else len(self.chunks)

  def block_until_ready(self) -> "HostCopy":
    jax.block_until_ready((self.chunks, self.stacked))
    return self

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves((self.chunks, self.stacked)))

  @property
  def memory_kind(self) -> str | None:
    """Where the rows are (`pinned_host` on a GPU), or None for an empty copy."""
    leaves = jax.tree.leaves((self.chunks, self.stacked))
    return leaves[0].sharding.memory_kind if leaves else None


def host_memory_kind(device: Any = None) -> str | None:
  """`pinned_host` when the device offers it (GPU, CPU), else None (stay on device)."""
  device = device or jax.devices()[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # backends without memory kinds
    return None
  return "pinned_host" if "pinned_host" in kinds else None


def _chunk_bounds(tokens: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
  return tuple((s, min(s + chunk_size, tokens)) for s in range(0, tokens, chunk_size))


def _host_sharding(buf: jax.Array, memory_kind: str | None):
  sharding = buf.sharding
  return sharding if memory_kind is None else sharding.with_memory_kind(memory_kind)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def gather_chunks(cache: MLAKVCache | StackedMLAKVCache, idx: jax.Array, chunk_size: int):
  """Rows `idx` (T,) of every layer and buffer, in chunks of `chunk_size` tokens, on the
  cache's devices: `chunks[layer][chunk][buffer]` of (n, 1, width), n <= chunk_size (the
  nested layout of `HostCopy`). Out-of-range rows read as zeros. A `StackedMLAKVCache`
  gives the same arrays (each layer's rows gathered from the stacked buffers; what a
  sharded stacked cache's shards run)."""
  bounds = _chunk_bounds(idx.shape[0], chunk_size)
  if isinstance(cache, StackedMLAKVCache):
    return tuple(
        tuple(tuple(reference.gather_rows(buf, rows[s:e]) for buf in cache.buffers)
              for s, e in bounds)
        for rows in _stacked_rows(cache, idx)
    )
  return tuple(
      tuple(tuple(reference.gather_rows(buf, idx[s:e]) for buf in layer) for s, e in bounds)
      for layer in cache.buffers
  )


def _stacked_rows(cache: StackedMLAKVCache, idx: jax.Array) -> jax.Array:
  """(layer_num, T) rows of the stacked buffers holding slots `idx` of every layer; -1
  (read as zeros) where a slot is outside `[0, rows)`."""
  return cache.every_layer(idx, cache.config.rows).reshape(cache.layer_num, -1)


@functools.lru_cache(maxsize=64)
def _gather_to(out_shardings, reuse: bool):
  """`gather_chunks` compiled to write its outputs with `out_shardings` (host memory).

  With `reuse`, the previous copy's arrays are donated so XLA writes into them
  instead of allocating new host buffers (pinned allocation dominates a first copy).
  """
  if not reuse:
    return jax.jit(
        gather_chunks.__wrapped__, static_argnames=("chunk_size",), out_shardings=out_shardings
    )

  def gather_into(cache, idx, old_chunks, chunk_size):
    del old_chunks  # donated: its buffers receive the outputs
    return gather_chunks.__wrapped__(cache, idx, chunk_size)

  return jax.jit(gather_into, static_argnames=("chunk_size",), donate_argnames=("old_chunks",),
                 out_shardings=out_shardings)


def check_token_indices(token_indices: Any, name: str, op: str) -> jax.Array:
  """`token_indices` (a list, numpy or jax integer array) as (T,) int32 indices, the
  errors naming `name` and `op`; 64-bit values outside int32 become -1 (skipped), never
  wrapped (`dispatch.host_indices`, `dispatch.check_loc`)."""
  return check_loc(host_indices(token_indices), name, op)


def get_cpu_copy(
    cache: MLAKVCache | StackedMLAKVCache,
    token_indices: Sequence[int] | jax.Array,
    *,
    chunk_size: int = OFFLOAD_CHUNK_TOKENS,
    memory_kind: str | None = "auto",
    reuse: HostCopy | None = None,
) -> HostCopy:
  """Copy rows `token_indices` (T,) of every layer/buffer to host memory.

  Asynchronous: returns before the copy finishes; reading a leaf (or
  `HostCopy.block_until_ready()`) waits. Out-of-range indices copy zeros. A
  `StackedMLAKVCache` gives the same copy as its contents unstacked (the one-device layout).
  `memory_kind`: "auto" (pinned_host when available), a memory kind, or None.
  `reuse`: a previous HostCopy of the same token count and chunking whose host
  buffers are recycled (it is consumed: its arrays are deleted). On one device the
  copy is stacked (see `HostCopy`) and `reuse`'s buffers go back to the pinned-host
  allocator for this copy; on a sharded cache they are donated to it. The cache is
  not modified or donated.
  """
  op = "get_cpu_copy"
  check_cache(cache, op, stacked=True)
  check_buffers(cache, op)
  idx = check_token_indices(token_indices, "token_indices", op)
  if chunk_size <= 0:
    raise ValueError(f"{op}: chunk_size must be positive, got {chunk_size}")
  tokens = int(idx.shape[0])
  layers = cache.config.layer_num
  if tokens == 0:
    return HostCopy(chunks=tuple(() for _ in range(layers)), token_count=0,
                    chunk_size=chunk_size)
  devices = _first_buffer(cache).devices()
  if memory_kind == "auto":
    memory_kind = host_memory_kind(next(iter(devices)))
  if reuse is not None:
    if not isinstance(reuse, HostCopy) or (reuse.token_count, reuse.chunk_size) != (tokens, chunk_size) \
        or len(reuse) != layers:
      raise ValueError(
          f"{op}: reuse must be a HostCopy of {tokens} tokens in chunks of {chunk_size} for "
          f"{layers} layers, got {reuse if not isinstance(reuse, HostCopy) else (reuse.token_count, reuse.chunk_size, len(reuse))}"
      )
  if len(devices) == 1 or isinstance(cache, StackedMLAKVCache):
    return _get_stacked(cache, idx, chunk_size, next(iter(devices)), memory_kind, reuse)
  # Where the gathered rows land: the buffers' sharding, moved to host memory.
  out_shardings = tuple(
      tuple(tuple(_host_sharding(buf, memory_kind) for buf in layer)
            for _ in _chunk_bounds(tokens, chunk_size))
      for layer in cache.buffers
  )
  if memory_kind is None:
    chunks = gather_chunks(cache, idx, chunk_size=chunk_size)
  elif reuse is None or reuse.stacked:
    chunks = _gather_to(out_shardings, False)(cache, idx, chunk_size=chunk_size)
  else:
    with warnings.catch_warnings():
      # Backends that cannot alias host buffers (CPU) say so; the copy is still right.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      chunks = _gather_to(out_shardings, True)(cache, idx, reuse.chunks, chunk_size=chunk_size)
  return HostCopy(chunks=chunks, token_count=tokens, chunk_size=chunk_size)


def _first_buffer(cache: MLAKVCache | StackedMLAKVCache) -> jax.Array:
  return cache.buffers[0] if isinstance(cache, StackedMLAKVCache) else cache.buffers[0][0]


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _gather_stacked(cache: MLAKVCache | StackedMLAKVCache, idx: jax.Array, chunk_size: int):
  """(chunk, buffer kind) -> (layer_num, n, 1, width) device arrays of rows `idx`. A
  `StackedMLAKVCache` gives the same arrays, each one gather of every layer's rows."""
  if isinstance(cache, StackedMLAKVCache):
    L = cache.layer_num
    rows = _stacked_rows(cache, idx)
    return tuple(
        tuple(reference.gather_rows(buf, rows[:, s:e].reshape(-1)).reshape(L, e - s,
                                                                           *buf.shape[1:])
              for buf in cache.buffers)
        for s, e in _chunk_bounds(idx.shape[0], chunk_size)
    )
  kinds = len(cache.buffers[0])
  return tuple(
      tuple(jnp.stack([reference.gather_rows(layer[k], idx[s:e]) for layer in cache.buffers])
            for k in range(kinds))
      for s, e in _chunk_bounds(idx.shape[0], chunk_size)
  )


def _get_stacked(cache: MLAKVCache, idx: jax.Array, chunk_size: int, device: Any,
                 memory_kind: str | None, reuse: HostCopy | None) -> HostCopy:
  """One device: gather every layer's rows of a chunk into one array per buffer kind, then
  one asynchronous `device_put` of all of them to `memory_kind`.

  On the H200 a `device_put` to `pinned_host` runs at the copy engine's ~47 GB/s and
  returns at once, while one jit whose 244 outputs (61 layers x 4 chunks) live in host
  memory ran at ~30 GB/s and blocked for most of the copy. `reuse`: its host buffers are
  released first, so the pinned-host allocator hands them to this copy.
  """
  stacked = _gather_stacked(cache, idx, chunk_size=chunk_size)
  if reuse is not None:
    for leaf in jax.tree.leaves((reuse.chunks, reuse.stacked)):
      leaf.delete()
  if memory_kind is not None:
    stacked = jax.device_put(
        stacked, jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind))
  return HostCopy(chunks=(), token_count=int(idx.shape[0]), chunk_size=chunk_size,
                  stacked=stacked)


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("start", "stop"))
def _scatter_stacked_chunk(cache: MLAKVCache | StackedMLAKVCache, kinds, idx: jax.Array,
                           start: int, stop: int) -> MLAKVCache | StackedMLAKVCache:
  """One chunk of a stacked copy (per kind (layer_num, n, 1, width)) into rows idx[start:stop]
  (of a `StackedMLAKVCache`: one scatter a kind, into every layer's rows)."""
  loc = idx[start:stop]
  if isinstance(cache, StackedMLAKVCache):
    flat = cache.every_layer(loc, cache.config.rows)                  # -1: skipped
    return dataclasses.replace(cache, buffers=tuple(
        reference.scatter_rows(buf, flat, rows.reshape(-1, *rows.shape[2:]))
        for buf, rows in zip(cache.buffers, kinds)))
  new = [list(layer) for layer in cache.buffers]
  for k, rows in enumerate(kinds):
    for layer_id, layer in enumerate(new):
      layer[k] = reference.scatter_rows(layer[k], loc, rows[layer_id])
  return dataclasses.replace(cache, buffers=tuple(tuple(layer) for layer in new))


@functools.partial(jax.jit, donate_argnames=("cache",))
def scatter_chunks(cache: MLAKVCache | StackedMLAKVCache, chunks, idx: jax.Array
                   ) -> MLAKVCache | StackedMLAKVCache:
  """Write nested chunks (`gather_chunks`' layout, host or device memory) into rows
  `idx` (T,) of every layer and buffer (donates `cache`); out-of-range rows are skipped.
  A `StackedMLAKVCache`: one scatter a chunk and plane, into every layer's rows."""
  chunk_size = chunks[0][0][0].shape[0] if chunks and chunks[0] else 1
  bounds = _chunk_bounds(idx.shape[0], chunk_size)
  if isinstance(cache, StackedMLAKVCache):
    new = list(cache.buffers)
    for c, (s, e) in enumerate(bounds):
      flat = cache.every_layer(idx[s:e], cache.config.rows)             # -1: skipped
      for k in range(len(new)):
        rows = jnp.concatenate([jax.device_put(layer_chunks[c][k], jax.memory.Space.Device)
                                for layer_chunks in chunks])
        new[k] = reference.scatter_rows(new[k], flat, rows)
    return dataclasses.replace(cache, buffers=tuple(new))
  new_layers = []
  for layer, layer_chunks in zip(cache.buffers, chunks):
    new = list(layer)
    for (s, e), chunk in zip(bounds, layer_chunks):
      for k, rows in enumerate(chunk):
        rows = jax.device_put(rows, jax.memory.Space.Device)
        new[k] = reference.scatter_rows(new[k], idx[s:e], rows)
    new_layers.append(tuple(new))
  return dataclasses.replace(cache, buffers=tuple(new_layers))


def load_cpu_copy(
    cache: MLAKVCache | StackedMLAKVCache,
    host_copy: HostCopy,
    token_indices: Sequence[int] | jax.Array,
) -> MLAKVCache | StackedMLAKVCache:
  """Write a `HostCopy` back into rows `token_indices` (donates `cache`).

  `token_indices` must have the copy's length (the rows may differ from the ones
  copied out). Out-of-range indices are skipped. A `StackedMLAKVCache` takes a one-device
  copy (of either kind of cache).
  """
  op = "load_cpu_copy"
  check_cache(cache, op, stacked=True)
  check_buffers(cache, op)
  idx = check_token_indices(token_indices, "token_indices", op)
  check_host_copy(cache, host_copy, idx, op)
  if host_copy.origin is not None:
    raise ValueError(
        f"{op}: this host copy came from a sharded cache ({host_copy.origin.kind} layout: "
        "its chunks are laid out for that layout); load it with "
        "jax_mla_cache.sharding.load_cpu_copy into a cache of the same layout")
  if idx.shape[0] == 0:
    return cache
  if isinstance(cache, StackedMLAKVCache) and not host_copy.stacked:
    raise TypeError(f"{op}: a StackedMLAKVCache loads the one-device layout of a HostCopy "
                    "only, not the nested one of a sharded cache")
  if host_copy.stacked:
    # Every chunk's host-to-device transfer is issued first (asynchronous, at the copy
    # engine's rate), then one donated scatter per chunk: the scatter of chunk k waits only
    # for its own transfer, so it runs while the later chunks are still in flight.
    sharding = _first_buffer(cache).sharding
    chunks = [jax.device_put(kinds, sharding) for kinds in host_copy.stacked]
    bounds = _chunk_bounds(int(idx.shape[0]), host_copy.chunk_size)
    for (start, stop), kinds in zip(bounds, chunks):
      cache = _scatter_stacked_chunk(cache, kinds, idx, start=start, stop=stop)
    return cache
  return scatter_chunks(cache, host_copy.chunks, idx)


def check_host_copy(cache: MLAKVCache, host_copy: HostCopy, idx: jax.Array, op: str) -> None:
  """Raise unless `host_copy` fits `cache`'s buffers and holds `len(idx)` tokens."""
  if not isinstance(host_copy, HostCopy):
    raise TypeError(f"{op}: host_copy must be a HostCopy, got {type(host_copy).__name__}")
  if idx.shape[0] != host_copy.token_count:
    raise ValueError(
        f"{op}: token_indices has {idx.shape[0]} entries, the host copy holds "
        f"{host_copy.token_count} tokens"
    )
  if host_copy.token_count and len(host_copy) != cache.config.layer_num:
    raise ValueError(
        f"{op}: host copy has {len(host_copy)} layers, the cache {cache.config.layer_num}"
    )
  shapes = cache.config.buffer_shapes()
  for kinds in host_copy.stacked:
    for rows, (shape, dtype) in zip(kinds, shapes, strict=True):
      if rows.dtype != dtype or rows.ndim != 4 or tuple(rows.shape[2:]) != tuple(shape[1:]):
        raise ValueError(
            f"{op}: host copy rows {rows.dtype}{tuple(rows.shape)} do not fit cache "
            f"buffers {jnp.dtype(dtype)}{tuple(shape)}"
        )
  for layer_chunks in host_copy.chunks:
    for chunk in layer_chunks:
      for rows, (shape, dtype) in zip(chunk, cache.config.buffer_shapes()):
        if rows.dtype != dtype or tuple(rows.shape[1:]) != tuple(shape[1:]):
          raise ValueError(
              f"{op}: host copy rows {rows.dtype}{tuple(rows.shape)} do not fit cache "
              f"buffers {jnp.dtype(dtype)}{tuple(shape)}"
          )
