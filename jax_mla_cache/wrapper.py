"""`MLATokenToKVPool`: the stateful, seed-compatible face of the functional core.

Each method runs the jitted functional op with the state donated, so buffers are
updated in place, and stores the new state on the pool (`pool.cache`). Arrays
obtained from the pool before an update (`get_key_buffer`, `pool.cache`) are
invalidated by that update: read them again after it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import numpy as np

from jax_mla_cache import attention, dispatch, offload, rope_write
from jax_mla_cache.config import MLACacheConfig, check_positive_int
from jax_mla_cache.state import MLAKVCache, init_cache

logger = logging.getLogger(__name__)
GB = 1024**3


class LayerTransferCounter(Protocol):
  def wait_until(self, layer_id: int) -> None: ...


def _layer_id(layer: Any) -> int:
  """An int, or any object with `.layer_id` (the seed passes the attention layer)."""
  return getattr(layer, "layer_id", layer)


def _resolve_device(device: Any, rank: int = 0):
  if device is None or isinstance(device, jax.Device):
    return device
  if not isinstance(device, str):
    raise TypeError(f"device must be None, a jax.Device or a string like 'cuda:0', got {device!r}")
  name, _, index = device.partition(":")
  platform = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "rocm": "gpu"}.get(name)
  if platform is None:
    raise ValueError(f"device must name 'cuda', 'gpu' or 'cpu', got {device!r}")
  try:
    devices = jax.devices(platform)
  except RuntimeError as e:
    raise ValueError(
        f"device {device!r}: no {platform} devices (have {[d.platform for d in jax.devices()]})"
    ) from e
  if not index:
    return devices[min(rank, len(devices) - 1)]
  if not index.isdigit() or int(index) >= len(devices):
    raise ValueError(f"device {device!r}: the index must be one of 0..{len(devices) - 1} "
                     f"({len(devices)} {platform} device(s))")
  return devices[int(index)]


class MLATokenToKVPool:
  """The MLA token-to-KV pool (the seed's constructor arguments and methods).

  Args (as the seed): size, model_dtype, dtype (JAX dtypes), quant_method (None
    or "per_token_head"), kv_lora_rank, qk_rope_head_dim, layer_num, device (None,
    a jax.Device, or "cuda[:i]"/"gpu[:i]"/"cpu"), enable_memory_saver,
    max_batch_size, max_context_len, page_size, rank. `enable_kv_cache_copy` and
    `enable_alt_stream` are accepted and ignored (moves always use one kernel;
    JAX schedules streams itself).
  Extra keyword args:
    implementation: None / "xla" / "pallas" for every op (see `dispatch`; None runs the
      kernels on sm_90+ and falls back to XLA for what they do not cover).
    debug_checks: validate indices on the host before each call and raise
      IndexError with the offending positions (costs a device-to-host sync). In
      this mode padding must target page 0 (loc 0), as the seed's convention.
    sharding: a sharding for every buffer (see `jax_mla_cache.sharding`).
    offload_chunk_page_num: tokens per chunk of host copies (seed: 1024).
    sanitize: the default of the writes' `sanitize` (SPEC §9: NaN stored as 0, +-inf as
      the largest finite value; `dispatch.set_mla_kv_buffer`). Each write method takes
      `sanitize=` to override it for one call.
  """

  def __init__(
      self,
      size: int,
      model_dtype: Any,
      dtype: Any,
      quant_method: str | None,
      kv_lora_rank: int,
      qk_rope_head_dim: int,
      layer_num: int,
      device: Any = None,
      enable_memory_saver: bool = False,
      max_batch_size: int | None = None,
      max_context_len: int | None = None,
      page_size: int = 1,
      rank: int = 0,
      enable_kv_cache_copy: bool = False,
      enable_alt_stream: bool = True,
      *,
      implementation: dispatch.Implementation = None,
      debug_checks: bool = False,
      sharding: jax.sharding.Sharding | None = None,
      offload_chunk_page_num: int = offload.OFFLOAD_CHUNK_TOKENS,
      sanitize: bool = False,
  ):
    self.config = MLACacheConfig(
        size=size, page_size=page_size, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, dtype=dtype,
        model_dtype=model_dtype, quant_method=quant_method,
    )
    self.size, self.page_size, self.layer_num = size, page_size, layer_num
    self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
    self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
    self.dtype, self.model_dtype = self.config.dtype, self.config.model_dtype
    self.store_dtype = self.dtype  # JAX indexes fp8 directly: no uint8 view needed
    self.quant_method = quant_method
    self.max_batch_size, self.max_context_len, self.rank = max_batch_size, max_context_len, rank
    self.enable_memory_saver = enable_memory_saver
    dispatch.implementation_order(implementation)  # raises for an unknown name
    self.implementation = implementation  # None keeps the fall-through to XLA per call
    self.debug_checks = debug_checks
    self.sanitize = bool(sanitize)
    self.offload_chunk_page_num = check_positive_int(offload_chunk_page_num,
                                                     "offload_chunk_page_num")
    self.layer_transfer_counter: LayerTransferCounter | None = None
    self.device = _resolve_device(device, rank)
    if self.device is not None and sharding is not None:
      raise ValueError("pass device or sharding, not both")
    self._sharding = sharding
    self.page_size_bytes = self.config.page_size_bytes
    self._cache: MLAKVCache | None = self._new_cache()
    logger.info(
        "MLATokenToKVPool: %d layers x %d rows, %.2f GB, implementation=%s",
        layer_num, self.config.rows, self.get_kv_size_bytes() / GB,
        dispatch.resolve_implementation(implementation),
    )

  def _new_cache(self) -> MLAKVCache:
    return init_cache(self.config, device=self.device, sharding=self._sharding)

  # ------------------------------------------------------------------ state
  @property
  def cache(self) -> MLAKVCache:
    """The current state. Invalidated (donated) by the next update."""
    if self._cache is None:
      raise RuntimeError(
          "MLATokenToKVPool: the cache memory was released by release_memory_occupation(); "
          "call resume_memory_occupation() first"
      )
    return self._cache

  @cache.setter
  def cache(self, value: MLAKVCache) -> None:
    if not isinstance(value, MLAKVCache) or value.config != self.config:
      raise TypeError("pool.cache must be an MLAKVCache with the pool's config")
    self._cache = value

  @property
  def kv_buffer(self) -> list:
    """The seed's attribute: per layer, the buffer (plain) or (nope, scale, rope)."""
    return [layer if self.config.quantized else layer[0] for layer in self.cache.buffers]

  def _check_indices(self, op: str, name: str, idx: Any, limit: int | None = None) -> None:
    if not self.debug_checks:
      return
    limit = self.config.rows if limit is None else limit
    values = np.asarray(jax.device_get(idx)).reshape(-1)
    bad = np.nonzero((values < 0) | (values >= limit))[0]
    if bad.size:
      shown = ", ".join(f"{name}[{i}]={values[i]}" for i in bad[:8])
      raise IndexError(
          f"{op}: {bad.size} index(es) outside [0, {limit}): {shown}"
          + (" ..." if bad.size > 8 else "")
      )

  def _check_pages(self, op: str, page_table: Any, seq_lens: Any) -> None:
    """debug_checks of a decode call: every page a sequence's length reaches must be in
    [0, rows // page_size) (columns past the length, e.g. -1 padding, are not read)."""
    table = np.asarray(jax.device_get(page_table))
    lens = np.asarray(jax.device_get(seq_lens)).reshape(-1)
    if table.ndim != 2 or lens.shape[0] != table.shape[0]:
      return   # (the op itself raises, naming the argument)
    limit = self.config.rows // self.page_size
    reached = np.arange(table.shape[1])[None, :] * self.page_size < lens[:, None]
    bad = np.argwhere(reached & ((table < 0) | (table >= limit)))
    if bad.size:
      shown = ", ".join(f"page_table[{b}, {p}]={table[b, p]}" for b, p in bad[:8])
      raise IndexError(
          f"{op}: {len(bad)} page id(s) within the sequence lengths outside [0, {limit}): "
          f"{shown}" + (" ..." if len(bad) > 8 else ""))

  def _wait(self, layer_id: int) -> None:
    if self.layer_transfer_counter is not None:
      self.layer_transfer_counter.wait_until(layer_id)

  # ------------------------------------------------------------------ writes
  def _sanitize(self, sanitize: bool | None) -> bool:
    return self.sanitize if sanitize is None else bool(sanitize)

  def set_kv_buffer(
      self, layer: Any, loc: Any, cache_k: jax.Array, cache_v: Any = None,
      k_scale: float | None = None, v_scale: float | None = None, *,
      sanitize: bool | None = None,
  ) -> None:
    """Write whole rows `cache_k` (T, 1, R+Rr) at `loc`.

    `cache_v`, `k_scale` and `v_scale` are accepted for the seed's signature and
    ignored (MLA stores one latent row; the seed ignores them too). `sanitize`: None
    takes the pool's default.
    """
    self._check_indices("set_kv_buffer", "loc", loc)
    self._cache = dispatch.set_kv_buffer(
        self.cache, _layer_id(layer), loc, cache_k, implementation=self.implementation,
        sanitize=self._sanitize(sanitize),
    )

  def set_mla_kv_buffer(
      self, layer: Any, loc: Any, cache_k_nope: jax.Array, cache_k_rope: jax.Array, *,
      sanitize: bool | None = None,
  ) -> None:
    """Write `[nope (T,1,R) | rope (T,1,Rr)]` at `loc` (quantizing in per_token_head).

    `sanitize`: None takes the pool's default."""
    self._check_indices("set_mla_kv_buffer", "loc", loc)
    self._cache = dispatch.set_mla_kv_buffer(
        self.cache, _layer_id(layer), loc, cache_k_nope, cache_k_rope,
        implementation=self.implementation, sanitize=self._sanitize(sanitize),
    )

  def rope_set_mla_kv_buffer(
      self, layer: Any, loc: Any, positions: Any, q_nope: jax.Array, q_rope: jax.Array,
      k_nope: jax.Array, k_rope: jax.Array, cos_sin_cache: Any, *, is_neox: bool = False,
      q_out_dtype: Any = None, sanitize: bool | None = None,
  ) -> jax.Array:
    """The fused decode write (`rope_write.rope_set_mla_kv_buffer`, SPEC §8): rotates
    q_rope (T,H,Rr) and k_rope (T,1,Rr) by `positions`, writes [k_nope | rope(k_rope)] at
    `loc` and returns q_out (T, H, R+Rr) = [q_nope | rope(q_rope)]. `sanitize`: None
    takes the pool's default."""
    self._check_indices("rope_set_mla_kv_buffer", "loc", loc)
    self._cache, q_out = rope_write.rope_set_mla_kv_buffer(
        self.cache, _layer_id(layer), loc, positions, q_nope, q_rope, k_nope, k_rope,
        cos_sin_cache, is_neox=is_neox, q_out_dtype=q_out_dtype,
        sanitize=self._sanitize(sanitize), implementation=self.implementation,
    )
    return q_out

  # ------------------------------------------------------------------ reads
  def get_mla_kv_buffer(
      self, layer: Any, loc: Any, dst_dtype: Any = None
  ) -> tuple[jax.Array, jax.Array]:
    """(nope (T,1,R), rope (T,1,Rr)) of rows `loc` in dst_dtype (dequantized).

    Default dst_dtype: `dtype` (plain) or `model_dtype` (per_token_head; the seed
    would return fp8 here, which loses the scale).
    """
    self._check_indices("get_mla_kv_buffer", "loc", loc)
    return dispatch.get_mla_kv_buffer(
        self.cache, _layer_id(layer), loc, dst_dtype, implementation=self.implementation
    )

  def mla_decode(
      self, layer: Any, q: jax.Array, page_table: Any, seq_lens: Any, *, sm_scale: float
  ) -> tuple[jax.Array, jax.Array]:
    """Paged absorbed-MLA decode attention over the layer's cache, read in place (SPEC §7).

    q (B, s_q, H, R+Rr); page_table (B, P) page ids; seq_lens (B,). Returns
    (out (B, s_q, H, R) q.dtype, lse (B, s_q, H) float32). See `jax_mla_cache.mla_decode`.
    """
    if self.debug_checks:
      self._check_pages("mla_decode", page_table, seq_lens)
    layer_id = _layer_id(layer)
    self._wait(dispatch.check_layer_id(self.cache, layer_id, "mla_decode"))
    return attention.mla_decode(self.cache, layer_id, q, page_table, seq_lens,
                                sm_scale=sm_scale, implementation=self.implementation)

  def get_key_buffer(self, layer_id: int):
    """Plain: the layer's (rows,1,R+Rr) buffer; per_token_head: (nope, scale, rope)."""
    layer_id = dispatch.check_layer_id(self.cache, _layer_id(layer_id), "get_key_buffer")
    self._wait(layer_id)
    layer = self.cache.layer(layer_id)
    return layer if self.config.quantized else layer[0]

  def get_value_buffer(self, layer_id: int):
    """Plain: the nope part (rows,1,R) (a new array in JAX); per_token_head: (nope, scale)."""
    layer_id = dispatch.check_layer_id(self.cache, _layer_id(layer_id), "get_value_buffer")
    self._wait(layer_id)
    layer = self.cache.layer(layer_id)
    return layer[:2] if self.config.quantized else layer[0][..., : self.kv_lora_rank]

  def get_kv_buffer(self, layer_id: int):
    return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

  # ------------------------------------------------------------------ moves
  def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
    """`rows[tgt[i]] = old_rows[src[i]]` in every layer and buffer (one launch)."""
    self._check_indices("move_kv_cache", "tgt_loc", tgt_loc)
    self._check_indices("move_kv_cache", "src_loc", src_loc)
    self._cache = dispatch.move_kv_cache(
        self.cache, tgt_loc, src_loc, implementation=self.implementation
    )

  def move_kv_pages(self, tgt_pages: Any, src_pages: Any) -> None:
    """Copy whole pages in every layer and buffer (copy-on-write, defragmentation)."""
    npages = self.config.rows // self.page_size
    self._check_indices("move_kv_pages", "tgt_pages", tgt_pages, npages)
    self._check_indices("move_kv_pages", "src_pages", src_pages, npages)
    self._cache = dispatch.move_kv_pages(
        self.cache, tgt_pages, src_pages, implementation=self.implementation
    )

  # ------------------------------------------------------------------ host tier
  def get_cpu_copy(
      self, token_indices: Any, reuse: offload.HostCopy | None = None
  ) -> offload.HostCopy:
    """Rows `token_indices` of every layer in host memory (asynchronous; blocks on use).

    Indexable as the seed's nested list: `copy[layer][chunk][buffer]`. `reuse`: an
    earlier copy of the same size whose host buffers are recycled (it is consumed).
    """
    self._check_indices("get_cpu_copy", "token_indices", token_indices)
    return offload.get_cpu_copy(self.cache, token_indices, chunk_size=self.offload_chunk_page_num,
                                reuse=reuse)

  def load_cpu_copy(self, kv_cache_cpu: offload.HostCopy, token_indices: Any) -> None:
    """Write a host copy back into rows `token_indices`."""
    self._check_indices("load_cpu_copy", "token_indices", token_indices)
    self._cache = offload.load_cpu_copy(self.cache, kv_cache_cpu, token_indices)

  # ------------------------------------------------------------------ sizes
  def get_kv_size_bytes(self) -> int:
    """Bytes of all buffers of all layers."""
    return self.config.kv_size_bytes

  def _all_buffers_component_major(self) -> list[jax.Array]:
    layers = self.cache.buffers
    return [layer[k] for k in range(len(layers[0])) for layer in layers]

  def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
    """(device pointers, byte lengths, bytes per page) of every buffer, for transfer engines.

    Plain: one entry per layer. per_token_head: component-major (all layers' nope,
    then all scales, then all ropes). Pointers change after
    resume_memory_occupation(); read them again then.
    """
    bufs = self._all_buffers_component_major()
    ptrs = [_buffer_pointer(b) for b in bufs]
    lens = [int(b.nbytes) for b in bufs]
    item_lens = [int(np.prod(b.shape[1:])) * b.dtype.itemsize * self.page_size for b in bufs]
    return ptrs, lens, item_lens

  def get_layerwise_buf_info_offsets(self, start_idx: int = 0) -> list[list[int]]:
    components = 3 if self.config.quantized else 1
    return [
        [start_idx + i * self.layer_num + layer_id for i in range(components)]
        for layer_id in range(self.layer_num)
    ]

  def register_layer_transfer_counter(self, layer_transfer_counter: LayerTransferCounter) -> None:
    """Called by the buffer getters (`wait_until(layer_id)`) before handing out a layer."""
    self.layer_transfer_counter = layer_transfer_counter

  # ------------------------------------------------------------------ memory saver
  def release_memory_occupation(self) -> None:
    """Free the device buffers (enable_memory_saver=True). Contents are lost."""
    if not self.enable_memory_saver:
      raise RuntimeError("release_memory_occupation needs enable_memory_saver=True")
    if self._cache is None:
      return
    for buf in self._cache.flat_buffers():
      buf.delete()
    self._cache = None

  def resume_memory_occupation(self) -> None:
    """Re-create zeroed buffers after release (new pointers: re-read buf infos)."""
    if not self.enable_memory_saver:
      raise RuntimeError("resume_memory_occupation needs enable_memory_saver=True")
    if self._cache is None:
      self._cache = self._new_cache()

  @property
  def memory_released(self) -> bool:
    return self._cache is None


def _buffer_pointer(buf: jax.Array) -> int:
  shard = buf.addressable_shards[0].data
  return int(shard.unsafe_buffer_pointer())
